package chaos

import (
	"slices"
	"strings"
	"testing"
	"time"
)

// sec is s seconds on the load's clock (nanoseconds since its start).
func sec(s float64) int64 { return int64(s * 1e9) }

// nodeClient adds a client of tg on node to l, for synthetic records.
func nodeClient(l *load, tg target, node int) *client {
	c := l.newClient(tg, uint64(node))
	c.node = node
	return c
}

// TestCheckSides feeds checkSides the records of a misbehaving service: a
// majority client whose requests fail while a minority node is isolated
// must be reported, and only those failures: not those sent before the
// fault took effect, after the heal, in an excused interval, of clients on
// the minority, or of an ordered tag whose owner was cut off. Against a
// checkSides that ignored the side (checked every client) or the
// detection time, the "excused" case fails; against one that checked
// nothing, the "majority failure" cases fail.
func TestCheckSides(t *testing.T) {
	fl := &faultLog{l: &load{}, grace: time.Second, windows: []window{{kind: "isolate", start: sec(10), end: sec(30)}}}
	base := faultSides{cut: []int{0}, cutName: "minority", restName: "majority", assertRest: true,
		excusedBefore: sec(13), excused: [][2]int64{{sec(20), sec(21)}}, orderedExcused: true, healed: sec(25)}
	tests := []struct {
		name  string
		node  int
		tg    target
		fails []failure
		sides func(s *faultSides)
		want  []string
	}{
		{name: "majority failure", node: 1, tg: segmentTarget("p"), fails: []failure{{sent: sec(14), got: sec(16), kind: "timeout", err: "nats: timeout"}},
			want: []string{"1 p requests on the majority side failed with timeout"}},
		{name: "majority 503s counted", node: 2, tg: snowflakeTarget, fails: []failure{{sent: sec(14), kind: "503", worker: "w1"}, {sent: sec(15), kind: "503"}},
			want: []string{"2 snowflake requests on the majority side failed with 503", "from w1"}},
		{name: "excused", node: 1, tg: segmentTarget("p"), fails: []failure{
			{sent: sec(12), kind: "timeout"},   // in flight before detection
			{sent: sec(20.5), kind: "timeout"}, // excused interval
			{sent: sec(25.1), kind: "503"}}},   // after the heal
		{name: "minority", node: 0, tg: segmentTarget("p"), fails: []failure{{sent: sec(14), kind: "503"}}},
		{name: "ordered, owner cut off", node: 1, tg: orderedTarget("o", 1), fails: []failure{{sent: sec(14), kind: "503"}}},
		{name: "ordered, owner on the majority", node: 1, tg: orderedTarget("o", 1), fails: []failure{{sent: sec(14), kind: "503"}},
			sides: func(s *faultSides) { s.orderedExcused = false }, want: []string{"1 o requests"}},
		{name: "snowflake excused", node: 1, tg: snowflakeTarget, fails: []failure{{sent: sec(14), kind: "503"}},
			sides: func(s *faultSides) { s.snowflakeExcused = true }},
		{name: "not asserted", node: 1, tg: segmentTarget("p"), fails: []failure{{sent: sec(14), kind: "503"}},
			sides: func(s *faultSides) { s.assertRest = false }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			l := &load{index: map[string]int32{}}
			c := nodeClient(l, tt.tg, tt.node)
			c.fails = tt.fails
			s := base
			if tt.sides != nil {
				tt.sides(&s)
			}
			got := checkSides(l, fl, []faultSides{s}, func(id string) string { return id })
			if len(got) != min(len(tt.want), 1) {
				t.Fatalf("checkSides = %q, want %d findings containing %q", got, min(len(tt.want), 1), tt.want)
			}
			for _, w := range tt.want {
				if !strings.Contains(got[0], w) {
					t.Errorf("finding %q lacks %q", got[0], w)
				}
			}
		})
	}
}

