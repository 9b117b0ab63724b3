package chaos

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"maps"
	"math"
	"math/rand/v2"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"text/tabwriter"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"

	"github.com/dispenser-dev/dispenser/internal/tests/check"
	"github.com/dispenser-dev/dispenser/protocol"
)

// target is what a load client asks for: one tag's segment IDs or snowflake
// IDs.
type target struct {
	name      string // the tag, or "snowflake"
	subject   string
	snowflake bool
	ordered   bool // an ordered tag: its IDs must increase linearizably
	clients   int  // clients of this target; 0: loadSpec.clients
}

func segmentTarget(tag string) target { return target{name: tag, subject: "id.segment." + tag} }

// orderedTarget is an ordered tag driven by clients concurrent clients.
func orderedTarget(tag string, clients int) target {
	return target{name: tag, subject: "id.segment." + tag, ordered: true, clients: clients}
}

var snowflakeTarget = target{name: "snowflake", subject: "id.snowflake", snowflake: true}

// Snowflake ID layout (see package snowflake): 41 bits of milliseconds, 10
// worker bits, 12 sequence bits.
const (
	sequenceBits = 12
	workerMask   = 1<<10 - 1
)

// loadSpec describes a load.
type loadSpec struct {
	targets  []target
	clients  int           // per target
	rate     float64       // requests per second per client; 0: back to back
	maxCount int           // each request asks for 1..maxCount IDs
	timeout  time.Duration // of one request
	seed     uint64
}

// load is running load: clients, each sending requests one after the other
// with the Id-Worker header and recording every reply, so that per client
// the order of IDs from one worker is the order the worker issued them.
type load struct {
	spec    loadSpec
	nc      *nats.Conn
	t0      time.Time
	ctx     context.Context
	cancel  context.CancelFunc
	wg      sync.WaitGroup
	once    sync.Once
	clients []*client // the looping clients, then extra ones (newClient)

	answered atomic.Int64 // successful requests so far

	mu      sync.Mutex
	index   map[string]int32 // micro service ID -> worker index
	workers []string         // worker index -> micro service ID
}

// client is one sequential requester. Only its own goroutine touches it
// until the load has stopped.
type client struct {
	l      *load
	nc     *nats.Conn // the connection it requests on
	node   int        // index of that connection in startLoadOn's conns
	target target
	rng    *rand.Rand
	local  map[string]int32 // cache of l.index

	ids     []int64 // every ID received, in order
	replies []reply
	fails   []failure
	inc     check.Increasing // per lastKey: worker (and snowflake worker bits)
	bad     []string         // protocol and ordering violations (the first few)
	nbad    int
	// lastSent is when the last request that got IDs was sent (since
	// load start), for the test goroutine to wait on while the load runs.
	lastSent atomic.Int64
}

// reply is one successful request. Times are nanoseconds since load start.
type reply struct {
	sent, got int64
	worker    int32 // worker index
	off, n    int32 // the IDs are client.ids[off : off+n]
}

// failure is one failed request.
type failure struct {
	sent, got int64
	kind      string // error code ("503", "500") or transport failure ("timeout", "no responders", "nats")
	err       string
	worker    string // micro service ID of the worker that answered with an error; "" for transport failures
}

type lastKey struct {
	worker int32
	bits   int64 // snowflake worker bits; 0 for segments
}

// startLoad starts spec's clients on nc; Cleanup stops them.
func startLoad(tb testing.TB, nc *nats.Conn, spec loadSpec) *load {
	tb.Helper()
	return startLoadOn(tb, []*nats.Conn{nc}, spec)
}

// startLoadOn starts spec's clients on each of conns (client.node is the
// index of its connection), all on one clock and checked together by
// load.check; Cleanup stops them.
func startLoadOn(tb testing.TB, conns []*nats.Conn, spec loadSpec) *load {
	tb.Helper()
	nc := conns[0]
	if spec.maxCount < 1 {
		spec.maxCount = 1
	}
	if spec.timeout == 0 {
		spec.timeout = time.Second
	}
	l := &load{spec: spec, nc: nc, t0: time.Now(), index: map[string]int32{}}
	l.ctx, l.cancel = context.WithCancel(context.Background())
	tb.Cleanup(l.stop)
	for node, nc := range conns {
		for i, tg := range spec.targets {
			for j := range cmp.Or(tg.clients, spec.clients) {
				c := l.newClient(tg, spec.seed+uint64(node*100000+i*1000+j))
				c.nc, c.node = nc, node
				l.wg.Add(1)
				go c.loop()
			}
		}
	}
	return l
}

