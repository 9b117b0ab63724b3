package snowflake

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/dispenser-dev/dispenser/testenv"
)

// TestJSLayoutConcurrentUnique: two workers of one JS-layout bucket,
// issuing from several goroutines each; every ID is collected, none twice,
// all below 2^53.
func TestJSLayoutConcurrentUnique(t *testing.T) {
	js := newJetStream(t)
	var workers []*Node
	for _, name := range []string{"js-a", "js-b"} {
		workers = append(workers, startWorker(t, js, NodeSettings{Instance: name, Settings: Settings{Layout: JSLayout, Logger: testLogger(t)}}))
	}
	const goroutines, calls = 3, 150
	var (
		mu  sync.Mutex // protects all
		all []int64
		wg  sync.WaitGroup
	)
	errs := make(chan error, goroutines*len(workers))
	for i, w := range workers {
		for g := range goroutines {
			wg.Go(func() {
				var mine []int64
				for c := range calls {
					n := 1 + (i*7+g*13+c*31)%200
					ids, err := w.AppendIDs(nil, n)
					if errors.Is(err, ErrOverloaded) {
						continue // 503: the caller tries again later
					}
					if err != nil {
						errs <- fmt.Errorf("%s: AppendIDs(%d): %w", w.Instance(), n, err)
						return
					}
					mine = append(mine, ids...)
				}
				mu.Lock()
				all = append(all, mine...)
				mu.Unlock()
			})
		}
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if len(all) < goroutines*len(workers)*calls {
		t.Fatalf("only %d IDs issued", len(all))
	}
	requireUnique(t, all)
	for _, id := range all {
		if id < 0 || id >= jsSafe {
			t.Fatalf("ID %d is not below 2^53", id)
		}
	}
	for _, w := range workers {
		id, _ := w.WorkerID()
		if id > JSLayout.MaxWorkerID() {
			t.Errorf("%s holds worker ID %d, beyond the JS layout's %d", w.Instance(), id, JSLayout.MaxWorkerID())
		}
	}
}

// TestLayoutRecordedInBucket: the first worker records its layout with the
// epoch; a worker of another layout is refused, both ways; a bucket
// without a layout (an older version's) is DefaultLayout.
func TestLayoutRecordedInBucket(t *testing.T) {
	js := newJetStream(t)
	for i, tt := range []struct {
		name string
		// first starts on a new bucket; nil: a bucket as an older
		// version writes it, without a layout.
		first   *Layout
		then    Layout
		wantErr error
	}{
		{name: "js bucket refuses default", first: &JSLayout, then: DefaultLayout, wantErr: ErrLayoutMismatch},
		{name: "js bucket refuses zero layout", first: &JSLayout, then: Layout{}, wantErr: ErrLayoutMismatch},
		{name: "default bucket refuses js", first: &DefaultLayout, then: JSLayout, wantErr: ErrLayoutMismatch},
		{name: "js bucket takes js", first: &JSLayout, then: JSLayout},
		{name: "default bucket takes default", first: &DefaultLayout, then: Layout{}},
		{name: "old bucket takes default", then: DefaultLayout},
		{name: "old bucket refuses js", then: JSLayout, wantErr: ErrLayoutMismatch},
	} {
		t.Run(tt.name, func(t *testing.T) {
			bucket := fmt.Sprintf("layout_%d", i)
			want := DefaultLayout
			if tt.first == nil {
				kv := testenv.CreateKeyValue(t, js, jetstream.KeyValueConfig{Bucket: bucket, History: 1, Storage: jetstream.FileStorage})
				data := []byte(`{"version":1,"epoch":"2026-01-01T00:00:00Z","max_lease_ms":15000}`)
				if _, err := kv.Create(context.Background(), configKey, data); err != nil {
					t.Fatal(err)
				}
			} else {
				want = *tt.first
				w := startWorker(t, js, NodeSettings{Bucket: bucket, Instance: "first", Settings: Settings{Layout: *tt.first, Logger: testLogger(t)}})
				if err := w.Close(context.Background()); err != nil {
					t.Fatal(err)
				}
				// The record names the layout's bits.
				var c configRecord
				readConfig(t, js, bucket, &c)
				if got := c.Layout.layout(); got != want {
					t.Fatalf("recorded layout: got %v, want %v", got, want)
				}
			}
			w, err := tryStartWorker(t, js, NodeSettings{Bucket: bucket, Instance: "then", Settings: Settings{Layout: tt.then, Logger: testLogger(t)}})
			if !errors.Is(err, tt.wantErr) {
				t.Fatalf("Start(%v) on a bucket of %v: got error %v, want %v", tt.then, want, err, tt.wantErr)
			}
			if err != nil {
				return
			}
			if got := w.Layout(); !got.Same(want) {
				t.Errorf("worker layout: got %v, want %v", got, want)
			}
			ids := issue(t, w, 100)
			if last := ids[len(ids)-1]; last > want.MaxID() {
				t.Errorf("ID %d beyond the bucket layout's largest %d", last, want.MaxID())
			}
		})
	}
}

// TestLayoutChangedWhileRunning: a running JS worker that must claim again
// and finds the bucket's record naming another layout refuses, with the
// reason, rather than claim.
func TestLayoutChangedWhileRunning(t *testing.T) {
	js := newJetStream(t)
	c := newFakeClock(t, t0)
	s := fakeSettings(t, c, "js")
	s.Layout, s.manual = JSLayout, true
	w := startWorker(t, js, s)
	kv := openKV(t, js)
	e, err := kv.Get(context.Background(), configKey)
	if err != nil {
		t.Fatal(err)
	}
	var rec configRecord
	if err := json.Unmarshal(e.Value(), &rec); err != nil {
		t.Fatal(err)
	}
	rec.Layout = nil // as an older version rewrites it
	data, _ := json.Marshal(rec)
	if _, err := kv.Update(context.Background(), configKey, data, e.Revision()); err != nil {
		t.Fatal(err)
	}
	if _, err := w.claim(context.Background()); !errors.Is(err, ErrLayoutMismatch) {
		t.Fatalf("claim after the layout changed: got error %v, want ErrLayoutMismatch", err)
	}
}

// TestJSLayoutWorkerIDsBounded: with the JS layout's 32 worker IDs held by
// live leases, a JS worker gets ErrNoWorkerID: it never leases worker ID 32
// or above, whose bits would run into the timestamp's.
func TestJSLayoutWorkerIDsBounded(t *testing.T) {
	js := newJetStream(t)
	first := startWorker(t, js, NodeSettings{Instance: "first", Settings: Settings{Layout: JSLayout, Logger: testLogger(t)}})
	held, _ := first.WorkerID()
	kv := openKV(t, js)
	now := time.Now().UTC()
	for id := range JSLayout.MaxWorkerID() + 1 {
		if id == held {
			continue
		}
		rec := leaseRecord{Version: recordVersion, Worker: id, Instance: "other", Session: "x", Epoch: DefaultEpoch,
			LeaseMS: time.Hour.Milliseconds(), Heartbeat: now, Expires: now.Add(time.Hour), Bound: now.Add(time.Hour)}
		data, _ := json.Marshal(rec)
		if _, err := kv.Create(context.Background(), workerKey(id), data); err != nil {
			t.Fatal(err)
		}
	}
	_, err := tryStartWorker(t, js, NodeSettings{Instance: "second", Settings: Settings{Layout: JSLayout, Logger: testLogger(t)}})
	if !errors.Is(err, ErrNoWorkerID) {
		t.Fatalf("Start with the JS layout's worker IDs all held: got error %v, want ErrNoWorkerID", err)
	}
}

// readConfig reads the bucket's config record.
func readConfig(tb testing.TB, js jetstream.JetStream, bucket string, c *configRecord) {
	tb.Helper()
	kv, err := js.KeyValue(context.Background(), bucket)
	if err != nil {
		tb.Fatal(err)
	}
	e, err := kv.Get(context.Background(), configKey)
	if err != nil {
		tb.Fatal(err)
	}
	if err := json.Unmarshal(e.Value(), c); err != nil {
		tb.Fatal(err)
	}
}
