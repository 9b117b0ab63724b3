package snowflake

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/dispenser-dev/dispenser/testenv"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Short leases keep the tests fast; no test asserts how long anything took.
const (
	testLease     = 300 * time.Millisecond
	testHeartbeat = 20 * time.Millisecond
)

// newJetStream starts an embedded nats-server and returns a JetStream
// context on it.
func newJetStream(tb testing.TB) jetstream.JetStream {
	tb.Helper()
	nc := testenv.Connect(tb, testenv.NATS(tb))
	js, err := jetstream.New(nc)
	if err != nil {
		tb.Fatalf("jetstream: %v", err)
	}
	return js
}

// fakeSettings returns worker settings on clock c with short leases.
func fakeSettings(tb testing.TB, c *fakeClock, instance string) WorkerSettings {
	tb.Helper()
	return WorkerSettings{
		Instance:  instance,
		Lease:     testLease,
		Heartbeat: testHeartbeat,
		Now:       c.Now,
		Logger:    testLogger(tb).With("test_instance", instance),
		mono:      c.Mono,
		sleep:     c.Sleep,
	}
}

// startWorker starts a worker and closes it in Cleanup.
func startWorker(tb testing.TB, js jetstream.JetStream, s WorkerSettings) *Worker {
	tb.Helper()
	w, err := tryStartWorker(tb, js, s)
	if err != nil {
		tb.Fatalf("StartWorker(%q): %v", s.Instance, err)
	}
	return w
}

// tryStartWorker starts a worker; if it succeeds, Cleanup closes it.
func tryStartWorker(tb testing.TB, js jetstream.JetStream, s WorkerSettings) (*Worker, error) {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	w, err := StartWorker(ctx, js, s)
	if err != nil {
		return nil, err
	}
	tb.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := w.Close(ctx); err != nil {
			tb.Errorf("Close(%q): %v", s.Instance, err)
		}
	})
	return w, nil
}

// crash stops w as kill -9 would: no more heartbeats, no release.
func crash(tb testing.TB, w *Worker) {
	tb.Helper()
	w.closeOnce.Do(func() {
		w.cancel()
		<-w.done
		w.gen.revoke(ErrClosed)
		w.mu.Lock()
		w.closed = true
		w.mu.Unlock()
	})
}

func workerID(tb testing.TB, w *Worker) int {
	tb.Helper()
	id, ok := w.WorkerID()
	if !ok {
		tb.Fatalf("worker %q holds no worker ID", w.Instance())
	}
	return id
}

// issue takes n IDs from w and fails the test on error.
func issue(tb testing.TB, w *Worker, n int) []int64 {
	tb.Helper()
	ids, err := w.AppendIDs(nil, n)
	if err != nil {
		tb.Fatalf("AppendIDs(%q): %v", w.Instance(), err)
	}
	return ids
}

func openKV(tb testing.TB, js jetstream.JetStream) jetstream.KeyValue {
	tb.Helper()
	kv, err := js.KeyValue(context.Background(), DefaultBucket)
	if err != nil {
		tb.Fatalf("open bucket: %v", err)
	}
	return kv
}

func readLease(tb testing.TB, kv jetstream.KeyValue, id int) (leaseRecord, uint64) {
	tb.Helper()
	e, err := kv.Get(context.Background(), workerKey(id))
	if err != nil {
		tb.Fatalf("read lease %d: %v", id, err)
	}
	var r leaseRecord
	if err := json.Unmarshal(e.Value(), &r); err != nil {
		tb.Fatalf("decode lease %d %s: %v", id, e.Value(), err)
	}
	return r, e.Revision()
}

// fillOthers writes live leases held by "squatter" for every worker ID but
// the given ones, as if 1024 workers ran.
func fillOthers(tb testing.TB, kv jetstream.KeyValue, now time.Time, except ...int) {
	tb.Helper()
	ctx := context.Background()
	for id := range MaxWorkerID + 1 {
		if contains(except, id) {
			continue
		}
		data, err := json.Marshal(squatter(id, now))
		if err != nil {
			tb.Fatal(err)
		}
		if _, err := kv.Create(ctx, workerKey(id), data); err != nil {
			tb.Fatalf("fill worker ID %d: %v", id, err)
		}
	}
}

