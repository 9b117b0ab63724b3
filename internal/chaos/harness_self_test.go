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

	"github.com/dispenser-dev/dispenser/dispenser"
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

// fakeWorker answers subject in queue group "fake" as worker id with the
// IDs that ids returns for a count, or with an error code when ids returns
// nil.
func fakeWorker(tb testing.TB, nc *nats.Conn, subject, id string, ids func(n int) []int64) {
	tb.Helper()
	_, err := nc.QueueSubscribe(subject, "fake", func(m *nats.Msg) {
		n := 1
		if len(m.Data) > 0 {
			n, _ = strconv.Atoi(string(m.Data))
		}
		reply := nats.NewMsg(m.Reply)
		got := ids(n)
		if got == nil {
			reply.Header.Set(micro.ErrorCodeHeader, dispenser.CodeBadRequest)
			reply.Header.Set(micro.ErrorHeader, "fake bad request")
		} else {
			reply.Header.Set(dispenser.WorkerHeader, id)
			var lines []string
			for _, v := range got {
				lines = append(lines, strconv.FormatInt(v, 10))
			}
			reply.Data = []byte(strings.Join(lines, "\n"))
		}
		m.RespondMsg(reply)
	})
	if err != nil {
		tb.Fatal(err)
	}
}

// counter returns an ids function counting from first by delta.
func counter(first, delta int64) func(int) []int64 {
	var mu sync.Mutex
	next := first
	return func(n int) []int64 {
		mu.Lock()
		defer mu.Unlock()
		out := make([]int64, n)
		for i := range out {
			out[i] = next
			next += delta
		}
		return out
	}
}

// TestHarnessDetectsViolations checks that the load's checks can fail:
// fake workers that break every promise must be caught.
func TestHarnessDetectsViolations(t *testing.T) {
	t.Parallel()
	ns := startNATS(t)
	nc := connect(t, ns.URL(), "fake-workers")
	// Two workers handing out the same sequence: duplicates, each in order.
	fakeWorker(t, nc, "id.segment.dup", "w1", counter(1, 1))
	fakeWorker(t, nc, "id.segment.dup", "w2", counter(1, 1))
	// One worker counting down.
	fakeWorker(t, nc, "id.segment.down", "w3", counter(1e9, -1))
	// Undocumented error code for a valid request.
	fakeWorker(t, nc, "id.segment.code", "w4", func(int) []int64 { return nil })
	// Two snowflake workers with the same worker bits in the same
	// millisecond, but different sequences: unique IDs, shared worker ID.
	const ms, bits = 12345, 7
	base := int64(ms)<<22 | bits<<12
	fakeWorker(t, nc, "id.snowflake", "w5", counter(base, 1))
	fakeWorker(t, nc, "id.snowflake", "w6", counter(base+2048, 1))
	// A malformed body.
	var calls atomic.Int64
	_, err := nc.Subscribe("id.segment.bad", func(m *nats.Msg) {
		calls.Add(1)
		reply := nats.NewMsg(m.Reply)
		reply.Header.Set(dispenser.WorkerHeader, "w7")
		reply.Data = []byte("12x")
		m.RespondMsg(reply)
	})
	if err != nil {
		t.Fatal(err)
	}
	nc.Flush()

	spec := loadSpec{clients: 2, rate: 200, maxCount: 3, timeout: time.Second}
	for _, tag := range []string{"dup", "down", "code", "bad"} {
		spec.targets = append(spec.targets, segmentTarget(tag))
	}
	spec.targets = append(spec.targets, snowflakeTarget)
	l := startLoad(t, connect(t, ns.URL(), "fake-load"), spec)
	time.Sleep(500 * time.Millisecond)
	l.stop()
	rec := &recordingTB{TB: t}
	l.check(rec, func(id string) string { return id })
	all := strings.Join(rec.errs, "\n")
	for _, want := range []string{
		"dup: ", "more than once",
		"issued 999999", "not increasing",
		"error 400",
		`reply "12x"`,
		"snowflake: worker ID 7 used in millisecond 12345",
	} {
		if !strings.Contains(all, want) {
			t.Errorf("check did not report %q; it reported:\n%s", want, all)
		}
	}
	for _, e := range rec.errs {
		if strings.HasPrefix(e, "snowflake: ") && strings.Contains(e, "more than once") {
			t.Errorf("unique snowflake IDs reported as duplicates: %s", e)
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