// newClient adds a client that does not loop, for requests of the test's
// own (only the test goroutine may use it).
func (l *load) newClient(tg target, seed uint64) *client {
	c := &client{l: l, nc: l.nc, target: tg, rng: rand.New(rand.NewPCG(seed, 0x5eed)),
		local: map[string]int32{}}
	l.clients = append(l.clients, c)
	return c
}

// now returns the time since the load started in nanoseconds.
func (l *load) now() int64 { return int64(time.Since(l.t0)) }

// stop stops the clients and waits for their last requests.
func (l *load) stop() {
	l.once.Do(func() {
		l.cancel()
		l.wg.Wait()
	})
}

// workerIndex interns a micro service ID.
func (l *load) workerIndex(id string) int32 {
	l.mu.Lock()
	defer l.mu.Unlock()
	i, ok := l.index[id]
	if !ok {
		i = int32(len(l.workers))
		l.index[id] = i
		l.workers = append(l.workers, id)
	}
	return i
}

func (l *load) workerID(i int32) string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.workers[i]
}

func (c *client) loop() {
	defer c.l.wg.Done()
	var interval time.Duration
	if c.l.spec.rate > 0 {
		interval = time.Duration(float64(time.Second) / c.l.spec.rate)
	}
	next := time.Now().Add(time.Duration(c.rng.Int64N(int64(interval) + 1))) // spread the clients
	for c.l.ctx.Err() == nil {
		if interval > 0 {
			now := time.Now()
			if now.Sub(next) > time.Second { // do not catch up after a stall
				next = now
			}
			if !c.sleep(next.Sub(now)) {
				return
			}
			next = next.Add(interval)
		}
		if !c.request(1 + c.rng.IntN(c.l.spec.maxCount)) {
			c.sleep(10 * time.Millisecond) // no hot loop on instant failures
		}
	}
}

// sleep sleeps d or until the load stops, and reports whether it slept.
func (c *client) sleep(d time.Duration) bool {
	if d <= 0 {
		return c.l.ctx.Err() == nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-c.l.ctx.Done():
		return false
	}
}

func (c *client) violate(format string, args ...any) {
	c.nbad++
	if len(c.bad) < 10 {
		c.bad = append(c.bad, fmt.Sprintf("%s client at %.3fs: ", c.target.name, float64(c.l.now())/1e9)+fmt.Sprintf(format, args...))
	}
}

// request asks for n IDs, records the outcome and checks the reply; it
// reports whether IDs came back.
func (c *client) request(n int) bool {
	msg := nats.NewMsg(c.target.subject)
	msg.Header.Set(protocol.WorkerHeader, "1")
	if n > 1 {
		msg.Data = strconv.AppendInt(nil, int64(n), 10)
	}
	sent := c.l.now()
	resp, err := c.nc.RequestMsg(msg, c.l.spec.timeout)
	got := c.l.now()
	if err != nil {
		kind := "nats"
		switch {
		case errors.Is(err, nats.ErrTimeout):
			kind = "timeout"
		case errors.Is(err, nats.ErrNoResponders):
			kind = "no responders"
		}
		c.fails = append(c.fails, failure{sent: sent, got: got, kind: kind, err: err.Error()})
		return false
	}
	if code := resp.Header.Get(micro.ErrorCodeHeader); code != "" {
		desc := resp.Header.Get(micro.ErrorHeader)
		if code != protocol.CodeUnavailable && code != protocol.CodeInternal {
			c.violate("error %s %q for a valid request for %d IDs", code, desc, n)
		}
		c.fails = append(c.fails, failure{sent: sent, got: got, kind: code, err: desc, worker: resp.Header.Get(protocol.WorkerHeader)})
		return false
	}
	wid := resp.Header.Get(protocol.WorkerHeader)
	if wid == "" {
		c.violate("reply %q without %s header", truncate(resp.Data), protocol.WorkerHeader)
		return false
	}
	w, ok := c.local[wid]
	if !ok {
		w = c.l.workerIndex(wid)
		c.local[wid] = w
	}
	off := len(c.ids)
	ids, err := appendIDs(c.ids, resp.Data)
	if err != nil {
		c.violate("reply %q from %s: %v", truncate(resp.Data), wid, err)
		return false
	}
	c.ids = ids
	if len(ids)-off != n {
		c.violate("asked for %d IDs, got %d from %s", n, len(ids)-off, wid)
	}
	for _, id := range ids[off:] {
		key := lastKey{worker: w}
		if c.target.snowflake {
			key.bits = id >> sequenceBits & workerMask
		}
		if prev, ok := c.inc.Next(key, id); !ok {
			c.violate("worker %s issued %d after %d: not increasing", wid, id, prev)
		}
	}
	c.replies = append(c.replies, reply{sent: sent, got: got, worker: w, off: int32(off), n: int32(len(ids) - off)})
	c.lastSent.Store(sent)
	c.l.answered.Add(1)
	return true
}

