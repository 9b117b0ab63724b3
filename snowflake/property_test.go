package snowflake

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// Environment variables of TestLeaseProperty.
const (
	// envPropertySeed replays a run: the first schedule uses this seed.
	envPropertySeed = "DISPENSER_PROPERTY_SEED"
	// envPropertyLong=1 runs many more and longer schedules.
	envPropertyLong = "DISPENSER_PROPERTY_LONG"
)

// TestLeaseProperty runs random schedules of claims, heartbeats,
// partitions, crashes, restarts, graceful closes, clock advances and steps,
// and deletions and purges of worker keys, against an embedded JetStream,
// with a few processes competing for a few free worker IDs, some of them
// restarted with a longer lease. After every
// batch of IDs it checks that no two Workers issued from one worker ID with
// overlapping timestamps, and that each Node's IDs strictly increase.
//
// Heartbeats and claims run only when the schedule says so (no background
// loop), clocks are fake and candidate IDs are shuffled by a seeded source,
// so a seed replays its schedule: the test logs the seed, and
// DISPENSER_PROPERTY_SEED=N runs schedule N first. DISPENSER_PROPERTY_LONG=1
// runs 40 schedules of 400 steps with 4 processes instead of 3 of 150 with
// 3 (1 in -short mode).
func TestLeaseProperty(t *testing.T) {
	schedules, steps, procs := 3, 150, 3
	if os.Getenv(envPropertyLong) == "1" {
		schedules, steps, procs = 40, 400, 4
	} else if testing.Short() {
		schedules = 1
	}
	seed := uint64(time.Now().UnixNano())
	if s := os.Getenv(envPropertySeed); s != "" {
		var err error
		if seed, err = strconv.ParseUint(s, 10, 64); err != nil {
			t.Fatalf("%s=%q: %v", envPropertySeed, s, err)
		}
	}
	t.Logf("seed %d (replay with %s=%d)", seed, envPropertySeed, seed)
	js := newJetStream(t)
	var issued uint64
	for i := range uint64(schedules) {
		s := seed + i
		if !t.Run(fmt.Sprintf("seed=%d", s), func(t *testing.T) { issued += runLeaseSchedule(t, js, s, steps, procs) }) {
			t.Logf("replay: %s=%d go test -run 'TestLeaseProperty/seed=%d$' ./snowflake", envPropertySeed, s, s)
			return
		}
	}
	// A schedule may issue nothing (say, every free key deleted early);
	// all of them doing so means the harness is broken.
	if issued == 0 {
		t.Errorf("no schedule issued an ID")
	}
}

const (
	propLease = time.Second
	// propLongLease is the lease of a process restarted with a longer
	// --snowflake-lease (a rolling change of the flag): longer than half
	// DeletedKeyMargin, so that a deleted key's margin must cover it.
	propLongLease = 90 * time.Second
	// propMaxAhead is how far a process clock may run ahead of the real
	// time (the NATS server's) while keys may still be deleted: a deleted
	// key's floor comes from its marker's server time and covers holders
	// whose clocks run ahead of it by less than DeletedKeyMargin minus a
	// lease.
	propMaxAhead = 20 * time.Second
)

// proc is one process slot of a schedule: a clock and the Node running
// on it, if any.
type proc struct {
	name        string
	clock       *fakeClock
	w           *Node
	obj         int  // index of w in the schedule's Workers
	partitioned bool // heartbeats and claims fail to reach NATS
	shuffle     *rand.Rand
	lease       time.Duration // of the current Node
}

// leaseModel checks what every batch of IDs issued implies.
type leaseModel struct {
	last  map[int]int64     // Node index: its last ID
	spans map[int64][]span  // worker ID: timestamp spans issued, in order
	ops   []string          // the schedule so far, for failure messages
	count map[string]uint64 // outcomes, for the log
}

type span struct {
	obj    int
	lo, hi int64
}

// record checks a batch of IDs that Node obj issued.
func (m *leaseModel) record(obj int, ids []int64) error {
	if len(ids) == 0 {
		return nil
	}
	if last, ok := m.last[obj]; ok && ids[0] <= last {
		return fmt.Errorf("worker #%d issued %d after %d: its IDs went down", obj, ids[0], last)
	}
	for i := 1; i < len(ids); i++ {
		if ids[i] <= ids[i-1] {
			return fmt.Errorf("worker #%d: batch not increasing at %d", obj, i)
		}
	}
	m.last[obj] = ids[len(ids)-1]
	first, end := Decode(ids[0], time.Time{}), Decode(ids[len(ids)-1], time.Time{})
	if first.Worker != end.Worker {
		return fmt.Errorf("worker #%d: one batch under worker IDs %d and %d", obj, first.Worker, end.Worker)
	}
	wid, lo, hi := first.Worker, first.Timestamp, end.Timestamp
	ss := m.spans[wid]
	for _, s := range ss {
		if s.obj != obj && lo <= s.hi && s.lo <= hi {
			return fmt.Errorf("worker ID %d: worker #%d issued timestamps %d..%d, worker #%d issued %d..%d: two holders overlap",
				wid, obj, lo, hi, s.obj, s.lo, s.hi)
		}
	}
	if n := len(ss); n > 0 && ss[n-1].obj == obj {
		ss[n-1].lo, ss[n-1].hi = min(ss[n-1].lo, lo), max(ss[n-1].hi, hi)
	} else {
		m.spans[wid] = append(ss, span{obj: obj, lo: lo, hi: hi})
	}
	return nil
}

