package chaos

import (
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"

	"github.com/dispenser-dev/dispenser/internal/tests/wait"
	"github.com/dispenser-dev/dispenser/protocol"
	"github.com/dispenser-dev/dispenser/testenv"
)

// recordingTB records Errorf instead of failing the test.
type recordingTB struct {
	testing.TB
	mu   sync.Mutex
	errs []string
}

func (r *recordingTB) Errorf(format string, args ...any) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.errs = append(r.errs, fmt.Sprintf(format, args...))
}

func (r *recordingTB) Helper() {}

// fakeReply is what a fake worker answers: IDs, or an error code, with or
// without the Id-Worker header, or a raw body.
type fakeReply struct {
	ids      []int64
	code     string // error code instead of IDs
	body     string // raw body instead of IDs, when ids is nil and code ""
	noWorker bool   // leave out the Id-Worker header
}

// fakeWorker answers subject in queue group "fake" as worker id with what
// answer returns for a count, and counts its requests in calls.
func fakeWorker(tb testing.TB, nc *nats.Conn, subject, id string, calls *atomic.Int64, answer func(n int) fakeReply) {
	tb.Helper()
	_, err := nc.QueueSubscribe(subject, "fake", func(m *nats.Msg) {
		calls.Add(1)
		n := 1
		if len(m.Data) > 0 {
			n, _ = strconv.Atoi(string(m.Data))
		}
		a := answer(n)
		reply := nats.NewMsg(m.Reply)
		if !a.noWorker {
			reply.Header.Set(protocol.WorkerHeader, id)
		}
		switch {
		case a.code != "":
			reply.Header.Set(micro.ErrorCodeHeader, a.code)
			reply.Header.Set(micro.ErrorHeader, "fake error "+a.code)
		case a.ids != nil:
			var lines []string
			for _, v := range a.ids {
				lines = append(lines, strconv.FormatInt(v, 10))
			}
			reply.Data = []byte(strings.Join(lines, "\n"))
		default:
			reply.Data = []byte(a.body)
		}
		m.RespondMsg(reply)
	})
	if err != nil {
		tb.Fatal(err)
	}
}

// counter returns an answer counting from first by delta.
func counter(first, delta int64) func(int) fakeReply {
	var mu sync.Mutex
	next := first
	return func(n int) fakeReply {
		mu.Lock()
		defer mu.Unlock()
		out := make([]int64, n)
		for i := range out {
			out[i] = next
			next += delta
		}
		return fakeReply{ids: out}
	}
}

// sfID builds a snowflake ID.
func sfID(ms, worker, seq int64) int64 { return ms<<22 | worker<<12 | seq }

// everyOtherMs returns an answer of snowflake IDs with worker bits bits,
// each request in its own millisecond, starting at ms and going up by 2:
// two such workers started one millisecond apart never share a
// millisecond, but their times overlap.
func everyOtherMs(ms, bits int64) func(int) fakeReply {
	var mu sync.Mutex
	return func(n int) fakeReply {
		mu.Lock()
		defer mu.Unlock()
		out := make([]int64, n)
		for i := range out {
			out[i] = sfID(ms, bits, int64(i))
		}
		ms += 2
		return fakeReply{ids: out}
	}
}