// TestCheckHealed feeds checkHealed clients that answer again after a
// heal quickly, late, or never: late and never are reported, per node and
// subject, quickly is not. Against a checkHealed that looked at any reply
// (not one sent after the heal) the "answered before the heal only" case
// fails.
func TestCheckHealed(t *testing.T) {
	const bound = 5 * time.Second
	heal := []healMark{{fault: "isolate", at: sec(10)}}
	answer := func(c *client, sent, got float64) {
		c.replies = append(c.replies, reply{sent: sec(sent), got: sec(got)})
	}
	tests := []struct {
		name    string
		replies map[int][][2]float64 // node -> (sent, got) of its snowflake client
		want    []string
	}{
		{name: "quickly", replies: map[int][][2]float64{0: {{9, 9.1}, {10.1, 10.2}}, 1: {{10.5, 11}}}},
		{name: "late", replies: map[int][][2]float64{0: {{10.1, 10.2}}, 1: {{10.5, 16}}},
			want: []string{"snowflake on n1 answered again only after 6s, bound 5s"}},
		{name: "answered before the heal only", replies: map[int][][2]float64{0: {{10.1, 10.2}}, 1: {{9, 9.5}}},
			want: []string{"never answered again: snowflake on n1"}},
		{name: "sent before, answered after", replies: map[int][][2]float64{0: {{10.1, 10.2}}, 1: {{9.9, 10.3}}},
			want: []string{"never answered again: snowflake on n1"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			l := &load{index: map[string]int32{}}
			var cs []*client
			for node := range 2 {
				c := nodeClient(l, snowflakeTarget, node)
				for _, r := range tt.replies[node] {
					answer(c, r[0], r[1])
				}
				cs = append(cs, c)
			}
			got := checkHealed(cs, heal, bound)
			if len(got) != len(tt.want) {
				t.Fatalf("checkHealed = %q, want %q", got, tt.want)
			}
			for i, w := range tt.want {
				if !strings.Contains(got[i], w) {
					t.Errorf("finding %q lacks %q", got[i], w)
				}
			}
		})
	}
}

// TestCheckFailureKinds: a failure other than 503, 500 or a timeout is
// reported, except "no responders" for a client on the cut side of a
// fault while it lasts.
func TestCheckFailureKinds(t *testing.T) {
	fl := &faultLog{l: &load{}, grace: time.Second, windows: []window{{kind: "oneway", start: sec(10), end: sec(20)}}}
	sides := []faultSides{{cut: []int{0}, cutName: "minority", restName: "majority", healed: sec(19)}}
	l := &load{index: map[string]int32{}}
	cut, rest := nodeClient(l, segmentTarget("p"), 0), nodeClient(l, segmentTarget("p"), 1)
	cut.fails = []failure{{got: sec(12), kind: "no responders"}, {got: sec(13), kind: "503"}, {got: sec(14), kind: "timeout"}}
	if got := checkFailureKinds(l, fl, sides); len(got) != 0 {
		t.Fatalf("allowed failures reported: %q", got)
	}
	cut.fails = append(cut.fails, failure{got: sec(25), kind: "no responders"}) // after the heal and its grace
	rest.fails = []failure{{got: sec(12), kind: "no responders"}, {got: sec(12), kind: "nats", err: "nats: connection closed"}}
	got := checkFailureKinds(l, fl, sides)
	want := []string{`1 requests failed with "nats"`, `2 requests failed with "no responders"`}
	if len(got) != len(want) {
		t.Fatalf("checkFailureKinds = %q, want %q", got, want)
	}
	for i, w := range want {
		if !strings.Contains(got[i], w) {
			t.Errorf("finding %q lacks %q", got[i], w)
		}
	}
}

// TestAvailabilityTable: the table counts a window's requests per side and
// subject and its longest gap without an answer, from the fault's start to
// its heal plus the grace.
func TestAvailabilityTable(t *testing.T) {
	fl := &faultLog{l: &load{}, grace: time.Second, windows: []window{{kind: "isolate", start: sec(10), end: sec(30)}}}
	sides := []faultSides{{cut: []int{0}, cutName: "minority", restName: "majority", healed: sec(20)}}
	l := &load{index: map[string]int32{}}
	minority, majority := nodeClient(l, snowflakeTarget, 0), nodeClient(l, snowflakeTarget, 1)
	minority.replies = []reply{{got: sec(11)}, {got: sec(19)}} // gap 8 s
	minority.fails = []failure{{got: sec(15), kind: "503"}}
	majority.replies = []reply{{got: sec(10.5)}, {got: sec(12)}, {got: sec(14)}, {got: sec(16)}, {got: sec(18)}, {got: sec(20)}} // gap 2 s
	table := availabilityTable(l, fl, sides)
	for _, want := range []string{"isolate minority snowflake 3 1 1 0 8s", "isolate majority snowflake 6 0 0 0 2s"} {
		if !strings.Contains(strings.Join(strings.Fields(table), " "), want) {
			t.Errorf("table lacks %q:\n%s", want, table)
		}
	}
}