func squatter(id int, now time.Time) leaseRecord {
	return leaseRecord{
		Version: recordVersion, Worker: id, Instance: "squatter", Session: "squatter",
		Epoch: DefaultEpoch, LeaseMS: time.Hour.Milliseconds(),
		Heartbeat: now, Expires: now.Add(time.Hour), Bound: now.Add(time.Hour),
	}
}

func contains(ids []int, id int) bool {
	for _, x := range ids {
		if x == id {
			return true
		}
	}
	return false
}

// release marks a squatter's lease released, as its graceful shutdown would.
func release(tb testing.TB, kv jetstream.KeyValue, id int) {
	tb.Helper()
	r, rev := readLease(tb, kv, id)
	r.Released = true
	r.Bound = r.Heartbeat
	data, _ := json.Marshal(r)
	if _, err := kv.Update(context.Background(), workerKey(id), data, rev); err != nil {
		tb.Fatalf("release %d: %v", id, err)
	}
}

func timestampOf(id int64) int64 { return Decode(id, time.Time{}).Timestamp }

func maxTimestamp(ids []int64) int64 {
	m := int64(-1)
	for _, id := range ids {
		m = max(m, timestampOf(id))
	}
	return m
}

func TestWorkerSettingsInvalid(t *testing.T) {
	tests := []struct {
		name string
		s    WorkerSettings
	}{
		{name: "negative lease", s: WorkerSettings{Lease: -time.Second}},
		{name: "tiny lease", s: WorkerSettings{Lease: time.Millisecond}},
		{name: "heartbeat equals lease", s: WorkerSettings{Lease: time.Second, Heartbeat: time.Second}},
		{name: "negative heartbeat", s: WorkerSettings{Heartbeat: -time.Second}},
		{name: "too many replicas", s: WorkerSettings{Replicas: 7}},
		{name: "negative replicas", s: WorkerSettings{Replicas: -1}},
		{name: "epoch not a whole millisecond", s: WorkerSettings{Epoch: DefaultEpoch.Add(time.Nanosecond)}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			// Settings are checked before the JetStream context is used.
			_, err := StartWorker(context.Background(), nil, tt.s)
			if !errors.Is(err, ErrInvalidSettings) {
				t.Fatalf("got error %v, want ErrInvalidSettings", err)
			}
		})
	}
}

func TestWorkerSettingsDefaults(t *testing.T) {
	s, err := WorkerSettings{}.normalize()
	if err != nil {
		t.Fatal(err)
	}
	if s.Bucket != DefaultBucket || s.Replicas != 1 || s.Lease != DefaultLease || s.Heartbeat != DefaultHeartbeat ||
		!s.Epoch.Equal(DefaultEpoch) || s.Instance == "" {
		t.Errorf("defaults: got %+v", s)
	}
	s2, _ := WorkerSettings{}.normalize()
	if s.Instance == s2.Instance {
		t.Errorf("default instance names repeat: %q", s.Instance)
	}
	if s, _ := (WorkerSettings{Lease: 300 * time.Millisecond}).normalize(); s.Heartbeat != 100*time.Millisecond {
		t.Errorf("heartbeat for a 300ms lease: got %v, want 100ms", s.Heartbeat)
	}
}