// TestHarnessDetectsViolations checks that the load's checks can fail:
// fake workers that break every promise must be caught, each by the
// branch of the checker meant for it, and a well-behaved fake by none.
func TestHarnessDetectsViolations(t *testing.T) {
	t.Parallel()
	ns := testenv.StartNATSServer(t)
	nc := connect(t, ns.URL(), "fake-workers")
	calls := map[string]*atomic.Int64{}
	fake := func(tag, id string, answer func(int) fakeReply) {
		subject := "id.segment." + tag
		if tag == "snowflake" {
			subject = "id.snowflake"
		}
		if calls[tag] == nil {
			calls[tag] = &atomic.Int64{}
		}
		fakeWorker(t, nc, subject, id, calls[tag], answer)
	}
	fake("good", "w0", counter(1, 1))
	// Two workers handing out the same sequence: duplicates, each in order.
	fake("dup", "w1", counter(1, 1))
	fake("dup", "w2", counter(1, 1))
	// One worker counting down: more violations than are listed.
	fake("down", "w3", counter(1e9, -1))
	// Undocumented error code for a valid request.
	fake("code", "w4", func(int) fakeReply { return fakeReply{code: protocol.CodeBadRequest} })
	// An unexpected error in the worker.
	fake("internal", "w5", func(int) fakeReply { return fakeReply{code: protocol.CodeInternal} })
	// A malformed body.
	fake("bad", "w6", func(int) fakeReply { return fakeReply{body: "12x"} })
	// One ID more than asked for.
	count := counter(1, 1)
	fake("count", "w7", func(n int) fakeReply { return count(n + 1) })
	// IDs without the Id-Worker header.
	noWorker := counter(1, 1)
	fake("noworker", "w8", func(n int) fakeReply { r := noWorker(n); r.noWorker = true; return r })
	// Two snowflake workers with the same worker bits at overlapping times
	// but never in the same millisecond, and with unique IDs.
	const bits = 7
	fake("snowflake", "w9", everyOtherMs(1000, bits))
	fake("snowflake", "w10", everyOtherMs(1001, bits))
	// Ordered tags ("ord..."): one worker counting up is linearizable; two
	// interleaved counters, one far above the other, are not, although
	// neither repeats an ID nor goes down.
	fake("ordgood", "w11", counter(1, 1))
	fake("ordbad", "w12", counter(1, 1))
	fake("ordbad", "w13", counter(1e6, 1))
	nc.Flush()

	spec := loadSpec{clients: 2, rate: 200, maxCount: 3, timeout: 5 * time.Second}
	for _, tag := range sortedKeys(calls) {
		switch {
		case strings.HasPrefix(tag, "ord"):
			spec.targets = append(spec.targets, orderedTarget(tag, 4))
		case tag != "snowflake":
			spec.targets = append(spec.targets, segmentTarget(tag))
		}
	}
	spec.targets = append(spec.targets, snowflakeTarget)
	l := startLoad(t, connect(t, ns.URL(), "fake-load"), spec)
	// Enough requests of each kind: more than the ten violations a client
	// lists, and both snowflake fakes asked several times.
	err := wait.Until(60*time.Second, func() error {
		for tag, n := range calls {
			if n.Load() < 30 {
				return fmt.Errorf("%s: %d requests", tag, n.Load())
			}
		}
		return nil
	})
	l.stop()
	if err != nil {
		t.Fatal(err)
	}
	rec := &recordingTB{TB: t}
	l.check(rec, func(id string) string { return id })
	all := strings.Join(rec.errs, "\n")
	for _, tt := range []struct{ name, want string }{
		{"duplicates", "dup: "},
		{"duplicates", "more than once"},
		{"duplicates, who returned them", "returned by w"},
		{"order", "issued 999999"},
		{"order", "not increasing"},
		{"more violations than listed", "more violations of a down client"},
		{"undocumented error code", "error 400"},
		{"500", "failed with 500"},
		{"malformed body", `reply "12x"`},
		{"wrong count", "count client"},
		{"wrong count", "IDs, got"},
		{"missing Id-Worker", "without Id-Worker header"},
		{"overlapping worker ID", "snowflake: worker ID 7 used by"},
		{"ordered tag not linearizable", "ordbad: "},
		{"ordered tag not linearizable", "broke linearizable increase"},
	} {
		if !strings.Contains(all, tt.want) {
			t.Errorf("%s: check did not report %q; it reported:\n%s", tt.name, tt.want, all)
		}
	}
	for _, e := range rec.errs {
		if strings.HasPrefix(e, "snowflake: ") && strings.Contains(e, "more than once") {
			t.Errorf("unique snowflake IDs reported as duplicates: %s", e)
		}
		if strings.Contains(e, "good") {
			t.Errorf("the well-behaved fake was reported: %s", e)
		}
		if strings.Contains(e, "ordbad") && !strings.Contains(e, "linearizable") {
			t.Errorf("interleaved counters, unique and each increasing, reported for more than linearizability: %s", e)
		}
	}
}

// recorded is what one fake process returned in a synthetic load.
type recorded struct {
	worker string
	ids    []int64
}