// TestCheckNo503 feeds checkNo503 the records of a service whose workers
// stay in the queue group while they cannot serve: a 503 on the majority
// side, after a heal on any node, or in calm must be reported; one on the
// cut side while the fault lasts, during a bridge, of snowflake with
// leases too short to ride out an election, of an ordered tag, or a
// timeout must not. Against a checkNo503 that excused every 503 after
// the fault began (not only on the cut side and until the heal), the
// "majority" and "after the heal" cases fail; against one that reported
// every 503, the excused cases fail.
func TestCheckNo503(t *testing.T) {
	fl := &faultLog{l: &load{}, grace: time.Second, windows: []window{
		{kind: "isolate", start: sec(10), end: sec(30)}, {kind: "bridge", start: sec(40), end: sec(50)}}}
	sides := []faultSides{
		{cut: []int{0}, cutName: "minority", restName: "majority", healed: sec(25), routed: sec(26.5), excused: [][2]int64{{sec(20), sec(21)}}},
		{cut: []int{1, 2}, cutName: "A-B", restName: "rest", healed: sec(48), routed: sec(49)},
	}
	tests := []struct {
		name        string
		node        int
		tg          target
		fails       []failure
		sides       func(s []faultSides)
		shortLeases bool
		want        string // a finding containing it; "" for none
	}{
		{name: "short leases, any fault", node: 1, tg: snowflakeTarget, fails: []failure{{sent: sec(14), kind: "no responders"}}, shortLeases: true},
		{name: "short leases excuse no plain tag", node: 1, tg: segmentTarget("p"), fails: []failure{{sent: sec(14), kind: "503"}}, shortLeases: true,
			want: "1 p requests of clients on n1"},
		{name: "majority", node: 1, tg: snowflakeTarget, fails: []failure{{sent: sec(14), kind: "503", worker: "w0"}},
			want: "1 snowflake requests of clients on n1 answered 503"},
		{name: "after the heal, on the healed node", node: 0, tg: segmentTarget("p"), fails: []failure{{sent: sec(27), kind: "503"}},
			want: "1 p requests of clients on n0"},
		{name: "on the healed node before its routes are back", node: 0, tg: segmentTarget("p"), fails: []failure{{sent: sec(26), kind: "503"}}},
		{name: "in calm", node: 2, tg: segmentTarget("p"), fails: []failure{{sent: sec(2), kind: "503"}, {sent: sec(3), kind: "503"}},
			want: "2 p requests of clients on n2"},
		{name: "cut side while it lasts", node: 0, tg: segmentTarget("p"), fails: []failure{{sent: sec(14), kind: "503"}}},
		{name: "bridge", node: 0, tg: snowflakeTarget, fails: []failure{{sent: sec(45), kind: "503"}}},
		{name: "excused interval", node: 1, tg: segmentTarget("p"), fails: []failure{{sent: sec(20.5), kind: "503"}}},
		{name: "short leases", node: 1, tg: snowflakeTarget, fails: []failure{{sent: sec(14), kind: "503"}},
			sides: func(s []faultSides) { s[0].snowflakeExcused = true }},
		{name: "short leases, until the heal bound", node: 1, tg: snowflakeTarget, fails: []failure{{sent: sec(27), kind: "no responders"}},
			sides: func(s []faultSides) { s[0].snowflakeExcused = true }},
		{name: "short leases excuse nothing after the heal bound", node: 1, tg: snowflakeTarget, fails: []failure{{sent: sec(30), kind: "503"}},
			sides: func(s []faultSides) { s[0].snowflakeExcused = true }, want: "1 snowflake requests"},
		{name: "no responders on the healed node until its routes are back", node: 0, tg: snowflakeTarget, fails: []failure{{sent: sec(26), kind: "no responders"}}},
		{name: "no responders on the healed node after its routes are back", node: 0, tg: snowflakeTarget, fails: []failure{{sent: sec(27), kind: "no responders"}},
			want: "1 snowflake requests of clients on n0"},
		{name: "no responders on a bridged node after the heal", node: 1, tg: snowflakeTarget, fails: []failure{{sent: sec(48.5), kind: "no responders"}},
			want: "1 snowflake requests of clients on n1"},
		{name: "503 on the healed node before its routes are back", node: 0, tg: snowflakeTarget, fails: []failure{{sent: sec(26), kind: "503"}}},
		{name: "no responders on the majority", node: 2, tg: snowflakeTarget, fails: []failure{{sent: sec(14), kind: "no responders"}},
			want: "1 snowflake requests of clients on n2"},
		{name: "ordered", node: 1, tg: orderedTarget("o", 1), fails: []failure{{sent: sec(14), kind: "503"}}},
		{name: "timeout", node: 1, tg: segmentTarget("p"), fails: []failure{{sent: sec(14), kind: "timeout"}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			l := &load{index: map[string]int32{}}
			c := nodeClient(l, tt.tg, tt.node)
			c.fails = tt.fails
			s := slices.Clone(sides)
			if tt.sides != nil {
				tt.sides(s)
			}
			got := checkNo503(l, fl, s, 4*time.Second, tt.shortLeases, func(id string) string { return id })
			switch {
			case tt.want == "" && len(got) > 0:
				t.Fatalf("checkNo503 = %q, want no finding", got)
			case tt.want != "" && (len(got) != 1 || !strings.Contains(got[0], tt.want)):
				t.Fatalf("checkNo503 = %q, want one finding containing %q", got, tt.want)
			}
		})
	}
}