func truncate(b []byte) string {
	if len(b) > 64 {
		return string(b[:64]) + "…"
	}
	return string(b)
}

// appendIDs parses a list reply: positive decimal IDs, one per line.
func appendIDs(dst []int64, body []byte) ([]int64, error) {
	if len(body) == 0 {
		return dst, errors.New("empty reply")
	}
	var v int64
	digits := 0
	for i := 0; i <= len(body); i++ {
		if i == len(body) || body[i] == '\n' {
			if digits == 0 {
				if i == len(body) && i > 0 {
					break // a final newline
				}
				return dst, errors.New("empty line")
			}
			if v <= 0 {
				return dst, fmt.Errorf("ID %d is not positive", v)
			}
			dst = append(dst, v)
			v, digits = 0, 0
			continue
		}
		d := body[i] - '0'
		if d > 9 {
			return dst, fmt.Errorf("byte %q in an ID", body[i])
		}
		if v > (math.MaxInt64-int64(d))/10 {
			return dst, errors.New("ID overflows int64")
		}
		v = v*10 + int64(d)
		digits++
	}
	return dst, nil
}

// totals sums up the load: requests, successful ones, IDs received.
func (l *load) totals() (requests, ok, ids int) {
	for _, c := range l.clients {
		requests += len(c.replies) + len(c.fails)
		ok += len(c.replies)
		ids += len(c.ids)
	}
	return
}

// failuresSince returns the failures of requests sent at or after since
// (nanoseconds since load start).
func (l *load) failuresSince(since int64) []failure {
	var out []failure
	for _, c := range l.clients {
		for _, f := range c.fails {
			if f.sent >= since {
				out = append(out, f)
			}
		}
	}
	return out
}

// answeredSince returns, per target name, the micro service IDs that
// answered requests sent at or after since.
func (l *load) answeredSince(since int64) map[string]map[string]bool {
	out := map[string]map[string]bool{}
	for _, c := range l.clients {
		for _, r := range c.replies {
			if r.sent >= since {
				if out[c.target.name] == nil {
					out[c.target.name] = map[string]bool{}
				}
				out[c.target.name][l.workerID(r.worker)] = true
			}
		}
	}
	return out
}

// check reports, after stop, every protocol or ordering violation, every
// request that failed with 500 (an unexpected error in a worker), every ID
// returned twice (per tag; for snowflake, globally), and every two worker
// processes that issued snowflake IDs with one worker ID at overlapping
// times. describe names a worker by micro service ID.
func (l *load) check(tb testing.TB, describe func(string) string) {
	tb.Helper()
	internal := 0
	var example string
	for _, c := range l.clients {
		for _, b := range c.bad {
			tb.Errorf("violation: %s", b)
		}
		if c.nbad > len(c.bad) {
			tb.Errorf("... and %d more violations of a %s client", c.nbad-len(c.bad), c.target.name)
		}
		for _, f := range c.fails {
			if f.kind == protocol.CodeInternal {
				if internal == 0 {
					example = fmt.Sprintf("%s at %.3fs: %s", c.target.name, float64(f.got)/1e9, f.err)
				}
				internal++
			}
		}
	}
	if internal > 0 {
		tb.Errorf("%d requests failed with 500 (an unexpected error in a worker; see the worker logs), e.g. %s", internal, example)
	}
	byTarget := map[string][]*client{}
	var names []string
	for _, c := range l.clients {
		if byTarget[c.target.name] == nil {
			names = append(names, c.target.name)
		}
		byTarget[c.target.name] = append(byTarget[c.target.name], c)
	}
	for _, name := range names {
		l.checkUnique(tb, name, byTarget[name], describe)
	}
	if cs := byTarget[snowflakeTarget.name]; len(cs) > 0 {
		l.checkSnowflakeWorkers(tb, cs, describe)
	}
	for _, name := range names {
		if cs := byTarget[name]; cs[0].target.ordered {
			l.checkOrdered(tb, name, cs, describe)
		}
	}
}