func TestWorkerIssuesAndReleases(t *testing.T) {
	js := newJetStream(t)
	c := newFakeClock(t, t0)
	w := startWorker(t, js, fakeSettings(t, c, "alpha"))
	id := workerID(t, w)
	ids := issue(t, w, 10000)
	requireIncreasing(t, ids)
	for _, x := range ids {
		if p := Decode(x, w.Epoch()); p.Worker != int64(id) {
			t.Fatalf("ID %d has worker %d, want %d", x, p.Worker, id)
		}
	}
	kv := openKV(t, js)
	rec, _ := readLease(t, kv, id)
	if rec.Instance != "alpha" || rec.Released || !rec.Epoch.Equal(DefaultEpoch) || rec.LeaseMS != testLease.Milliseconds() {
		t.Errorf("live lease: got %+v", rec)
	}
	if bound := rec.Bound.UnixMilli() - DefaultEpoch.UnixMilli(); maxTimestamp(ids) > bound {
		t.Errorf("issued timestamp %d beyond the recorded bound %d", maxTimestamp(ids), bound)
	}
	st := w.Stats().(WorkerStats)
	if st.WorkerID != id || !st.Held || st.Fenced || st.Issued != 10000 || st.Instance != "alpha" {
		t.Errorf("stats: got %+v", st)
	}
	if _, err := json.Marshal(w.Stats()); err != nil {
		t.Errorf("stats do not marshal: %v", err)
	}

	if err := w.Close(context.Background()); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if err := w.Close(context.Background()); err != nil {
		t.Errorf("second Close: %v", err)
	}
	if _, err := w.AppendIDs(nil, 1); !errors.Is(err, ErrClosed) || !w.Unavailable(err) {
		t.Errorf("after Close: got error %v, want ErrClosed (unavailable)", err)
	}
	if _, ok := w.WorkerID(); ok {
		t.Errorf("after Close: WorkerID ok")
	}
	rec, _ = readLease(t, kv, id)
	if !rec.Released {
		t.Errorf("after Close: lease not released: %+v", rec)
	}
	if got, want := rec.Bound.UnixMilli()-DefaultEpoch.UnixMilli(), maxTimestamp(ids); got != want {
		t.Errorf("released bound %d, want the last timestamp used %d", got, want)
	}
	select {
	case <-w.done:
	default:
		t.Errorf("heartbeat loop still running after Close")
	}
}

func TestWorkerConcurrentClaims(t *testing.T) {
	js := newJetStream(t)
	const workers = 64
	ws := make([]*Worker, workers)
	var wg sync.WaitGroup
	for i := range workers {
		wg.Go(func() {
			w, err := tryStartWorker(t, js, WorkerSettings{
				Instance:  fmt.Sprintf("w%02d", i),
				Lease:     5 * time.Second,
				Heartbeat: 500 * time.Millisecond,
				Logger:    testLogger(t),
			})
			if err != nil {
				t.Errorf("StartWorker %d: %v", i, err)
				return
			}
			ws[i] = w
		})
	}
	wg.Wait()
	if t.Failed() {
		t.FailNow()
	}
	seen := map[int]string{}
	results := make([][]int64, workers)
	for i, w := range ws {
		id := workerID(t, w)
		if other, dup := seen[id]; dup {
			t.Fatalf("worker ID %d held by both %s and %s", id, other, w.Instance())
		}
		seen[id] = w.Instance()
		wg.Go(func() {
			ids, err := w.AppendIDs(nil, 1000)
			if err != nil {
				t.Errorf("AppendIDs: %v", err)
			}
			results[i] = ids
		})
	}
	wg.Wait()
	var all []int64
	for _, r := range results {
		all = append(all, r...)
	}
	requireUnique(t, all)
	kv := openKV(t, js)
	for id, instance := range seen {
		if rec, _ := readLease(t, kv, id); rec.Instance != instance {
			t.Errorf("worker ID %d: bucket says %q, worker is %q", id, rec.Instance, instance)
		}
	}
}

func TestWorkerHeartbeatKeepsLease(t *testing.T) {
	js := newJetStream(t)
	c := newFakeClock(t, t0)
	a := startWorker(t, js, fakeSettings(t, c, "alpha"))
	aid := workerID(t, a)
	fillOthers(t, openKV(t, js), c.Now(), aid)
	var ids []int64
	// Ten leases' worth of time passes in steps of a third of a lease.
	for step := range 30 {
		c.Add(testLease / 3)
		now := c.Now()
		waitFor(t, "a heartbeat after the clock moved", func() bool {
			return !a.Stats().(WorkerStats).LastHeartbeat.Before(now)
		})
		ids = append(ids, issue(t, a, 100)...)
		if _, err := tryStartWorker(t, js, fakeSettings(t, c, "beta")); !errors.Is(err, ErrNoWorkerID) {
			t.Fatalf("step %d: a competitor got error %v, want ErrNoWorkerID", step, err)
		}
		if got := workerID(t, a); got != aid {
			t.Fatalf("step %d: worker ID changed from %d to %d", step, aid, got)
		}
	}
	requireIncreasing(t, ids)
	if st := a.Stats().(WorkerStats); st.LostLeases != 0 || st.Claims != 1 {
		t.Errorf("stats: lost %d claims %d, want 0 1", st.LostLeases, st.Claims)
	}
}