// TestFailureClass: the per-node table's classes. A majority timeout long
// after a cut, or a 503 in calm, is unclassified (a bug to look at), not
// hidden in another class.
func TestFailureClass(t *testing.T) {
	fl := &faultLog{l: &load{}, grace: time.Second, windows: []window{
		{kind: "isolate", start: sec(10), end: sec(30)}, {kind: "flap", start: sec(40), end: sec(50)}}}
	sides := []faultSides{
		{cut: []int{0}, healed: sec(25), routed: sec(26), cuts: []int64{sec(10)}, excused: [][2]int64{{sec(20), sec(21)}}},
		{cut: []int{1}, healed: sec(48), routed: sec(49), cuts: []int64{sec(40), sec(44)}},
	}
	tests := []struct {
		name string
		node int
		tg   target
		f    failure
		want string
	}{
		{name: "ordered", node: 2, tg: orderedTarget("o", 1), f: failure{sent: sec(2), kind: "503"}, want: "ordered"},
		{name: "cut side until the routes are back", node: 0, tg: snowflakeTarget, f: failure{sent: sec(25.5), kind: "no responders"}, want: "cut side"},
		{name: "after the routes are back", node: 0, tg: snowflakeTarget, f: failure{sent: sec(26.5), kind: "no responders"}, want: "unclassified"},
		{name: "majority timeout at the cut", node: 2, tg: segmentTarget("p"), f: failure{sent: sec(11), kind: "timeout"}, want: "in flight"},
		{name: "majority timeout sent before the cut", node: 2, tg: segmentTarget("p"), f: failure{sent: sec(9), kind: "timeout"}, want: "in flight"},
		{name: "majority timeout long after the cut", node: 2, tg: segmentTarget("p"), f: failure{sent: sec(16), kind: "timeout"}, want: "unclassified"},
		{name: "majority 503 at the cut", node: 2, tg: segmentTarget("p"), f: failure{sent: sec(11), kind: "503"}, want: "unclassified"},
		{name: "a flap's later cut", node: 2, tg: snowflakeTarget, f: failure{sent: sec(45), kind: "timeout"}, want: "in flight"},
		{name: "worker killed", node: 2, tg: segmentTarget("p"), f: failure{sent: sec(20.5), kind: "timeout"}, want: "worker killed"},
		{name: "calm", node: 2, tg: segmentTarget("p"), f: failure{sent: sec(60), kind: "503"}, want: "unclassified"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := nodeClient(&load{index: map[string]int32{}}, tt.tg, tt.node)
			if got := failureClass(c, tt.f, fl, sides); got != tt.want {
				t.Errorf("failureClass = %q, want %q", got, tt.want)
			}
		})
	}
}