// observation is reply r of the i-th of clients c as check sees it: sent
// and got, nanoseconds on the test process's monotonic clock since the
// load started, as instants after t0; Worker the micro service ID that
// answered. sent is taken before the request is published and got after
// the reply arrived, so the real interval lies within them.
func (l *load) observation(i int, c *client, r reply) check.Observation {
	return check.Observation{Start: l.t0.Add(time.Duration(r.sent)), End: l.t0.Add(time.Duration(r.got)),
		IDs: c.ids[r.off : r.off+r.n], Client: fmt.Sprintf("client %d", i), Worker: l.workerID(r.worker)}
}

// seconds returns t in seconds since the load started.
func (l *load) seconds(t time.Time) float64 { return t.Sub(l.t0).Seconds() }

// examples words violations of linearizable increase, one a line; who
// names the client and the worker of an observation.
func (l *load) examples(vs []check.Violation, who func(check.Observation) string) string {
	var lines []string
	for _, v := range vs {
		b, a := v.Late, v.Early
		lines = append(lines, fmt.Sprintf("request sent at %.6fs (%s) got %d..%d, but %d had been answered at %.6fs (%s)",
			l.seconds(b.Start), who(b), b.Min(), b.Max(), a.Max(), l.seconds(a.End), who(a)))
	}
	return strings.Join(lines, "\n")
}

// checkOrdered fails the test if the replies of ordered tag name, over all
// its clients, did not increase linearizably.
func (l *load) checkOrdered(tb testing.TB, name string, cs []*client, describe func(string) string) {
	tb.Helper()
	var obs []check.Observation
	for i, c := range cs {
		for _, r := range c.replies {
			if r.n > 0 {
				obs = append(obs, l.observation(i, c, r))
			}
		}
	}
	if n, examples := check.Linearizable(obs); n > 0 {
		who := func(o check.Observation) string { return o.Client + ", " + describe(o.Worker) }
		tb.Errorf("%s: %d of %d requests broke linearizable increase:\n%s", name, n, len(obs), l.examples(examples, who))
	} else {
		tb.Logf("%s: %d answered requests from %d concurrent clients increase linearizably", name, len(obs), len(cs))
	}
}

// checkUnique fails the test for every ID that clients received twice.
func (l *load) checkUnique(tb testing.TB, name string, cs []*client, describe func(string) string) {
	tb.Helper()
	var obs []check.Observation
	for i, c := range cs {
		for _, r := range c.replies {
			obs = append(obs, l.observation(i, c, r))
		}
	}
	u := check.Unique(obs)
	if len(u.Duplicates) == 0 {
		return
	}
	tb.Errorf("%s: %d IDs returned more than once (of %d)", name, len(u.Duplicates), u.IDs)
	for _, d := range u.Duplicates[:min(len(u.Duplicates), 5)] {
		var who []string
		for _, o := range d.By {
			who = append(who, fmt.Sprintf("%s at %.3fs", describe(o.Worker), l.seconds(o.End)))
		}
		tb.Errorf("%s: ID %d returned by %s", name, d.ID, strings.Join(who, "; "))
	}
}

