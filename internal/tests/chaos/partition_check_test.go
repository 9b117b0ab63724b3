package chaos

import (
	"fmt"
	"math"
	"slices"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/dispenser-dev/dispenser/protocol"
)

// The checks of TestPartitions over the load's records: availability on
// the side that should keep answering, answers again after every heal,
// and failure kinds. Each returns what it found wrong, one message per
// finding (empty: none), so that partition_self_test.go can feed them
// misbehaving records.

// inWindow reports whether t lies in one of the intervals.
func inWindow(t int64, intervals [][2]int64) bool {
	for _, iv := range intervals {
		if iv[0] <= t && t <= iv[1] {
			return true
		}
	}
	return false
}

// checkSides returns, for every fault window whose sides say so
// (assertRest), the requests of clients on the rest's side (the
// majority) that failed although they were sent after the fault was
// detected (excusedBefore) and before it was healed, outside the excused
// intervals (a worker killed meanwhile) and, if the ordered tag's owner
// was on the cut side, not for the ordered tag. One message per fault
// window, subject and failure kind, with the count and an example.
func checkSides(l *load, fl *faultLog, sides []faultSides, describe func(string) string) []string {
	var out []string
	for w, s := range sides {
		if !s.assertRest {
			continue
		}
		end := s.healed
		if end == 0 {
			end = fl.windows[w].end
		}
		type key struct{ subject, kind string }
		count := map[key]int{}
		example := map[key]string{}
		var keys []key
		for _, c := range l.clients {
			if slices.Contains(s.cut, c.node) || c.target.ordered && s.orderedExcused || c.target.snowflake && s.snowflakeExcused {
				continue
			}
			for _, f := range c.fails {
				if f.sent < s.excusedBefore || f.sent >= end || inWindow(f.sent, s.excused) {
					continue
				}
				k := key{c.target.name, f.kind}
				if count[k] == 0 {
					keys = append(keys, k)
					by := "no reply"
					if f.worker != "" {
						by = "from " + describe(f.worker)
					}
					example[k] = fmt.Sprintf("client on n%d sent at %.3fs, failed at %.3fs (%s): %s", c.node, float64(f.sent)/1e9, float64(f.got)/1e9, by, f.err)
				}
				count[k]++
			}
		}
		for _, k := range keys {
			out = append(out, fmt.Sprintf("%s at %.3fs (cut side %s n%v, healed at %.3fs): %d %s requests on the %s side failed with %s after the fault took effect (%.3fs), e.g. %s",
				fl.windows[w].kind, float64(fl.windows[w].start)/1e9, s.cutName, s.cut, float64(end)/1e9,
				count[k], k.subject, s.restName, k.kind, float64(s.excusedBefore)/1e9, example[k]))
		}
	}
	return out
}

// healDelay is, for one heal, how long until the last of the node and
// subject pairs was answered to a request sent after it, and which pair
// that was; missing lists the pairs never answered.
type healDelay struct {
	last    time.Duration
	which   string
	missing []string
}

// healDelayOf measures one heal at at over the looping clients.
func healDelayOf(clients []*client, at int64) healDelay {
	first := map[string]int64{} // "subject on nX" -> first answer
	var pairs []string
	for _, c := range clients {
		k := fmt.Sprintf("%s on n%d", c.target.name, c.node)
		if _, ok := first[k]; !ok {
			pairs = append(pairs, k)
			first[k] = -1
		}
		i := sort.Search(len(c.replies), func(i int) bool { return c.replies[i].sent >= at })
		if i < len(c.replies) && (first[k] < 0 || c.replies[i].got < first[k]) {
			first[k] = c.replies[i].got
		}
	}
	var d healDelay
	for _, k := range pairs {
		if first[k] < 0 {
			d.missing = append(d.missing, k)
			continue
		}
		if got := time.Duration(first[k] - at); got > d.last || d.which == "" {
			d.last, d.which = got, k
		}
	}
	return d
}

// checkHealed returns, for every heal, the node and subject pairs not
// answered to a request sent after the heal within bound of it.
func checkHealed(clients []*client, heals []healMark, bound time.Duration) []string {
	var out []string
	for _, h := range heals {
		d := healDelayOf(clients, h.at)
		if len(d.missing) > 0 {
			out = append(out, fmt.Sprintf("heal of %s at %.3fs: never answered again: %s", h.fault, float64(h.at)/1e9, strings.Join(d.missing, ", ")))
		}
		if d.last > bound {
			out = append(out, fmt.Sprintf("heal of %s at %.3fs: %s answered again only after %v, bound %v", h.fault, float64(h.at)/1e9, d.which, d.last.Round(time.Millisecond), bound))
		}
	}
	return out
}