func TestWorkerTakeoverAfterSafeTime(t *testing.T) {
	js := newJetStream(t)
	c := newFakeClock(t, t0)
	a := startWorker(t, js, fakeSettings(t, c, "alpha"))
	aid := workerID(t, a)
	kv := openKV(t, js)
	fillOthers(t, kv, c.Now(), aid)
	aIDs := issue(t, a, 5000)
	c.Add(testLease / 2)
	waitFor(t, "a heartbeat", func() bool { return !a.Stats().(WorkerStats).LastHeartbeat.Before(c.Now()) })
	aIDs = append(aIDs, issue(t, a, 5000)...)
	crash(t, a)
	rec, _ := readLease(t, kv, aid)
	safe := rec.Bound.Add(rec.lease())
	if !safe.After(rec.Expires) {
		t.Fatalf("bound+lease %v not after expiry %v: the test needs them apart", safe, rec.Expires)
	}
	tests := []struct {
		name    string
		now     time.Time
		wantErr error
	}{
		{name: "lease live", now: rec.Expires.Add(-time.Millisecond), wantErr: ErrNoWorkerID},
		{name: "at expiry", now: rec.Expires, wantErr: ErrNoWorkerID},
		{name: "expired, before bound plus lease", now: rec.Expires.Add(time.Millisecond), wantErr: ErrNoWorkerID},
		{name: "at bound plus lease", now: safe, wantErr: ErrNoWorkerID},
		{name: "past bound plus lease", now: safe.Add(time.Millisecond)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c.SetWall(tt.now)
			b, err := tryStartWorker(t, js, fakeSettings(t, c, "beta"))
			if !errors.Is(err, tt.wantErr) {
				t.Fatalf("got error %v, want %v", err, tt.wantErr)
			}
			if err != nil {
				if !Unavailable(err) || !strings.Contains(err.Error(), "1024 live leases") {
					t.Errorf("error %q: want unavailable, naming 1024 live leases", err)
				}
				return
			}
			if got := workerID(t, b); got != aid {
				t.Fatalf("took worker ID %d, want %d", got, aid)
			}
			bIDs := issue(t, b, 1000)
			if first, bound := timestampOf(bIDs[0]), rec.Bound.UnixMilli()-DefaultEpoch.UnixMilli(); first <= bound {
				t.Errorf("successor's first timestamp %d not above the recorded bound %d", first, bound)
			}
			requireUnique(t, append(aIDs, bIDs...))
		})
	}
}

