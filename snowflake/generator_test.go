package snowflake

import (
	"errors"
	"math"
	"sync"
	"testing"
	"time"
)

// t0 is a fixed test time well after DefaultEpoch.
var t0 = DefaultEpoch.Add(1234*time.Hour + 567*time.Millisecond)

// newTestGenerator returns a Generator on clock c for worker 7.
func newTestGenerator(tb testing.TB, c *fakeClock, s Settings) *Generator {
	tb.Helper()
	if s.WorkerID == 0 {
		s.WorkerID = 7
	}
	s.Now = c.Now
	s.mono = c.Mono
	if s.sleep == nil {
		s.sleep = c.Sleep
	}
	if s.Logger == nil {
		s.Logger = testLogger(tb)
	}
	g, err := New(s)
	if err != nil {
		tb.Fatalf("New: %v", err)
	}
	return g
}

func TestNewSettings(t *testing.T) {
	now := t0
	clock := func() time.Time { return now }
	tests := []struct {
		name    string
		s       Settings
		wantErr error
	}{
		{name: "defaults", s: Settings{}},
		{name: "max worker ID", s: Settings{WorkerID: MaxWorkerID}},
		{name: "worker ID too large", s: Settings{WorkerID: MaxWorkerID + 1}, wantErr: ErrInvalidWorkerID},
		{name: "negative worker ID", s: Settings{WorkerID: -1}, wantErr: ErrInvalidWorkerID},
		{name: "epoch now", s: Settings{Epoch: now}},
		{name: "epoch in future", s: Settings{Epoch: now.Add(time.Millisecond)}, wantErr: ErrEpochInFuture},
		{name: "epoch at 41-bit limit", s: Settings{Epoch: now.Add(-MaxTimestamp * time.Millisecond)}},
		{name: "epoch beyond 41 bits", s: Settings{Epoch: now.Add(-(MaxTimestamp + 1) * time.Millisecond)}, wantErr: ErrOverTimeLimit},
		{name: "epoch not a whole millisecond", s: Settings{Epoch: DefaultEpoch.Add(time.Microsecond)}, wantErr: ErrInvalidSettings},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tt.s.Now = clock
			g, err := New(tt.s)
			if !errors.Is(err, tt.wantErr) {
				t.Fatalf("New: got error %v, want %v", err, tt.wantErr)
			}
			if err != nil {
				return
			}
			want := tt.s.Epoch
			if want.IsZero() {
				want = DefaultEpoch
			}
			if got := g.Epoch(); !got.Equal(want) {
				t.Errorf("Epoch() = %v, want %v", got, want)
			}
			if got := g.WorkerID(); got != tt.s.WorkerID {
				t.Errorf("WorkerID() = %d, want %d", got, tt.s.WorkerID)
			}
		})
	}
}

func TestLayout(t *testing.T) {
	c := newFakeClock(t, DefaultEpoch.Add(12345*time.Millisecond))
	g := newTestGenerator(t, c, Settings{WorkerID: 7})
	ids, err := g.NextN(2)
	if err != nil {
		t.Fatal(err)
	}
	want := []int64{12345<<22 | 7<<12 | 0, 12345<<22 | 7<<12 | 1}
	for i := range ids {
		if ids[i] != want[i] {
			t.Errorf("ids[%d] = %#x, want %#x", i, ids[i], want[i])
		}
	}
	if got := compose(MaxTimestamp, MaxWorkerID, MaxSequence); got != math.MaxInt64 {
		t.Errorf("largest ID = %#x, want %#x (sign bit clear)", got, int64(math.MaxInt64))
	}
}

func TestMonotonicPerWorker(t *testing.T) {
	c := newFakeClock(t, t0)
	g := newTestGenerator(t, c, Settings{})
	var ids []int64
	for i := range 2000 {
		c.Add(time.Duration(i%3) * 700 * time.Microsecond)
		var err error
		if ids, err = g.AppendIDs(ids, 1+i%50); err != nil {
			t.Fatalf("AppendIDs: %v", err)
		}
	}
	requireIncreasing(t, ids)
	for _, id := range ids {
		if p := Decode(id, g.Epoch()); p.Worker != 7 {
			t.Fatalf("ID %d has worker %d, want 7", id, p.Worker)
		}
	}
}