// healDelays describes every heal's delay, for the log.
func healDelays(clients []*client, heals []healMark) []string {
	var out []string
	for _, h := range heals {
		d := healDelayOf(clients, h.at)
		out = append(out, fmt.Sprintf("%s healed at %.3fs: every subject answered on every node after %v (last: %s)%s",
			h.fault, float64(h.at)/1e9, d.last.Round(time.Millisecond), d.which, strings.Repeat(" never: "+strings.Join(d.missing, ", "), min(1, len(d.missing)))))
	}
	return out
}

// partitionFailureKinds are the failures a request may have in
// TestPartitions: 503 (the worker cannot serve: fenced, buffers dry, the
// ordered tag's owner changing) and a timeout (the request reached a
// worker on the other side of a cut, or a frozen one). A 500 is reported
// by load.check. A client on the cut side of a fault may also find no
// responders (its node's only worker frozen or killed, the others out of
// reach).
var partitionFailureKinds = map[string]bool{protocol.CodeUnavailable: true, "timeout": true, protocol.CodeInternal: true}

// checkFailureKinds returns one message per failure kind outside
// partitionFailureKinds, with the count and an example.
func checkFailureKinds(l *load, fl *faultLog, sides []faultSides) []string {
	count := map[string]int{}
	example := map[string]string{}
	cutOff := func(node int, t int64) bool {
		for w, s := range sides {
			end := s.healed
			if end == 0 {
				end = fl.windows[w].end
			}
			if slices.Contains(s.cut, node) && fl.windows[w].start <= t && t <= end+int64(fl.grace) {
				return true
			}
		}
		return false
	}
	for _, c := range l.clients {
		for _, f := range c.fails {
			// No responders: the client's node was cut off, or, for
			// snowflake, no worker could issue (each left the queue
			// group: what a 503 said before).
			if partitionFailureKinds[f.kind] || f.kind == "no responders" && (cutOff(c.node, f.got) || c.target.snowflake) {
				continue
			}
			if count[f.kind] == 0 {
				example[f.kind] = fmt.Sprintf("%s client on n%d at %.3fs: %s", c.target.name, c.node, float64(f.got)/1e9, f.err)
			}
			count[f.kind]++
		}
	}
	var out []string
	for _, k := range sortedKeys(count) {
		out = append(out, fmt.Sprintf("%d requests failed with %q, want only IDs, 503 or a timeout, e.g. %s", count[k], k, example[k]))
	}
	return out
}

// availRow is one row of the availability table.
type availRow struct {
	requests, failed, unavailable, timeouts int
	gap                                     time.Duration
}