// syntheticLoad returns a stopped load of one client of tg that received
// the given replies in order, for checking the checker without NATS.
func syntheticLoad(tg target, replies ...recorded) *load {
	l := &load{index: map[string]int32{}}
	c := l.newClient(tg, 1)
	for _, r := range replies {
		w := l.workerIndex(r.worker)
		c.replies = append(c.replies, reply{worker: w, off: int32(len(c.ids)), n: int32(len(r.ids))})
		c.ids = append(c.ids, r.ids...)
		c.l.answered.Add(1)
	}
	return l
}

// TestCheckSnowflakeWorkers checks the overlap check of snowflake worker
// IDs both ways: overlapping uses of one worker ID are caught, whether in
// one millisecond or across many, and uses one after the other, or of
// different worker IDs, are not.
func TestCheckSnowflakeWorkers(t *testing.T) {
	// ms returns IDs of worker ID bits, one per millisecond from..to, with
	// sequence seq: processes with other sequences issue unique IDs.
	ms := func(from, to, bits, seq int64) []int64 {
		var ids []int64
		for m := from; m <= to; m++ {
			ids = append(ids, sfID(m, bits, seq))
		}
		return ids
	}
	var seven []recorded // seven processes, each overlapping the one before
	for i := range int64(7) {
		seven = append(seven, recorded{fmt.Sprintf("p%d", i), ms(100+10*i, 115+10*i, 3, i)})
	}
	tests := []struct {
		name    string
		replies []recorded
		want    []string // substrings of the errors, in order; none for no error
	}{
		{"same millisecond, other sequence", []recorded{{"a", []int64{sfID(50, 7, 0)}}, {"b", []int64{sfID(50, 7, 1)}}},
			[]string{"snowflake: worker ID 7 used by a in milliseconds 50..50 and by b in 50..50"}},
		{"overlapping across milliseconds, never the same one", []recorded{
			{"a", []int64{sfID(100, 7, 0)}}, {"b", []int64{sfID(101, 7, 0)}}, {"a", []int64{sfID(102, 7, 0)}}, {"b", []int64{sfID(103, 7, 0)}}},
			[]string{"snowflake: worker ID 7 used by a in milliseconds 100..102 and by b in 101..103"}},
		{"inside another's interval", []recorded{{"a", ms(10, 20, 1, 0)}, {"b", ms(14, 15, 1, 1)}},
			[]string{"worker ID 1 used by a in milliseconds 10..20 and by b in 14..15"}},
		{"one after the other", []recorded{{"a", ms(10, 20, 1, 0)}, {"b", ms(21, 30, 1, 0)}, {"c", ms(31, 31, 1, 0)}}, nil},
		{"different worker IDs at the same time", []recorded{{"a", ms(10, 20, 1, 0)}, {"b", ms(10, 20, 2, 0)}}, nil},
		{"more overlaps than listed", seven, []string{"worker ID 3", "worker ID 3", "worker ID 3", "worker ID 3", "worker ID 3", "1 more overlapping"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			l := syntheticLoad(snowflakeTarget, tt.replies...)
			rec := &recordingTB{TB: t}
			l.check(rec, func(id string) string { return id })
			if len(rec.errs) != len(tt.want) {
				t.Fatalf("got %d errors, want %d:\n%s", len(rec.errs), len(tt.want), strings.Join(rec.errs, "\n"))
			}
			for i, want := range tt.want {
				if !strings.Contains(rec.errs[i], want) {
					t.Errorf("error %d = %q, want it to contain %q", i, rec.errs[i], want)
				}
			}
		})
	}
}