// runLeaseSchedule runs one schedule and returns how many IDs it issued.
func runLeaseSchedule(t *testing.T, js jetstream.JetStream, seed uint64, steps, nprocs int) (issued uint64) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	r := rand.New(rand.NewPCG(seed, 0x5eed))
	bucket := fmt.Sprintf("prop_%d", seed%1_000_000_007)
	start := time.Now().UTC().Truncate(time.Millisecond)
	kv := newBucket(t, js, bucket)
	// A few free worker IDs: mostly fewer than processes, so that they
	// compete; sometimes a spare one, never used, to fall back on.
	nfree := nprocs - 1 + r.IntN(4)
	free := []int{r.IntN(MaxWorkerID + 1)}
	for len(free) < nfree {
		if id := r.IntN(MaxWorkerID + 1); !contains(free, id) {
			free = append(free, id)
		}
	}
	fillUntil(t, kv, start, start.Add(1000*time.Hour), free...)

	m := &leaseModel{last: map[int]int64{}, spans: map[int64][]span{}, count: map[string]uint64{}}
	fail := func(format string, args ...any) {
		t.Helper()
		tail := m.ops[max(0, len(m.ops)-400):]
		t.Fatalf("seed %d, step %d: %s\nlast steps:\n  %s", seed, len(m.ops), fmt.Sprintf(format, args...), strings.Join(tail, "\n  "))
	}
	ps := make([]*proc, nprocs)
	for k := range ps {
		ps[k] = &proc{name: fmt.Sprintf("p%d", k), clock: newFakeClock(t, start), shuffle: rand.New(rand.NewPCG(seed, uint64(k)))}
	}
	var objects []*Node
	var deletesOff bool // a clock ran too far ahead of the server's
	settings := func(p *proc) NodeSettings {
		return NodeSettings{
			Bucket: bucket, Instance: p.name, Lease: p.lease, Heartbeat: p.lease / 3,
			Settings: Settings{Now: p.clock.Now, mono: p.clock.Mono, sleep: p.clock.Sleep, Logger: quiet()}, // a schedule logs thousands of lease events: quiet
			shuffle:  p.shuffle.Shuffle, manual: true,
		}
	}
	start1 := func(p *proc) string {
		p.lease = propLease
		if r.IntN(4) == 0 {
			p.lease = propLongLease
		}
		w, err := Start(ctx, js, settings(p))
		switch {
		case errors.Is(err, ErrNoWorkerID):
			m.count["start refused"]++
			return "no worker ID"
		case err != nil:
			fail("%s: Start: %v", p.name, err)
		}
		objects = append(objects, w)
		p.w, p.obj, p.partitioned = w, len(objects), false
		id, _ := w.WorkerID()
		return fmt.Sprintf("worker #%d took %d (lease %v)", p.obj, id, p.lease)
	}
	defer func() {
		for _, p := range ps {
			if p.w != nil {
				_ = p.w.Close(context.Background())
			}
		}
	}()
	for _, p := range ps {
		m.ops = append(m.ops, fmt.Sprintf("start %s: %s", p.name, start1(p)))
	}

	type op struct {
		weight int
		run    func(p *proc) string
		down   bool // run on a process that is down, if any
	}
	issue := func(p *proc) string {
		if p.w == nil {
			return "down"
		}
		n := []int{1, 10, 100, 1000, 5000}[r.IntN(5)]
		ids, err := p.w.AppendIDs(nil, n)
		if err != nil {
			if !Unavailable(err) {
				fail("%s: AppendIDs(%d): %v", p.name, n, err)
			}
			m.count["issue refused"]++
			return fmt.Sprintf("issue %d: %v", n, err)
		}
		if err := m.record(p.obj, ids); err != nil {
			fail("%s: %v", p.name, err)
		}
		m.count["issued"] += uint64(n)
		pa := Decode(ids[0], time.Time{})
		return fmt.Sprintf("issue %d: worker ID %d from timestamp %d", n, pa.Worker, pa.Timestamp)
	}
	// tick does what the background loop does on a tick or a kick.
	tick := func(p *proc) string {
		if p.w == nil || p.partitioned {
			return "no heartbeat"
		}
		if _, held := p.w.WorkerID(); held {
			p.w.heartbeat()
		} else {
			p.w.reclaim()
		}
		id, held := p.w.WorkerID()
		return fmt.Sprintf("heartbeat: worker ID %d held %v", id, held)
	}
	advance := func(d time.Duration) string {
		for _, q := range ps {
			q.clock.Add(d)
		}
		return fmt.Sprintf("advance all clocks %v", d)
	}
	remove := func(id int) string {
		del, what := kv.Delete, "delete"
		if r.IntN(2) == 0 {
			del, what = kv.Purge, "purge"
		}
		if err := del(ctx, workerKey(id)); err != nil {
			fail("%s %d: %v", what, id, err)
		}
		m.count["deletes"]++
		return fmt.Sprintf("%s worker key %d", what, id)
	}
	ops := []op{
		{weight: 40, run: issue},
		{weight: 20, run: tick},
		{weight: 10, run: func(*proc) string { // time passes for everyone
			return advance([]time.Duration{time.Millisecond, time.Millisecond, 10 * time.Millisecond, 100 * time.Millisecond,
				propLease / 3, propLease / 2, propLease, 2 * propLease}[r.IntN(8)])
		}},
		{weight: 3, run: func(p *proc) string { // an NTP step on one host
			d := []time.Duration{-2 * propLease, -propLease / 2, -3 * time.Millisecond, 3 * time.Millisecond,
				propLease / 2, 2 * propLease}[r.IntN(6)]
			p.clock.SetWall(p.clock.Now().Add(d))
			return fmt.Sprintf("step wall clock %v", d)
		}},
		{weight: 4, run: func(p *proc) string {
			p.partitioned = !p.partitioned
			return fmt.Sprintf("partitioned %v", p.partitioned)
		}},
		{weight: 3, run: func(p *proc) string {
			if p.w == nil {
				return "down"
			}
			crash(t, p.w)
			p.w = nil
			m.count["crashes"]++
			return "crash"
		}},
		{weight: 2, run: func(p *proc) string {
			if p.w == nil {
				return "down"
			}
			if err := p.w.Close(ctx); err != nil {
				fail("%s: Close: %v", p.name, err)
			}
			p.w = nil
			return "close"
		}},
		{weight: 10, run: func(p *proc) string {
			if p.w != nil {
				return "already up"
			}
			return "start: " + start1(p)
		}, down: true},
		{weight: 3, run: func(*proc) string { // an operator deletes or purges any key
			if deletesOff {
				return "no delete (clocks too far ahead)"
			}
			return remove(free[r.IntN(len(free))])
		}},
		{weight: 4, run: func(p *proc) string { // ... a live holder's key, which it notices and re-claims at once
			id, held := 0, false
			if p.w != nil {
				id, held = p.w.WorkerID()
			}
			if deletesOff || !held || p.partitioned {
				return "no delete"
			}
			return strings.Join([]string{remove(id), tick(p), tick(p), issue(p)}, "; ")
		}},
		{weight: 2, run: func(*proc) string { // ... the key of a holder cut off from NATS, which cannot notice
			for _, q := range ps {
				if q.w == nil || !q.partitioned || deletesOff {
					continue
				}
				if id, held := q.w.WorkerID(); held {
					return q.name + "'s: " + remove(id)
				}
			}
			return "no delete"
		}},
		{weight: 1, run: func(*proc) string { // long enough for deleted keys to be claimable
			return advance([]time.Duration{DeletedKeyMargin + 3*propLease, 3 * propLongLease}[r.IntN(2)])
		}},
	}
	total := 0
	for _, o := range ops {
		total += o.weight
	}
	// pickProc returns a random process, preferring one that is up (or
	// down) if want says so.
	pickProc := func(want func(*proc) bool) *proc {
		var fit []*proc
		for _, p := range ps {
			if want(p) {
				fit = append(fit, p)
			}
		}
		if len(fit) == 0 {
			fit = ps
		}
		return fit[r.IntN(len(fit))]
	}
	up := func(p *proc) bool { return p.w != nil }
	down := func(p *proc) bool { return p.w == nil }
	for range steps {
		pick := r.IntN(total)
		var o op
		for _, o = range ops {
			if pick < o.weight {
				break
			}
			pick -= o.weight
		}
		p := pickProc(up)
		if o.down {
			p = pickProc(down)
		}
		what := o.run(p)
		m.ops = append(m.ops, p.name+": "+what)
		for _, q := range ps {
			if q.clock.Now().Sub(time.Now()) > propMaxAhead {
				deletesOff = true
			}
		}
	}
	for _, w := range objects {
		st := w.stats()
		m.count["claims"] += st.Claims
		m.count["lost leases"] += st.LostLeases
	}
	t.Logf("seed %d: %d Workers, outcomes %v", seed, len(objects), m.count)
	return m.count["issued"]
}