func TestWorkerPausedStopsBeforeTakeover(t *testing.T) {
	js := newJetStream(t)
	c := newFakeClock(t, t0)
	a := startWorker(t, js, fakeSettings(t, c, "alpha"))
	aid := workerID(t, a)
	kv := openKV(t, js)
	fillOthers(t, kv, c.Now(), aid)
	all := issue(t, a, 1000)
	preMax := maxTimestamp(all)

	// Heartbeats stop (a partition, or a paused process); the process
	// keeps trying to issue while time passes.
	a.paused.Store(true)
	var b *Worker
	refusedAt := -1
	for step := 0; b == nil; step++ {
		if step > 100 {
			t.Fatalf("no takeover after %d steps", step)
		}
		c.Add(testLease / 10)
		ids, err := a.AppendIDs(nil, 10)
		switch {
		case err == nil:
			if refusedAt >= 0 {
				t.Fatalf("step %d: paused worker issued again after refusing at step %d", step, refusedAt)
			}
			all = append(all, ids...)
		case errors.Is(err, ErrFenced):
			if refusedAt < 0 {
				refusedAt = step
			}
		default:
			t.Fatalf("step %d: paused worker: got error %v, want nil or ErrFenced", step, err)
		}
		b, err = tryStartWorker(t, js, fakeSettings(t, c, "beta"))
		if err != nil && !errors.Is(err, ErrNoWorkerID) {
			t.Fatalf("step %d: competitor: %v", step, err)
		}
		if b != nil && (refusedAt < 0 || refusedAt >= step) {
			t.Fatalf("step %d: competitor took the worker ID, but the paused worker had not refused before (refused at %d)", step, refusedAt)
		}
	}
	if got := workerID(t, b); got != aid {
		t.Fatalf("competitor took %d, want %d", got, aid)
	}
	if _, err := a.AppendIDs(nil, 1); !errors.Is(err, ErrFenced) || !Unavailable(err) {
		t.Fatalf("paused worker after takeover: got error %v, want ErrFenced", err)
	}
	bIDs := issue(t, b, 1000)
	if first := timestampOf(bIDs[0]); first <= maxTimestamp(all) {
		t.Fatalf("successor's first timestamp %d not above the paused worker's last %d (before pause %d)", first, maxTimestamp(all), preMax)
	}
	all = append(all, bIDs...)

	// The paused worker comes back: it finds the key taken, stops, and
	// (all other IDs being taken) waits for a free one.
	a.paused.Store(false)
	waitFor(t, "the paused worker to notice the loss", func() bool {
		st := a.Stats().(WorkerStats)
		return st.LostLeases == 1 && !st.Held
	})
	if _, err := a.AppendIDs(nil, 1); !errors.Is(err, ErrFenced) {
		t.Fatalf("after losing the key: got error %v, want ErrFenced", err)
	}
	free := (aid + 1) % (MaxWorkerID + 1)
	release(t, kv, free)
	waitFor(t, "a new worker ID", func() bool { id, ok := a.WorkerID(); return ok && id == free })
	all = append(all, issue(t, a, 1000)...)
	all = append(all, issue(t, b, 1000)...)
	requireUnique(t, all)
	if st := a.Stats().(WorkerStats); st.Claims != 2 || st.FencedEpisodes == 0 {
		t.Errorf("stats: claims %d fenced episodes %d, want 2 and > 0", st.Claims, st.FencedEpisodes)
	}
}

func TestWorkerRestartSameInstance(t *testing.T) {
	tests := []struct {
		name  string
		crash bool
	}{
		{name: "after graceful close"},
		{name: "after a crash and expiry", crash: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			js := newJetStream(t)
			c := newFakeClock(t, t0)
			startWorker(t, js, fakeSettings(t, c, "gamma")) // another live worker
			a := startWorker(t, js, fakeSettings(t, c, "alpha"))
			aid := workerID(t, a)
			aIDs := issue(t, a, 1000)
			if tt.crash {
				crash(t, a)
				rec, _ := readLease(t, openKV(t, js), aid)
				c.SetWall(rec.claimableAt().Add(time.Millisecond))
			} else if err := a.Close(context.Background()); err != nil {
				t.Fatal(err)
			}
			// A newcomer prefers never used IDs over the released one.
			b := startWorker(t, js, fakeSettings(t, c, "beta"))
			if got := workerID(t, b); got == aid {
				t.Fatalf("newcomer took %d, the restarting instance's ID, while others were free", got)
			}
			a2 := startWorker(t, js, fakeSettings(t, c, "alpha"))
			if got := workerID(t, a2); got != aid {
				t.Fatalf("restarted instance got worker ID %d, want its previous %d", got, aid)
			}
			a2IDs := issue(t, a2, 1000)
			if first, last := timestampOf(a2IDs[0]), maxTimestamp(aIDs); first <= last {
				t.Errorf("restarted instance's first timestamp %d not above its last run's %d", first, last)
			}
			requireUnique(t, append(aIDs, a2IDs...))
		})
	}
}