// checkSnowflakeWorkers fails the test if two processes issued snowflake
// IDs with the same worker bits at overlapping times: from the first to the
// last timestamp of each process's IDs with those bits, the intervals of
// two processes must not overlap, not even in one millisecond. That is what
// the leases promise: one live holder of a worker ID at a time, and a
// successor starts above everything its predecessor issued.
func (l *load) checkSnowflakeWorkers(tb testing.TB, cs []*client, describe func(string) string) {
	tb.Helper()
	type span struct {
		worker   int32
		bits     int64
		from, to int64 // milliseconds since the epoch, inclusive
	}
	spans := map[lastKey]*span{} // process and worker bits -> its span
	for _, c := range cs {
		for _, r := range c.replies {
			for _, id := range c.ids[r.off : r.off+r.n] {
				key := lastKey{worker: r.worker, bits: id >> sequenceBits & workerMask}
				ms := id >> (sequenceBits + 10)
				sp := spans[key]
				if sp == nil {
					spans[key] = &span{worker: r.worker, bits: key.bits, from: ms, to: ms}
					continue
				}
				sp.from, sp.to = min(sp.from, ms), max(sp.to, ms)
			}
		}
	}
	byBits := map[int64][]*span{}
	for _, sp := range spans {
		byBits[sp.bits] = append(byBits[sp.bits], sp)
	}
	conflicts := 0
	for _, bits := range slices.Sorted(maps.Keys(byBits)) {
		list := byBits[bits]
		slices.SortFunc(list, func(a, b *span) int {
			return cmp.Or(cmp.Compare(a.from, b.from), cmp.Compare(a.to, b.to), cmp.Compare(a.worker, b.worker))
		})
		// Compare each span with the one reaching furthest among those
		// that started before it.
		reach := list[0]
		for _, sp := range list[1:] {
			if sp.from <= reach.to {
				conflicts++
				if conflicts <= 5 {
					tb.Errorf("snowflake: worker ID %d used by %s in milliseconds %d..%d and by %s in %d..%d: overlapping",
						bits, describe(l.workerID(reach.worker)), reach.from, reach.to,
						describe(l.workerID(sp.worker)), sp.from, sp.to)
				}
			}
			if sp.to > reach.to {
				reach = sp
			}
		}
	}
	if conflicts > 5 {
		tb.Errorf("snowflake: %d more overlapping uses of worker IDs", conflicts-5)
	}
}

// faultLog records the faults injected while a load ran, to attribute
// failed requests to them, and the effect observed of each: a fault whose
// effect was not seen may not have happened at all.
type faultLog struct {
	l       *load
	grace   time.Duration // a fault's window lasts this long after it ended
	windows []window
}

type window struct {
	kind       string
	start, end int64  // since load start; end 0 while the fault lasts
	effect     string // what was observed of the fault; "" for nothing
}

// begin records the start of a fault of the given kind; end(i) its end.
func (fl *faultLog) begin(kind string) int {
	fl.windows = append(fl.windows, window{kind: kind, start: fl.l.now()})
	return len(fl.windows) - 1
}

func (fl *faultLog) end(i int) { fl.windows[i].end = fl.l.now() }

// observed records what was seen of fault i's effect.
func (fl *faultLog) observed(i int, format string, args ...any) {
	fl.windows[i].effect = fmt.Sprintf(format, args...)
}

// checkEffects fails the test for every fault whose effect was not
// observed, and logs the effects of the others.
func (fl *faultLog) checkEffects(tb testing.TB) {
	tb.Helper()
	var seen []string
	for _, w := range fl.windows {
		if w.effect == "" {
			tb.Errorf("fault %s at %.3fs: no effect observed (did it happen?)", w.kind, float64(w.start)/1e9)
			continue
		}
		seen = append(seen, fmt.Sprintf("%.3fs %s: %s", float64(w.start)/1e9, w.kind, w.effect))
	}
	if len(seen) > 0 {
		tb.Logf("effects of the faults:\n%s", strings.Join(seen, "\n"))
	}
}

// attribute returns the kind of the fault that a request answered or
// failed at got falls to: of the faults whose window (start to end plus
// grace) holds got, the one that started last; "none" if there is none.
func (fl *faultLog) attribute(got int64) string {
	kind := "none"
	for _, w := range fl.windows {
		end := w.end
		if end == 0 {
			end = math.MaxInt64 - int64(fl.grace)
		}
		if w.start <= got && got <= end+int64(fl.grace) {
			kind = w.kind
		}
	}
	return kind
}

// orderedFailureKinds are the failures a request for an ordered tag may
// have while its ownership moves: 503 (the owner is changing, or its
// buffers ran dry) or a timeout (sent to a process that was killed or
// frozen). The nats-server restart adds those of any request while clients
// and workers reconnect.
var orderedFailureKinds = map[string]bool{protocol.CodeUnavailable: true, "timeout": true}