// TestCheckUnique checks the duplicate check both ways.
func TestCheckUnique(t *testing.T) {
	tests := []struct {
		name    string
		replies []recorded
		want    []string
	}{
		{"unique", []recorded{{"a", []int64{1, 2, 3}}, {"b", []int64{4, 5}}}, nil},
		{"one duplicate", []recorded{{"a", []int64{1, 2, 3}}, {"b", []int64{3, 4}}},
			[]string{"t: 1 IDs returned more than once (of 5)", "t: ID 3 returned by a at 0.000s; b at 0.000s"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			l := syntheticLoad(segmentTarget("t"), tt.replies...)
			rec := &recordingTB{TB: t}
			l.check(rec, func(id string) string { return id })
			if len(rec.errs) != len(tt.want) {
				t.Fatalf("got %d errors, want %d:\n%s", len(rec.errs), len(tt.want), strings.Join(rec.errs, "\n"))
			}
			for i, want := range tt.want {
				if !strings.Contains(rec.errs[i], want) {
					t.Errorf("error %d = %q, want it to contain %q", i, rec.errs[i], want)
				}
			}
		})
	}
}

// TestFaultEffects checks that a fault without an observed effect fails
// the test, and that the report counts effects, not injections.
func TestFaultEffects(t *testing.T) {
	fl := &faultLog{l: &load{t0: time.Now()}, grace: time.Second}
	a := fl.begin("worked")
	fl.end(a)
	fl.observed(a, "it did")
	b := fl.begin("no-op")
	fl.end(b)
	rec := &recordingTB{TB: t}
	fl.checkEffects(rec)
	if len(rec.errs) != 1 || !strings.Contains(rec.errs[0], "fault no-op") || !strings.Contains(rec.errs[0], "no effect observed") {
		t.Errorf("checkEffects reported %q, want one error for the no-op fault", rec.errs)
	}
	table, _ := fl.report()
	for _, want := range []string{"effect seen", "worked         1            1", "no-op         1            0"} {
		if !strings.Contains(strings.Join(strings.Fields(table), " "), strings.Join(strings.Fields(want), " ")) {
			t.Errorf("report lacks %q:\n%s", want, table)
		}
	}
}

// TestFaultAttribution checks how failures are charged to faults.
func TestFaultAttribution(t *testing.T) {
	l := &load{}
	fl := &faultLog{l: l, grace: time.Second, windows: []window{
		{kind: "a", start: 10e9, end: 12e9},
		{kind: "b", start: 12.5e9, end: 14e9},
	}}
	for _, c := range []struct {
		got  float64
		want string
	}{
		{9.9e9, "none"},
		{10e9, "a"},
		{12.4e9, "a"}, // a's grace
		{12.6e9, "b"}, // a's grace, but b started since
		{14.9e9, "b"}, // b's grace
		{15.1e9, "none"},
	} {
		if got := fl.attribute(int64(c.got)); got != c.want {
			t.Errorf("attribute(%.1fs) = %q, want %q", c.got/1e9, got, c.want)
		}
	}
}

// TestCheckOrderedFailures checks that a request for an ordered tag may
// fail only with 503 or a timeout, or as any request may while the
// nats-server restarts, and that plain tags are not held to it.
func TestCheckOrderedFailures(t *testing.T) {
	l := &load{index: map[string]int32{}}
	ord := l.newClient(orderedTarget("o", 1), 1)
	plain := l.newClient(segmentTarget("p"), 2)
	fl := &faultLog{l: l, grace: time.Second, windows: []window{
		{kind: "sigkill-owner", start: 10e9, end: 12e9},
		{kind: natsRestartFault, start: 20e9, end: 22e9},
	}}
	ord.fails = []failure{
		{got: 11e9, kind: "503"}, {got: 11e9, kind: "timeout"}, // allowed
		{got: 21e9, kind: "no responders"}, {got: 21e9, kind: "nats"}, // allowed during the restart
		{got: 11.5e9, kind: "no responders", err: "nats: no responders available for request"},
	}
	plain.fails = []failure{{got: 11e9, kind: "no responders"}}
	rec := &recordingTB{TB: t}
	fl.checkOrderedFailures(rec)
	if len(rec.errs) != 1 || !strings.Contains(rec.errs[0], "o no responders during sigkill-owner:1") {
		t.Errorf("checkOrderedFailures reported %q, want one error for the no-responders failure during sigkill-owner", rec.errs)
	}
	ord.fails = ord.fails[:4]
	rec = &recordingTB{TB: t}
	fl.checkOrderedFailures(rec)
	if len(rec.errs) != 0 {
		t.Errorf("allowed failures reported: %q", rec.errs)
	}
}
