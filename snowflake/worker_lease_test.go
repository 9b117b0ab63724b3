package snowflake

import (
	"context"
	"encoding/json"
	"errors"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/dispenser-dev/dispenser/internal/tests/wait"
	"github.com/dispenser-dev/dispenser/testenv"
)

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
		wait.For(t, 30*time.Second, "a heartbeat after the clock moved", func() bool {
			return !a.Stats().(NodeStats).LastHeartbeat.Before(now)
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
	if st := a.Stats().(NodeStats); st.LostLeases != 0 || st.Claims != 1 {
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
	wait.For(t, 30*time.Second, "a heartbeat", func() bool { return !a.Stats().(NodeStats).LastHeartbeat.Before(c.Now()) })
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
	var b *Node
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
	wait.For(t, 30*time.Second, "the paused worker to notice the loss", func() bool {
		st := a.Stats().(NodeStats)
		return st.LostLeases == 1 && !st.Held
	})
	if _, err := a.AppendIDs(nil, 1); !errors.Is(err, ErrFenced) {
		t.Fatalf("after losing the key: got error %v, want ErrFenced", err)
	}
	free := (aid + 1) % (MaxWorkerID + 1)
	release(t, kv, free)
	wait.For(t, 30*time.Second, "a new worker ID", func() bool { id, ok := a.WorkerID(); return ok && id == free })
	all = append(all, issue(t, a, 1000)...)
	all = append(all, issue(t, b, 1000)...)
	requireUnique(t, all)
	if st := a.Stats().(NodeStats); st.Claims != 2 || st.FencedEpisodes == 0 {
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
	w, err := Start(ctx, js, NodeSettings{Instance: "alpha", Lease: testLease, Heartbeat: testHeartbeat, Settings: Settings{Logger: testLogger(t)}})
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
	wait.For(t, 30*time.Second, "the worker to fence itself", func() bool {
		_, err := w.AppendIDs(nil, 1)
		return errors.Is(err, ErrFenced)
	})
	st := w.Stats().(NodeStats)
	if !st.Fenced || !st.Held || st.HeartbeatFailures == 0 {
		t.Errorf("stats: fenced %v held %v heartbeat failures %d, want true true > 0", st.Fenced, st.Held, st.HeartbeatFailures)
	}
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
	before := a.Stats().(NodeStats).Heartbeats
	a.paused.Store(false)
	wait.For(t, 30*time.Second, "two more heartbeats", func() bool { return a.Stats().(NodeStats).Heartbeats >= before+2 })
	st := a.Stats().(NodeStats)
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
	w := startWorker(t, js, NodeSettings{Instance: "alpha", Lease: testLease, Heartbeat: testHeartbeat, Settings: Settings{Logger: testLogger(t)}})
	id := workerID(t, w)
	ids := issue(t, w, 100)

	opts.Port = srv.Addr().(*net.TCPAddr).Port
	srv.Shutdown()
	srv.WaitForShutdown()
	wait.For(t, 30*time.Second, "the worker to fence itself", func() bool {
		_, err := w.AppendIDs(nil, 1)
		return errors.Is(err, ErrFenced)
	})

	mu.Lock()
	srv = testenv.StartNATS(t, opts)
	mu.Unlock()
	wait.For(t, 30*time.Second, "the worker to renew", func() bool {
		more, err := w.AppendIDs(nil, 100)
		ids = append(ids, more...)
		return err == nil
	})
	st := w.Stats().(NodeStats)
	if st.WorkerID != id || st.LostLeases != 0 || st.Claims != 1 || st.FencedEpisodes == 0 {
		t.Errorf("stats: worker %d lost %d claims %d fenced episodes %d, want %d 0 1 > 0",
			st.WorkerID, st.LostLeases, st.Claims, st.FencedEpisodes, id)
	}
	requireIncreasing(t, ids)
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