func TestSequenceOverflow(t *testing.T) {
	c := newFakeClock(t, t0) // stalled: never advances by itself
	g := newTestGenerator(t, c, Settings{})
	base := t0.Sub(DefaultEpoch).Milliseconds()
	const n = 3*(MaxSequence+1) + 5
	ids, err := g.NextN(n)
	if err != nil {
		t.Fatal(err)
	}
	requireIncreasing(t, ids)
	for i, id := range ids {
		p := Decode(id, time.Time{})
		if want := base + int64(i>>SequenceBits); p.Timestamp != want {
			t.Fatalf("ids[%d]: timestamp %d, want %d", i, p.Timestamp, want)
		}
		if want := int64(i & MaxSequence); p.Sequence != want {
			t.Fatalf("ids[%d]: sequence %d, want %d", i, p.Sequence, want)
		}
	}
	// The clock moves on but is still behind the borrowed timestamp:
	// issuing continues where it was.
	c.Add(time.Millisecond)
	id, err := g.Next()
	if err != nil {
		t.Fatal(err)
	}
	if got, want := Decode(id, time.Time{}), (Parts{Timestamp: base + 3, Sequence: 5}); got.Timestamp != want.Timestamp || got.Sequence != want.Sequence {
		t.Errorf("after overflow: got timestamp %d sequence %d, want %d %d", got.Timestamp, got.Sequence, want.Timestamp, want.Sequence)
	}
	// The clock passes it: a fresh millisecond starts at sequence 0.
	c.Add(10 * time.Millisecond)
	id, err = g.Next()
	if err != nil {
		t.Fatal(err)
	}
	if got := Decode(id, time.Time{}); got.Timestamp != base+11 || got.Sequence != 0 {
		t.Errorf("fresh millisecond: got timestamp %d sequence %d, want %d 0", got.Timestamp, got.Sequence, base+11)
	}
}

func TestBorrowIsBounded(t *testing.T) {
	tests := []struct {
		name      string
		maxBorrow time.Duration
		wantAhead int64 // the furthest timestamp ahead of the stalled clock
	}{
		{name: "default", maxBorrow: 0, wantAhead: DefaultMaxBorrow.Milliseconds()},
		{name: "10ms", maxBorrow: 10 * time.Millisecond, wantAhead: 10},
		{name: "no borrowing", maxBorrow: -1, wantAhead: 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := newFakeClock(t, t0)
			sleeps := 0
			g := newTestGenerator(t, c, Settings{MaxBorrow: tt.maxBorrow, sleep: func(time.Duration) { sleeps++ }})
			var ids []int64
			var err error
			for range 1000 {
				if ids, err = g.AppendIDs(ids, 1000); err != nil {
					break
				}
			}
			if !errors.Is(err, ErrOverloaded) || !errors.Is(err, ErrUnavailable) {
				t.Fatalf("stalled clock: got error %v, want ErrOverloaded (is ErrUnavailable)", err)
			}
			if sleeps == 0 {
				t.Errorf("got no waits for the clock before ErrOverloaded")
			}
			requireIncreasing(t, ids)
			base := t0.Sub(DefaultEpoch).Milliseconds()
			last := Decode(ids[len(ids)-1], time.Time{}).Timestamp
			if last-base > tt.wantAhead {
				t.Errorf("borrowed up to %d ms ahead, want at most %d", last-base, tt.wantAhead)
			}
			if want := (tt.wantAhead + 1) * (MaxSequence + 1); int64(len(ids)) < want-1000 {
				t.Errorf("issued %d IDs before refusing, want about %d", len(ids), want)
			}
		})
	}
}