// checkOrderedFailures fails the test for every request of an ordered tag
// that failed otherwise than orderedFailureKinds allow, or otherwise than
// any request may during a nats-server restart (the fault kind
// natsRestartFault).
func (fl *faultLog) checkOrderedFailures(tb testing.TB) {
	tb.Helper()
	bad := map[string]int{}
	var example string
	for _, c := range fl.l.clients {
		if !c.target.ordered {
			continue
		}
		for _, f := range c.fails {
			if orderedFailureKinds[f.kind] || fl.attribute(f.got) == natsRestartFault {
				continue
			}
			key := fmt.Sprintf("%s %s during %s", c.target.name, f.kind, fl.attribute(f.got))
			if bad[key] == 0 && example == "" {
				example = fmt.Sprintf("%s at %.3fs: %s", c.target.name, float64(f.got)/1e9, f.err)
			}
			bad[key]++
		}
	}
	if len(bad) > 0 {
		tb.Errorf("ordered tag: requests failed otherwise than with 503 or a timeout: %v, e.g. %s", bad, example)
	}
}

// natsRestartFault is the kind of the nats-server restart fault.
const natsRestartFault = "nats-restart"

// report returns a table of faults injected, faults whose effect was
// observed, and requests and failures by fault and failure kind; and the
// failures per fault kind.
func (fl *faultLog) report() (string, map[string]map[string]int) {
	return fl.reportOf(func(*client) bool { return true })
}

// reportOf is report for the requests of the clients that keep selects.
func (fl *faultLog) reportOf(keep func(*client) bool) (string, map[string]map[string]int) {
	var kinds []string // fault kinds in order of first injection, then none
	injected, effective := map[string]int{}, map[string]int{}
	for _, w := range fl.windows {
		if injected[w.kind] == 0 {
			kinds = append(kinds, w.kind)
		}
		injected[w.kind]++
		if w.effect != "" {
			effective[w.kind]++
		}
	}
	kinds = append(kinds, "none")
	requests := map[string]int{}
	fails := map[string]map[string]int{}
	failKinds := map[string]bool{}
	for _, c := range fl.l.clients {
		if !keep(c) {
			continue
		}
		for _, r := range c.replies {
			requests[fl.attribute(r.got)]++
		}
		for _, f := range c.fails {
			k := fl.attribute(f.got)
			requests[k]++
			if fails[k] == nil {
				fails[k] = map[string]int{}
			}
			fails[k][f.kind]++
			failKinds[f.kind] = true
		}
	}
	var cols []string
	for k := range failKinds {
		cols = append(cols, k)
	}
	sort.Strings(cols)
	var b strings.Builder
	w := tabwriter.NewWriter(&b, 0, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(w, "fault\tinjected\teffect seen\trequests\tfailed\t%s\t\n", strings.Join(cols, "\t"))
	for _, k := range kinds {
		total := 0
		var row []string
		for _, col := range cols {
			total += fails[k][col]
			row = append(row, strconv.Itoa(fails[k][col]))
		}
		fmt.Fprintf(w, "%s\t%d\t%d\t%d\t%d\t%s\t\n", k, injected[k], effective[k], requests[k], total, strings.Join(row, "\t"))
	}
	w.Flush()
	return b.String(), fails
}

// failedBy returns the number of error replies per worker (named by
// describe) and target, for messages.
func (l *load) failedBy(describe func(string) string) map[string]int {
	out := map[string]int{}
	for _, c := range l.clients {
		for _, f := range c.fails {
			if f.worker != "" {
				out[describe(f.worker)+" "+c.target.name+" "+f.kind]++
			}
		}
	}
	return out
}

// firstErrors returns one example message per failure kind.
func (l *load) firstErrors() map[string]string {
	out := map[string]string{}
	for _, c := range l.clients {
		for _, f := range c.fails {
			if _, ok := out[f.kind]; !ok {
				out[f.kind] = fmt.Sprintf("%s (%s, sent at %.3fs, failed at %.3fs)", f.err, c.target.name, float64(f.sent)/1e9, float64(f.got)/1e9)
			}
		}
	}
	return out
}