func TestWorkerClockBehindRecordedTimestamp(t *testing.T) {
	tests := []struct {
		name    string
		behind  time.Duration
		wantErr error
	}{
		{name: "an hour behind refuses", behind: time.Hour, wantErr: ErrClockBackwards},
		{name: "a second behind refuses", behind: time.Second, wantErr: ErrClockBackwards},
		{name: "3ms behind is waited out", behind: 3 * time.Millisecond},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			js := newJetStream(t)
			c := newFakeClock(t, t0)
			a := startWorker(t, js, fakeSettings(t, c, "alpha"))
			aid := workerID(t, a)
			aIDs := issue(t, a, 1000)
			if err := a.Close(context.Background()); err != nil {
				t.Fatal(err)
			}
			// The same instance restarts on a host whose clock is behind.
			c.SetWall(t0.Add(-tt.behind))
			a2 := startWorker(t, js, fakeSettings(t, c, "alpha"))
			if got := workerID(t, a2); got != aid {
				t.Fatalf("restart got worker ID %d, want %d", got, aid)
			}
			ids, err := a2.AppendIDs(nil, 10)
			if !errors.Is(err, tt.wantErr) {
				t.Fatalf("got error %v, want %v", err, tt.wantErr)
			}
			if err != nil {
				if !Unavailable(err) {
					t.Errorf("error %v is not unavailable", err)
				}
				if st := a2.Stats().(WorkerStats); !st.ClockBehind || st.ClockBackwards != 1 {
					t.Errorf("stats: clock behind %v, count %d, want true 1", st.ClockBehind, st.ClockBackwards)
				}
				c.SetWall(t0)
				if ids, err = a2.AppendIDs(nil, 10); err != nil {
					t.Fatalf("clock caught up: %v", err)
				}
			}
			if first, last := timestampOf(ids[0]), maxTimestamp(aIDs); first <= last {
				t.Errorf("first timestamp %d not above the recorded %d", first, last)
			}
			requireUnique(t, append(aIDs, ids...))
		})
	}
}

func TestWorkerEpochMismatch(t *testing.T) {
	other := time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)
	tests := []struct {
		name    string
		epoch   time.Time
		wantErr error
	}{
		{name: "same epoch", epoch: other},
		{name: "same epoch in another zone", epoch: other.In(time.FixedZone("X", 3600))},
		{name: "default epoch", wantErr: ErrEpochMismatch},
		{name: "one millisecond later", epoch: other.Add(time.Millisecond), wantErr: ErrEpochMismatch},
	}
	js := newJetStream(t)
	c := newFakeClock(t, t0)
	s := fakeSettings(t, c, "first")
	s.Epoch = other
	startWorker(t, js, s)
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := fakeSettings(t, c, "second")
			s.Epoch = tt.epoch
			_, err := tryStartWorker(t, js, s)
			if !errors.Is(err, tt.wantErr) {
				t.Fatalf("got error %v, want %v", err, tt.wantErr)
			}
			if err != nil && Unavailable(err) {
				t.Errorf("epoch mismatch must not be unavailable (it is a configuration error)")
			}
		})
	}
}

func TestWorkerAllTaken(t *testing.T) {
	js := newJetStream(t)
	c := newFakeClock(t, t0)
	// Create the bucket and its epoch the way a worker does.
	first := startWorker(t, js, fakeSettings(t, c, "first"))
	fid := workerID(t, first)
	kv := openKV(t, js)
	fillOthers(t, kv, c.Now(), fid)

	_, err := tryStartWorker(t, js, fakeSettings(t, c, "late"))
	if !errors.Is(err, ErrNoWorkerID) || !Unavailable(err) {
		t.Fatalf("all taken: got error %v, want ErrNoWorkerID (unavailable)", err)
	}
	// The first worker's key, rewritten by its heartbeats while the bucket
	// is read, may show up as a lost race instead of a live lease.
	if !strings.Contains(err.Error(), "1024 live leases") && !strings.Contains(err.Error(), "1023 live leases") {
		t.Errorf("error %q does not say how many leases are live", err)
	}

	// An unreadable value is never taken.
	bad := (fid + 1) % (MaxWorkerID + 1)
	_, rev := readLease(t, kv, bad)
	if _, err := kv.Update(context.Background(), workerKey(bad), []byte("not json"), rev); err != nil {
		t.Fatal(err)
	}
	c.Add(2*time.Hour + time.Millisecond) // every squatter is past expiry and bound plus lease
	late, err := tryStartWorker(t, js, fakeSettings(t, c, "late"))
	if err != nil {
		t.Fatalf("after the squatters expired: %v", err)
	}
	if got := workerID(t, late); got == bad || got == fid {
		t.Errorf("took worker ID %d: the unreadable one (%d) or a live one (%d)", got, bad, fid)
	}
}