func TestClockBackwards(t *testing.T) {
	tests := []struct {
		name         string
		maxBackwards time.Duration
		back         time.Duration
		advancing    bool // sleep advances the clock
		wantErr      error
		wantWaits    uint64
	}{
		{name: "1ms waited out", back: time.Millisecond, advancing: true, wantWaits: 1},
		{name: "5ms waited out", back: 5 * time.Millisecond, advancing: true, wantWaits: 1},
		{name: "5ms with stalled clock continues", back: 5 * time.Millisecond, wantWaits: maxAttempts - 1},
		{name: "6ms refused", back: 6 * time.Millisecond, wantErr: ErrClockBackwards},
		{name: "1h refused", back: time.Hour, wantErr: ErrClockBackwards},
		{name: "before epoch refused", back: t0.Sub(DefaultEpoch) + time.Second, wantErr: ErrClockBackwards},
		{name: "never wait: 1ms refused", maxBackwards: -1, back: time.Millisecond, wantErr: ErrClockBackwards},
		{name: "20ms allowed", maxBackwards: 20 * time.Millisecond, back: 20 * time.Millisecond, advancing: true, wantWaits: 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := newFakeClock(t, t0)
			sleep := func(time.Duration) {}
			if tt.advancing {
				sleep = c.Sleep
			}
			g := newTestGenerator(t, c, Settings{MaxBackwards: tt.maxBackwards, sleep: sleep})
			before, err := g.NextN(10)
			if err != nil {
				t.Fatal(err)
			}
			c.SetWall(t0.Add(-tt.back))
			ids, err := g.NextN(10)
			if !errors.Is(err, tt.wantErr) {
				t.Fatalf("after stepping back %v: got error %v, want %v", tt.back, err, tt.wantErr)
			}
			if err != nil {
				if !errors.Is(err, ErrUnavailable) {
					t.Errorf("error %v is not ErrUnavailable", err)
				}
				st := g.stats()
				if !st.backwards || st.backEvents != 1 {
					t.Errorf("stats: backwards %v events %d, want true 1", st.backwards, st.backEvents)
				}
				// Still refused a little later, and counted once.
				if tt.back/2 > DefaultMaxBackwards {
					c.SetWall(t0.Add(-tt.back / 2))
					if _, err := g.Next(); !errors.Is(err, ErrClockBackwards) {
						t.Errorf("half way back: got error %v, want ErrClockBackwards", err)
					}
				}
				// Caught up: issuing resumes above everything issued.
				c.SetWall(t0)
				if ids, err = g.NextN(10); err != nil {
					t.Fatalf("after catching up: %v", err)
				}
				if st := g.stats(); st.backwards || st.backEvents != 1 {
					t.Errorf("stats after catching up: backwards %v events %d, want false 1", st.backwards, st.backEvents)
				}
			}
			if got := g.stats().backWaits; got != tt.wantWaits {
				t.Errorf("waits: got %d, want %d", got, tt.wantWaits)
			}
			all := append(before, ids...)
			requireIncreasing(t, all)
		})
	}
}

func TestTimeLimit(t *testing.T) {
	epoch := t0.Add(-MaxTimestamp*time.Millisecond + time.Millisecond) // now = MaxTimestamp-1
	c := newFakeClock(t, t0)
	g := newTestGenerator(t, c, Settings{Epoch: epoch, MaxBorrow: time.Hour})
	ids, err := g.NextN(2 * (MaxSequence + 1))
	if err != nil {
		t.Fatalf("up to the last millisecond: %v", err)
	}
	if got := Decode(ids[len(ids)-1], epoch); got.Timestamp != MaxTimestamp || got.Sequence != MaxSequence {
		t.Errorf("last ID: timestamp %d sequence %d, want %d %d", got.Timestamp, got.Sequence, int64(MaxTimestamp), MaxSequence)
	}
	if _, err := g.Next(); !errors.Is(err, ErrOverTimeLimit) {
		t.Errorf("past the last millisecond: got error %v, want ErrOverTimeLimit", err)
	} else if errors.Is(err, ErrUnavailable) {
		t.Errorf("ErrOverTimeLimit must not be ErrUnavailable (it is permanent)")
	}
	c.Add(time.Second)
	if _, err := g.Next(); !errors.Is(err, ErrOverTimeLimit) {
		t.Errorf("clock past 41 bits: got error %v, want ErrOverTimeLimit", err)
	}
}

func TestInvalidCount(t *testing.T) {
	g := newTestGenerator(t, newFakeClock(t, t0), Settings{})
	for _, tt := range []struct {
		name    string
		n       int
		wantErr error
	}{
		{name: "zero", n: 0, wantErr: ErrInvalidCount},
		{name: "negative", n: -5, wantErr: ErrInvalidCount},
		{name: "one", n: 1},
		{name: "max", n: MaxCount},
		{name: "too many", n: MaxCount + 1, wantErr: ErrInvalidCount},
	} {
		t.Run(tt.name, func(t *testing.T) {
			dst := []int64{42}
			got, err := g.AppendIDs(dst, tt.n)
			if !errors.Is(err, tt.wantErr) {
				t.Fatalf("AppendIDs(_, %d): got error %v, want %v", tt.n, err, tt.wantErr)
			}
			want := 1
			if err == nil {
				want += tt.n
			}
			if len(got) != want || got[0] != 42 {
				t.Errorf("AppendIDs(_, %d): got len %d first %d, want len %d first 42", tt.n, len(got), got[0], want)
			}
			if _, err := g.NextN(tt.n); !errors.Is(err, tt.wantErr) {
				t.Errorf("NextN(%d): got error %v, want %v", tt.n, err, tt.wantErr)
			}
		})
	}
}

