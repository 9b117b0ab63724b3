package snowflake

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"
)

func TestWorkerSettingsInvalid(t *testing.T) {
	tests := []struct {
		name string
		s    NodeSettings
	}{
		{name: "negative lease", s: NodeSettings{Lease: -time.Second}},
		{name: "tiny lease", s: NodeSettings{Lease: time.Millisecond}},
		{name: "heartbeat equals lease", s: NodeSettings{Lease: time.Second, Heartbeat: time.Second}},
		{name: "negative heartbeat", s: NodeSettings{Heartbeat: -time.Second}},
		{name: "too many replicas", s: NodeSettings{Replicas: 7}},
		{name: "negative replicas", s: NodeSettings{Replicas: -1}},
		{name: "epoch not a whole millisecond", s: NodeSettings{Settings: Settings{Epoch: DefaultEpoch.Add(time.Nanosecond)}}},
		{name: "worker ID set: a node leases it", s: NodeSettings{Settings: Settings{WorkerID: 3}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			// Settings are checked before the JetStream context is used.
			_, err := Start(context.Background(), nil, tt.s)
			if !errors.Is(err, ErrInvalidSettings) {
				t.Fatalf("got error %v, want ErrInvalidSettings", err)
			}
		})
	}
}

func TestWorkerSettingsDefaults(t *testing.T) {
	s, err := NodeSettings{}.normalize()
	if err != nil {
		t.Fatal(err)
	}
	if s.Bucket != DefaultBucket || s.Replicas != 1 || s.Lease != DefaultLease || s.Heartbeat != DefaultHeartbeat ||
		!s.Epoch.Equal(DefaultEpoch) || s.Instance == "" {
		t.Errorf("defaults: got %+v", s)
	}
	s2, _ := NodeSettings{}.normalize()
	if s.Instance == s2.Instance {
		t.Errorf("default instance names repeat: %q", s.Instance)
	}
	if s, _ := (NodeSettings{Lease: 300 * time.Millisecond}).normalize(); s.Heartbeat != 100*time.Millisecond {
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
	st := w.Stats().(NodeStats)
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
	ws := make([]*Node, workers)
	var wg sync.WaitGroup
	for i := range workers {
		wg.Go(func() {
			w, err := tryStartWorker(t, js, NodeSettings{
				Instance:  fmt.Sprintf("w%02d", i),
				Lease:     5 * time.Second,
				Heartbeat: 500 * time.Millisecond,
				Settings:  Settings{Logger: testLogger(t)},
			})
			if err != nil {
				t.Errorf("Start %d: %v", i, err)
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

// TestWorkerChurn runs workers with real clocks on the few worker IDs left
// free, crashing and restarting them, and checks every ID issued is unique.
func TestWorkerChurn(t *testing.T) {
	if testing.Short() {
		t.Skip("churn test skipped in -short mode")
	}
	js := newJetStream(t)
	first := startWorker(t, js, NodeSettings{Instance: "w0", Lease: testLease, Heartbeat: 50 * time.Millisecond, Settings: Settings{Logger: testLogger(t)}})
	free := []int{workerID(t, first), 1000, 1001}
	fillOthers(t, openKV(t, js), time.Now(), free...)

	var mu sync.Mutex
	var all []int64
	var wg sync.WaitGroup
	stop := make(chan struct{})
	run := func(w *Node) {
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
		w, err := tryStartWorker(t, js, NodeSettings{Instance: name, Lease: testLease, Heartbeat: 50 * time.Millisecond, Settings: Settings{Logger: testLogger(t)}})
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