func TestWorkerFencesWhenNATSUnreachable(t *testing.T) {
	srv := testenv.NATS(t)
	nc := testenv.Connect(t, srv)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	// Real clocks: the lease times out by the monotonic clock.
	w, err := StartWorker(ctx, js, WorkerSettings{Instance: "alpha", Lease: testLease, Heartbeat: testHeartbeat, Logger: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := w.Close(context.Background()); err == nil {
			t.Errorf("Close without NATS: got no error, want the failed release")
		}
	}()
	if _, err := w.AppendIDs(nil, 10); err != nil {
		t.Fatal(err)
	}
	nc.Close()
	waitFor(t, "the worker to fence itself", func() bool {
		_, err := w.AppendIDs(nil, 1)
		return errors.Is(err, ErrFenced)
	})
	st := w.Stats().(WorkerStats)
	if !st.Fenced || !st.Held || st.HeartbeatFailures == 0 {
		t.Errorf("stats: fenced %v held %v heartbeat failures %d, want true true > 0", st.Fenced, st.Held, st.HeartbeatFailures)
	}
}

// TestWorkerChurn runs workers with real clocks on the few worker IDs left
// free, crashing and restarting them, and checks every ID issued is unique.
func TestWorkerChurn(t *testing.T) {
	if testing.Short() {
		t.Skip("churn test skipped in -short mode")
	}
	js := newJetStream(t)
	first := startWorker(t, js, WorkerSettings{Instance: "w0", Lease: testLease, Heartbeat: 50 * time.Millisecond, Logger: testLogger(t)})
	free := []int{workerID(t, first), 1000, 1001}
	fillOthers(t, openKV(t, js), time.Now(), free...)

	var mu sync.Mutex
	var all []int64
	var wg sync.WaitGroup
	stop := make(chan struct{})
	run := func(w *Worker) {
		defer wg.Done()
		var local []int64
		for {
			select {
			case <-stop:
				mu.Lock()
				all = append(all, local...)
				mu.Unlock()
				return
			default:
			}
			var err error
			if local, err = w.AppendIDs(local, 100); err != nil && !Unavailable(err) {
				t.Errorf("AppendIDs: %v", err)
			}
			time.Sleep(time.Millisecond)
		}
	}
	wg.Add(1)
	go run(first)
	for round := range 6 {
		// A worker that crashes and comes back under the same name has to
		// wait for its lease to expire; meanwhile it takes another free ID
		// or fails with ErrNoWorkerID.
		name := fmt.Sprintf("w%d", round%3)
		w, err := tryStartWorker(t, js, WorkerSettings{Instance: name, Lease: testLease, Heartbeat: 50 * time.Millisecond, Logger: testLogger(t)})
		if err != nil && !errors.Is(err, ErrNoWorkerID) {
			t.Fatalf("round %d: %v", round, err)
		}
		if w != nil {
			wg.Add(1)
			go run(w)
			time.Sleep(100 * time.Millisecond)
			if round%2 == 0 {
				crash(t, w)
			}
		}
		time.Sleep(200 * time.Millisecond)
	}
	close(stop)
	wg.Wait()
	if len(all) == 0 {
		t.Fatal("no IDs issued")
	}
	requireUnique(t, all)
}

// TestWorkerAdoptsOwnWrite: a heartbeat whose reply was lost but which
// landed leaves a newer revision written by the worker itself; the worker
// must keep its lease rather than think it lost it.
func TestWorkerAdoptsOwnWrite(t *testing.T) {
	js := newJetStream(t)
	c := newFakeClock(t, t0)
	a := startWorker(t, js, fakeSettings(t, c, "alpha"))
	aid := workerID(t, a)
	kv := openKV(t, js)
	a.paused.Store(true)
	rec, rev := readLease(t, kv, aid)
	rec.Bound = rec.Bound.Add(time.Second) // as a later heartbeat of ours would
	data, _ := json.Marshal(rec)
	if _, err := kv.Update(context.Background(), workerKey(aid), data, rev); err != nil {
		t.Fatal(err)
	}
	before := a.Stats().(WorkerStats).Heartbeats
	a.paused.Store(false)
	waitFor(t, "two more heartbeats", func() bool { return a.Stats().(WorkerStats).Heartbeats >= before+2 })
	st := a.Stats().(WorkerStats)
	if st.LostLeases != 0 || st.WorkerID != aid || !st.Held {
		t.Fatalf("stats: lost %d worker %d held %v, want 0 %d true", st.LostLeases, st.WorkerID, st.Held, aid)
	}
	if !st.Bound.Equal(rec.Bound) {
		t.Errorf("bound %v, want the adopted %v (bounds never go down)", st.Bound, rec.Bound)
	}
	issue(t, a, 10)
}

// TestWorkerRenewsAfterOutage: with NATS gone the worker fences itself; when
// NATS is back and nobody took the key, it renews the same lease and issues
// again.
func TestWorkerRenewsAfterOutage(t *testing.T) {
	opts := testenv.NATSOptions(t.TempDir())
	srv := testenv.StartNATS(t, opts)
	var mu sync.Mutex
	t.Cleanup(func() {
		mu.Lock()
		defer mu.Unlock()
		srv.Shutdown()
		srv.WaitForShutdown()
	})
	nc := testenv.Connect(t, srv, nats.ReconnectWait(20*time.Millisecond), nats.MaxReconnects(-1))
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	w := startWorker(t, js, WorkerSettings{Instance: "alpha", Lease: testLease, Heartbeat: testHeartbeat, Logger: testLogger(t)})
	id := workerID(t, w)
	ids := issue(t, w, 100)

	opts.Port = srv.Addr().(*net.TCPAddr).Port
	srv.Shutdown()
	srv.WaitForShutdown()
	waitFor(t, "the worker to fence itself", func() bool {
		_, err := w.AppendIDs(nil, 1)
		return errors.Is(err, ErrFenced)
	})

	mu.Lock()
	srv = testenv.StartNATS(t, opts)
	mu.Unlock()
	waitFor(t, "the worker to renew", func() bool {
		more, err := w.AppendIDs(nil, 100)
		ids = append(ids, more...)
		return err == nil
	})
	st := w.Stats().(WorkerStats)
	if st.WorkerID != id || st.LostLeases != 0 || st.Claims != 1 || st.FencedEpisodes == 0 {
		t.Errorf("stats: worker %d lost %d claims %d fenced episodes %d, want %d 0 1 > 0",
			st.WorkerID, st.LostLeases, st.Claims, st.FencedEpisodes, id)
	}
	requireIncreasing(t, ids)
}

// service is the interface the dispenser service expects of a Worker.
type service interface {
	AppendIDs(dst []int64, n int) ([]int64, error)
	Unavailable(err error) bool
	Decode(id int64) any
	Stats() any
}

var _ service = (*Worker)(nil)

func TestWorkerDecode(t *testing.T) {
	js := newJetStream(t)
	c := newFakeClock(t, t0)
	s := fakeSettings(t, c, "alpha")
	s.Epoch = time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)
	w := startWorker(t, js, s)
	id := issue(t, w, 1)[0]
	p, ok := w.Decode(id).(Parts)
	if !ok {
		t.Fatalf("Decode returned %T, want Parts", w.Decode(id))
	}
	if !p.Time.Equal(t0) || p.Worker != int64(workerID(t, w)) {
		t.Errorf("Decode(%d) = %+v, want time %v worker %d", id, p, t0, workerID(t, w))
	}
}

// TestCloseReleasesAfterALostHeartbeatReply: a heartbeat that landed although
// the worker never learned its revision (its reply was lost, or Close
// canceled it after it was sent) must not keep Close from releasing the
// lease: the key still holds the worker's own session.
func TestCloseReleasesAfterALostHeartbeatReply(t *testing.T) {
	js := newJetStream(t)
	c := newFakeClock(t, t0)
	w := startWorker(t, js, fakeSettings(t, c, "alpha"))
	id := workerID(t, w)
	kv := openKV(t, js)
	e, err := kv.Get(context.Background(), workerKey(id))
	if err != nil {
		t.Fatal(err)
	}
	// The heartbeat that landed: the same value, a newer revision.
	if _, err := kv.Update(context.Background(), workerKey(id), e.Value(), e.Revision()); err != nil {
		t.Fatal(err)
	}
	if err := w.Close(context.Background()); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if rec, _ := readLease(t, kv, id); !rec.Released {
		t.Fatalf("after Close: lease not released: %+v", rec)
	}
}