func TestRandomSequence(t *testing.T) {
	c := newFakeClock(t, t0)
	g := newTestGenerator(t, c, Settings{RandomSequence: true})
	var ids []int64
	nonZero := 0
	for range 500 {
		c.Add(time.Millisecond)
		var err error
		if ids, err = g.AppendIDs(ids, 1); err != nil {
			t.Fatal(err)
		}
		seq := Decode(ids[len(ids)-1], time.Time{}).Sequence
		if seq >= RandomSequenceSpan {
			t.Fatalf("first sequence of a millisecond %d, want < %d", seq, RandomSequenceSpan)
		}
		if seq != 0 {
			nonZero++
		}
	}
	if nonZero == 0 {
		t.Errorf("500 milliseconds all started at sequence 0")
	}
	// A full millisecond still borrows the next one, starting at 0.
	more, err := g.NextN(MaxSequence + 1)
	if err != nil {
		t.Fatal(err)
	}
	if p := Decode(more[len(more)-1], time.Time{}); p.Sequence == MaxSequence {
		t.Errorf("4096 IDs after a random start ended at sequence %d; want a borrowed millisecond", p.Sequence)
	}
	requireIncreasing(t, append(ids, more...))
}

func TestConcurrentUnique(t *testing.T) {
	g, err := New(Settings{WorkerID: 3, Logger: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	const goroutines, per = 8, 5000
	results := make([][]int64, goroutines)
	var wg sync.WaitGroup
	for i := range goroutines {
		wg.Go(func() {
			var ids []int64
			for j := 0; len(ids) < per; j++ {
				var err error
				if ids, err = g.AppendIDs(ids, 1+j%7); err != nil {
					t.Errorf("AppendIDs: %v", err)
					return
				}
			}
			results[i] = ids
		})
	}
	wg.Wait()
	// Checked here: requireIncreasing calls t.Fatalf, which must not run
	// on another goroutine than the test's.
	var all []int64
	for _, r := range results {
		requireIncreasing(t, r)
		all = append(all, r...)
	}
	requireUnique(t, all)
}

func TestAppendIDsDoesNotAllocate(t *testing.T) {
	g := newTestGenerator(t, newFakeClock(t, t0), Settings{MaxBorrow: time.Hour})
	dst := make([]int64, 0, 100)
	allocs := testing.AllocsPerRun(100, func() {
		var err error
		if dst, err = g.AppendIDs(dst[:0], 100); err != nil {
			t.Fatal(err)
		}
	})
	if allocs != 0 {
		t.Errorf("AppendIDs into a slice with room: %v allocations per call, want 0", allocs)
	}
}

// TestLeasedGenerator covers the lease hooks the Node uses: the floor,
// the bound and the monotonic validity.
func TestLeasedGenerator(t *testing.T) {
	c := newFakeClock(t, t0)
	g, err := newGenerator(Settings{Now: c.Now, mono: c.Mono, sleep: func(time.Duration) {}, Logger: testLogger(t)}, true)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := g.Next(); !errors.Is(err, ErrFenced) {
		t.Fatalf("before a lease: got error %v, want ErrFenced", err)
	}
	nowMs := t0.Sub(DefaultEpoch).Milliseconds()
	const lease = 300 * time.Millisecond

	// Previous holder's floor 20ms ahead of our clock: clock behind.
	g.assign(9, nowMs+20, nowMs+20+lease.Milliseconds(), c.Mono()+lease)
	if _, err := g.Next(); !errors.Is(err, ErrClockBackwards) {
		t.Fatalf("clock behind the floor: got error %v, want ErrClockBackwards", err)
	}
	c.Add(20 * time.Millisecond)
	ids, err := g.NextN(10)
	if err != nil {
		t.Fatalf("clock at the floor: %v", err)
	}
	if p := Decode(ids[0], time.Time{}); p.Timestamp != nowMs+21 || p.Worker != 9 {
		t.Errorf("first ID: timestamp %d worker %d, want %d 9 (above the floor)", p.Timestamp, p.Worker, nowMs+21)
	}

	// The stalled clock runs into the bound, never past it.
	bound := nowMs + 25
	g.renew(bound, c.Mono()+lease) // renew never lowers the bound
	g.mu.Lock()
	g.boundMs = bound
	g.mu.Unlock()
	for err == nil {
		var more []int64
		more, err = g.AppendIDs(nil, 1000)
		ids = append(ids, more...)
	}
	if !errors.Is(err, ErrFenced) {
		t.Fatalf("at the bound: got error %v, want ErrFenced", err)
	}
	if p := Decode(ids[len(ids)-1], time.Time{}); p.Timestamp > bound {
		t.Fatalf("issued timestamp %d beyond the bound %d", p.Timestamp, bound)
	}
	// A bound far ahead, so that below only the monotonic clock fences.
	farBound := bound + 10*lease.Milliseconds()
	g.renew(farBound, c.Mono()+lease)
	if _, err := g.Next(); err != nil {
		t.Fatalf("after renewal: %v", err)
	}

	// No renewal within the lease: fenced, by the monotonic clock only
	// (the wall clock stays well within the bound).
	c.SetWall(c.Now().Add(-time.Millisecond))
	c.Add(lease)
	if wallMs := c.Now().UnixMilli() - DefaultEpoch.UnixMilli(); wallMs >= farBound-lease.Milliseconds() {
		t.Fatalf("wall clock %d within a lease of the bound %d: the test needs it far below", wallMs, farBound)
	}
	// Servable sees it first (the service's watcher asks it before any
	// request comes): the episode is counted all the same.
	if g.Servable() {
		t.Fatal("lease timed out: Servable() = true")
	}
	if _, err := g.Next(); !errors.Is(err, ErrFenced) {
		t.Fatalf("lease timed out: got error %v, want ErrFenced", err)
	}
	if st := g.stats(); !st.fenced || st.fenceEvents != 2 {
		t.Errorf("stats: fenced %v episodes %d, want true 2", st.fenced, st.fenceEvents)
	}
	g.renew(farBound, c.Mono()+lease)
	if !g.Servable() {
		t.Fatal("after renewal: Servable() = false")
	}
	more, err := g.NextN(5)
	if err != nil {
		t.Fatalf("after renewal: %v", err)
	}
	ids = append(ids, more...)

	// Revoked: refused whatever the lease says.
	if last := g.revoke(ErrFenced); last != Decode(ids[len(ids)-1], time.Time{}).Timestamp {
		t.Errorf("revoke returned last timestamp %d, want that of the last ID", last)
	}
	if _, err := g.Next(); !errors.Is(err, ErrFenced) {
		t.Fatalf("revoked: got error %v, want ErrFenced", err)
	}
	// Re-assigned the same worker ID with a lower floor: keeps going up.
	g.assign(9, nowMs, farBound+1000, c.Mono()+lease)
	more, err = g.NextN(5)
	if err != nil {
		t.Fatalf("re-assigned: %v", err)
	}
	ids = append(ids, more...)
	requireIncreasing(t, ids)
}

// TestLeasedGeneratorKeepsOrderAcrossWorkerIDs: assign under a lower worker
// ID resumes above the last ID, whether the new lease has no floor or a
// floor below the timestamps borrowed under the old one.
func TestLeasedGeneratorKeepsOrderAcrossWorkerIDs(t *testing.T) {
	tests := []struct {
		name  string
		floor int64 // relative to the clock; -1: none
		n     int   // IDs issued under the first worker ID
	}{
		{name: "never used worker ID", floor: -1, n: 3 * 4096},
		{name: "floor below the borrowed timestamps", floor: 0, n: 3 * 4096},
		// The last millisecond's sequence only partly used: the new
		// worker ID's sequence starts in the next one, not after the
		// old worker ID's last sequence number.
		{name: "last millisecond partly used", floor: -1, n: 10},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := newFakeClock(t, t0)
			g, err := newGenerator(Settings{Now: c.Now, mono: c.Mono, sleep: func(time.Duration) {}, Logger: testLogger(t)}, true)
			if err != nil {
				t.Fatal(err)
			}
			nowMs := t0.Sub(DefaultEpoch).Milliseconds()
			const lease = 300 * time.Millisecond
			g.assign(900, -1, nowMs+lease.Milliseconds(), c.Mono()+lease)
			ids, err := g.NextN(tt.n) // 3*4096: two milliseconds borrowed
			if err != nil {
				t.Fatal(err)
			}
			g.revoke(ErrFenced)
			floor := int64(-1)
			if tt.floor >= 0 {
				floor = nowMs + tt.floor
			}
			g.assign(3, floor, nowMs+lease.Milliseconds(), c.Mono()+lease)
			more, err := g.NextN(10)
			if err != nil {
				t.Fatal(err)
			}
			if p := Decode(more[0], time.Time{}); p.Worker != 3 || more[0] <= ids[len(ids)-1] {
				t.Fatalf("first ID under worker ID 3: %d (worker %d, timestamp %d), want above the last under 900, %d (timestamp %d)",
					more[0], p.Worker, p.Timestamp, ids[len(ids)-1], Decode(ids[len(ids)-1], time.Time{}).Timestamp)
			}
		})
	}
}