// availabilityTable returns, per fault kind, side and subject, the
// requests answered or failed between the fault's start and its heal
// (its end if not healed) plus the fault log's grace, the failures, and
// the longest time a client on that side went without an answer for
// that subject in that span (the longest of the fault's windows).
func availabilityTable(l *load, fl *faultLog, sides []faultSides) string {
	type key struct{ fault, side, subject string }
	rows := map[key]*availRow{}
	var keys []key
	for w, s := range sides {
		win := fl.windows[w]
		end := s.healed
		if end == 0 {
			end = win.end
		}
		end += int64(fl.grace)
		got := map[key][]int64{}
		seen := map[key]bool{}
		for _, c := range l.clients {
			k := key{win.kind, s.side(c.node), c.target.name}
			seen[k] = true
			r := rows[k]
			if r == nil {
				r = &availRow{}
				rows[k] = r
				keys = append(keys, k)
			}
			for _, rp := range c.replies {
				if rp.got >= win.start && rp.got <= end {
					r.requests++
					got[k] = append(got[k], rp.got)
				}
			}
			for _, f := range c.fails {
				if f.got >= win.start && f.got <= end {
					r.requests++
					r.failed++
					switch f.kind {
					case protocol.CodeUnavailable:
						r.unavailable++
					case "timeout":
						r.timeouts++
					}
				}
			}
		}
		for k, ts := range got {
			slices.Sort(ts)
			prev, gap := win.start, int64(0)
			for _, t := range ts {
				gap, prev = max(gap, t-prev), t
			}
			gap = max(gap, end-prev)
			rows[k].gap = max(rows[k].gap, time.Duration(gap))
		}
		for k := range seen {
			if got[k] == nil {
				rows[k].gap = max(rows[k].gap, time.Duration(end-win.start))
			}
		}
	}
	var b strings.Builder
	tw := tabwriter.NewWriter(&b, 0, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(tw, "fault\tside\tsubject\trequests\tfailed\t503\ttimeout\tlongest gap\t\n")
	for _, k := range keys {
		r := rows[k]
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%d\t%d\t%d\t%v\t\n", k.fault, k.side, k.subject, r.requests, r.failed, r.unavailable, r.timeouts, r.gap.Round(10*time.Millisecond))
	}
	tw.Flush()
	return b.String()
}

// checkNo503 returns the 503s of plain-tag and snowflake requests that a
// worker able to serve could have answered (issue 37): a worker that cannot
// serve an endpoint is not in its queue group, and hands on what reached
// it in the moment before it left, so a 503 is a finding unless no worker
// the client could reach was able to serve: the client's node was on the
// cut side of a fault while it lasted (from its start to its heal), a
// bridge was on (leader elections flap on every node), the leases were too
// short to ride out a leader election (snowflakeExcused, short mode), or
// the request was sent in an excused interval (a worker killed and
// started again). After a heal nothing excuses a 503, on any node: a
// worker that comes back joins only once it can serve; but leases too
// short to ride out an election keep snowflake fenced until the workers
// lease again, so with snowflakeExcused its excuse lasts until afterHeal
// past the heal (the heal bound); and a healed node is still cut off until
// its routes are back (its own worker left the snowflake group while it
// was cut off, and may have no segments): excused until every connection
// of every route was seen back (faultSides.routed), not a moment longer,
// for from then on the node has a route to the majority. For snowflake, "no responders" counts as
// a 503: a worker that cannot issue leaves the queue group, so when none
// can, nobody answers. Ordered tags are left out: an owner move answers
// 503 by design (docs/ordered-tags.md). One message per subject and node,
// with the count and an example.
//
// shortLeases says the run's leases are too short to ride out a leader
// election (rideOutLease): every fault may then fence snowflake workers
// on any side, as snowflakeExcused says of one.
func checkNo503(l *load, fl *faultLog, sides []faultSides, afterHeal time.Duration, shortLeases bool, describe func(string) string) []string {
	excused := func(c *client, f failure) bool {
		for w, s := range sides {
			win := fl.windows[w]
			end := s.healed
			if end == 0 {
				end = win.end
			}
			short := c.target.snowflake && (s.snowflakeExcused || shortLeases)
			// A healed node's routes come back seconds after the heal
			// (healing the links themselves took up to 15 s on a busy
			// machine, and the last connections of a route's pool
			// follow the first by up to a reconnect delay); until then
			// its clients reach only its own worker, which left the
			// snowflake group while it was cut off and may have no
			// segments. The nodes of a bridge kept their routes to the
			// third.
			rejoining := slices.Contains(s.cut, c.node) && win.kind != "bridge" && f.sent < s.routed
			switch {
			case f.sent < win.start:
			case end == 0 || f.sent < end:
				if slices.Contains(s.cut, c.node) || win.kind == "bridge" || short || inWindow(f.sent, s.excused) {
					return true
				}
			case short && f.sent < end+int64(afterHeal), rejoining:
				return true
			}
		}
		return false
	}
	type key struct {
		subject string
		node    int
	}
	count := map[key]int{}
	example := map[key]string{}
	var keys []key
	for _, c := range l.clients {
		if c.target.ordered {
			continue
		}
		for _, f := range c.fails {
			unavailable := f.kind == protocol.CodeUnavailable || c.target.snowflake && f.kind == "no responders"
			if !unavailable || excused(c, f) {
				continue
			}
			k := key{c.target.name, c.node}
			if count[k] == 0 {
				keys = append(keys, k)
				by := "no worker named"
				if f.worker != "" {
					by = "from " + describe(f.worker)
				}
				example[k] = fmt.Sprintf("sent at %.3fs during %s (%s): %s", float64(f.sent)/1e9, fl.attribute(f.sent), by, f.err)
			}
			count[k]++
		}
	}
	var out []string
	for _, k := range keys {
		out = append(out, fmt.Sprintf("%d %s requests of clients on n%d answered 503 (or no responders) while a worker able to serve them was reachable, e.g. %s",
			count[k], k.subject, k.node, example[k]))
	}
	return out
}

// failureClass names why a failed request of client c failed, as far as
// the fault records tell: on a cut side while its node was cut off (until
// its routes were back), in flight when a link was cut (a timeout sent
// from partTimeout before a cut to inFlight after it), sent while a
// majority worker was being killed, during a bridge, an ordered tag's
// (owner moves answer 503 by design), or "unclassified".
func failureClass(c *client, f failure, fl *faultLog, sides []faultSides) string {
	if c.target.ordered {
		return "ordered"
	}
	for w, s := range sides {
		win := fl.windows[w]
		end := max(s.healed, s.routed)
		if end == 0 {
			end = win.end
		}
		if end == 0 {
			end = math.MaxInt64
		}
		if slices.Contains(s.cut, c.node) && win.start <= f.sent && f.sent <= end && win.kind != "bridge" {
			return "cut side"
		}
	}
	for w, s := range sides {
		if f.kind == "timeout" && slices.ContainsFunc(s.cuts, func(cut int64) bool {
			return cut-int64(partTimeout) <= f.sent && f.sent <= cut+int64(inFlight)
		}) && fl.windows[w].kind != "latency" && fl.windows[w].kind != "pg-cut" {
			return "in flight"
		}
		if inWindow(f.sent, s.excused) {
			return "worker killed"
		}
		win := fl.windows[w]
		if win.kind == "bridge" && win.start <= f.sent && (win.end == 0 || f.sent <= max(s.healed, s.routed, win.end)) {
			return "bridge"
		}
	}
	return "unclassified"
}

// failureClasses are failureClass's answers, in the order nodeTable shows
// them.
var failureClasses = []string{"cut side", "in flight", "worker killed", "bridge", "ordered", "unclassified"}

// nodeTable returns, per node and subject over the whole run, the
// requests, the failures by kind (503, no responders, timeout, other) and
// by failureClass.
func nodeTable(l *load, fl *faultLog, sides []faultSides) string {
	type key struct {
		node    int
		subject string
	}
	type row struct {
		requests, failed, unavailable, noResponders, timeouts, other int
		class                                                        map[string]int
	}
	rows := map[key]*row{}
	var keys []key
	var odd []string // the unclassified, the first 20
	for _, c := range l.clients {
		k := key{c.node, c.target.name}
		r := rows[k]
		if r == nil {
			r = &row{class: map[string]int{}}
			rows[k] = r
			keys = append(keys, k)
		}
		r.requests += len(c.replies) + len(c.fails)
		for _, f := range c.fails {
			r.failed++
			switch f.kind {
			case protocol.CodeUnavailable:
				r.unavailable++
			case "no responders":
				r.noResponders++
			case "timeout":
				r.timeouts++
			default:
				r.other++
			}
			cl := failureClass(c, f, fl, sides)
			r.class[cl]++
			if cl == "unclassified" && len(odd) < 20 {
				by := ""
				if f.worker != "" {
					by = " from " + f.worker
				}
				odd = append(odd, fmt.Sprintf("n%d %s: %s sent at %.3fs during %s, failed at %.3fs%s: %s",
					c.node, c.target.name, f.kind, float64(f.sent)/1e9, fl.attribute(f.sent), float64(f.got)/1e9, by, f.err))
			}
		}
	}
	sort.Slice(keys, func(i, j int) bool {
		if keys[i].node != keys[j].node {
			return keys[i].node < keys[j].node
		}
		return keys[i].subject < keys[j].subject
	})
	var b strings.Builder
	tw := tabwriter.NewWriter(&b, 0, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(tw, "node\tsubject\trequests\tfailed\t503\tno responders\ttimeout\tother\t%s\t\n", strings.Join(failureClasses, "\t"))
	for _, k := range keys {
		r := rows[k]
		fmt.Fprintf(tw, "n%d\t%s\t%d\t%d\t%d\t%d\t%d\t%d", k.node, k.subject, r.requests, r.failed, r.unavailable, r.noResponders, r.timeouts, r.other)
		for _, cl := range failureClasses {
			fmt.Fprintf(tw, "\t%d", r.class[cl])
		}
		fmt.Fprintf(tw, "\t\n")
	}
	tw.Flush()
	if len(odd) > 0 {
		b.WriteString("unclassified (the first 20):\n" + strings.Join(odd, "\n"))
	}
	return b.String()
}
