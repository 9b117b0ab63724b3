package kv_test

import (
	"context"
	"errors"
	"log/slog"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/dispenser-dev/dispenser/internal/kvbucket"
	"github.com/dispenser-dev/dispenser/segment"
	"github.com/dispenser-dev/dispenser/segment/kv"
	"github.com/dispenser-dev/dispenser/tagmodel"
	"github.com/dispenser-dev/dispenser/testenv"
)

var quiet = slog.New(slog.DiscardHandler)

// logBuffer collects output for a test to read (testenv.LogBuffer).
type logBuffer = testenv.LogBuffer

// checkLogged fails the test unless the log holds every one of want.
func checkLogged(tb testing.TB, log *logBuffer, want ...string) {
	tb.Helper()
	got := log.String()
	for _, w := range want {
		if !strings.Contains(got, w) {
			tb.Errorf("log lacks %q:\n%s", w, got)
		}
	}
}

// openLogged opens a Store on srv's default bucket that logs to a buffer.
func openLogged(tb testing.TB, srv *server.Server) (*kv.Store, *logBuffer) {
	tb.Helper()
	log := &logBuffer{}
	return newStore(tb, srv, kv.Settings{Logger: log.Logger()}), log
}

func mustCreate(tb testing.TB, s *kv.Store, name string, step int64) {
	tb.Helper()
	if err := s.CreateTag(ctx, tagmodel.Tag{Name: name, Step: step, MaxID: 1}); err != nil {
		tb.Fatalf("CreateTag(%q): %v", name, err)
	}
}

func mustFetch(tb testing.TB, s *kv.Store, name string) tagmodel.Allocation {
	tb.Helper()
	a, err := s.Fetch(ctx, name, 0)
	if err != nil {
		tb.Fatalf("Fetch(%q): %v", name, err)
	}
	return a
}

// purge empties the stream behind the default bucket, as
// nats stream purge KV_dispenser_segments does.
func purge(tb testing.TB, srv *server.Server) {
	tb.Helper()
	st, err := newJS(tb, srv).Stream(ctx, "KV_"+kv.DefaultBucket)
	if err != nil {
		tb.Fatal(err)
	}
	if err := st.Purge(ctx); err != nil {
		tb.Fatalf("purge: %v", err)
	}
}

// TestPurgedBucket: a purged bucket holds no tags, so zero-setup mode
// (tags created on first use) would start every tag over at 1 and hand out
// its IDs again. The running Store, and one opened after the purge, refuse
// to create any tag, and say so. Seen failing on the code before the
// bucket's proof record: CreateTag succeeded and the allocator handed out 1.
func TestPurgedBucket(t *testing.T) {
	srv := testenv.NATS(t)
	s, log := openLogged(t, srv)
	mustCreate(t, s, "orders", 10)
	for range 3 {
		mustFetch(t, s, "orders")
	}
	purge(t, srv)

	// The running Store: the tag is gone, and nothing is created.
	if a, err := s.Fetch(ctx, "orders", 0); !errors.Is(err, kv.ErrBucketPurged) || errors.Is(err, tagmodel.ErrUnknownTag) {
		t.Errorf("Fetch after the purge = %+v, %v, want ErrBucketPurged and not ErrUnknownTag", a, err)
	}
	for _, name := range []string{"orders", "fresh"} {
		if err := s.CreateTag(ctx, tagmodel.Tag{Name: name, Step: 10, MaxID: 1}); !errors.Is(err, kv.ErrBucketPurged) {
			t.Errorf("CreateTag(%q) after the purge: %v, want ErrBucketPurged", name, err)
		}
	}
	checkLogged(t, log, "has held", "nats stream purge", kvbucket.ProofKey)

	// In zero-setup mode, through the allocator: no ID at all.
	alloc, err := segment.New(segment.Settings{Store: s, AutoCreateStep: 10, MaxWait: time.Second, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { alloc.Close(context.Background()) })
	for _, name := range []string{"orders", "fresh"} {
		if runs, err := alloc.Take(ctx, name, 1, nil); err == nil || !strings.Contains(err.Error(), "nats stream purge") {
			t.Errorf("Take(%q) after the purge = %v, %v, want the purge named in an error", name, runs, err)
		}
	}

	// A Store opened after the purge refuses the bucket at once.
	if _, err := kv.New(ctx, newJS(t, srv), kv.Settings{Logger: quiet}); !errors.Is(err, kv.ErrBucketPurged) {
		t.Errorf("New after the purge: %v, want ErrBucketPurged", err)
	}
	if b := bucket(t, srv, kv.DefaultBucket); rawValueOrDeleted(t, b, "orders") != "<deleted>" || rawValueOrDeleted(t, b, "fresh") != "<deleted>" {
		t.Error("a tag was written into the purged bucket")
	}
}

// TestTTLAddedAfterStart: a TTL (max age) or discard-old limits added to the
// bucket while the Store runs are seen at the next write, not only at
// start-up, and no segment is handed out from then on. Seen failing before
// the configuration was checked after each write: the fetch succeeded.
func TestTTLAddedAfterStart(t *testing.T) {
	tests := []struct {
		name   string
		change func(*jetstream.StreamConfig)
		want   error
	}{
		{"max age", func(c *jetstream.StreamConfig) { c.MaxAge = time.Hour }, kv.ErrBucketTTL},
		{"message limit, discard old", func(c *jetstream.StreamConfig) { c.MaxMsgs, c.Discard = 1000, jetstream.DiscardOld }, kv.ErrBucketLimits},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			srv := testenv.NATS(t)
			s, log := openLogged(t, srv)
			mustCreate(t, s, "orders", 10)
			mustFetch(t, s, "orders")
			js := newJS(t, srv)
			st, err := js.Stream(ctx, "KV_"+kv.DefaultBucket)
			if err != nil {
				t.Fatal(err)
			}
			cfg := st.CachedInfo().Config
			tt.change(&cfg)
			if _, err := js.UpdateStream(ctx, cfg); err != nil {
				t.Fatal(err)
			}
			if a, err := s.Fetch(ctx, "orders", 0); !errors.Is(err, tt.want) {
				t.Errorf("Fetch after the change = %+v, %v, want %v", a, err, tt.want)
			}
			if err := s.CreateTag(ctx, tagmodel.Tag{Name: "fresh", Step: 10, MaxID: 1}); !errors.Is(err, tt.want) {
				t.Errorf("CreateTag after the change: %v, want %v", err, tt.want)
			}
			checkLogged(t, log, "refusing to use a bucket", "nats stream edit")
		})
	}
}

// TestRecreatedBucket: the bucket is deleted and created again while a
// Store runs, and a worker started afterwards writes the same key up to the
// revision the running Store remembers, so the running Store's
// compare-and-swap succeeds against the new record. It must not return that
// segment, nor create tags in the new bucket. Seen failing before the
// stream's creation time was checked: Fetch returned a segment.
func TestRecreatedBucket(t *testing.T) {
	srv := testenv.NATS(t)
	old, log := openLogged(t, srv)
	mustCreate(t, old, "orders", 10) // revision 2, after the proof record
	mustFetch(t, old, "orders")      // revision 3, remembered
	if err := newJS(t, srv).DeleteKeyValue(ctx, kv.DefaultBucket); err != nil {
		t.Fatal(err)
	}
	// A worker started after the delete takes the new bucket for a new
	// one (it cannot know) and writes orders at revisions 2 and 3.
	fresh := newStore(t, srv, kv.Settings{Logger: quiet})
	mustCreate(t, fresh, "orders", 10)
	mustFetch(t, fresh, "orders")

	if a, err := old.Fetch(ctx, "orders", 0); !errors.Is(err, kv.ErrBucketRecreated) {
		t.Errorf("Fetch on the re-created bucket = %+v, %v, want ErrBucketRecreated", a, err)
	}
	if err := old.CreateTag(ctx, tagmodel.Tag{Name: "other", Step: 10, MaxID: 1}); !errors.Is(err, kv.ErrBucketRecreated) {
		t.Errorf("CreateTag on the re-created bucket: %v, want ErrBucketRecreated", err)
	}
	checkLogged(t, log, "was created at", "deleted the bucket")
}

// TestDeletedKeyNotCreatedAgain: a tag's key deleted or purged by hand
// (nats kv del, nats kv purge) takes the record of its IDs with it; the tag
// is not created again over the marker (zero-setup mode would start it at
// 1), with an error and one log line that say how to bring it back, and
// putting its value back by hand serves it again. Seen failing before: the
// allocator created the tag again and handed out 1.
func TestDeletedKeyNotCreatedAgain(t *testing.T) {
	tests := []struct {
		name   string
		remove func(jetstream.KeyValue) error
	}{
		{"deleted", func(b jetstream.KeyValue) error { return b.Delete(ctx, "orders") }},
		{"purged", func(b jetstream.KeyValue) error { return b.Purge(ctx, "orders") }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			srv := testenv.NATS(t)
			s, log := openLogged(t, srv)
			alloc, err := segment.New(segment.Settings{Store: s, AutoCreateStep: 10, MaxWait: time.Second, Logger: quiet})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { alloc.Close(context.Background()) })
			runs, err := alloc.Take(ctx, "orders", 5, nil)
			if err != nil || len(runs) != 1 || runs[0].First != 1 {
				t.Fatalf("first Take = %v, %v, want IDs from 1", runs, err)
			}
			b := bucket(t, srv, kv.DefaultBucket)
			if err := tt.remove(b); err != nil {
				t.Fatal(err)
			}
			// A second allocator, as another worker that asks the store.
			other, err := segment.New(segment.Settings{Store: newStore(t, srv, kv.Settings{Logger: quiet}), AutoCreateStep: 10, MaxWait: time.Second, Logger: quiet})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { other.Close(context.Background()) })
			for range 3 {
				if runs, err := other.Take(ctx, "orders", 1, nil); !errors.Is(err, tagmodel.ErrTagDeleted) {
					t.Fatalf("Take after the key was %s = %v, %v, want ErrTagDeleted", tt.name, runs, err)
				}
			}
			if err := s.CreateTag(ctx, tagmodel.Tag{Name: "orders", Step: 10, MaxID: 1}); !errors.Is(err, tagmodel.ErrTagDeleted) {
				t.Fatalf("CreateTag after the key was %s: %v, want ErrTagDeleted", tt.name, err)
			}
			checkLogged(t, log, "refusing to create a tag whose key was deleted", "nats kv put "+kv.DefaultBucket+" orders")
			if n := strings.Count(log.String(), "refusing to create"); n != 1 {
				t.Errorf("logged the deleted key %d times, want once", n)
			}
			// The operator puts the value back, above what was handed out.
			put(t, b, "orders", `{"max_id":1000,"step":10}`)
			if runs, err := other.Take(ctx, "orders", 1, nil); err != nil || runs[0].First != 1000 {
				t.Fatalf("Take after the value was put back = %v, %v, want 1000", runs, err)
			}
		})
	}
}

// TestMaxIDLoweredByHand: a value put by hand below what this Store wrote
// (nats kv put with an old max_id) is refused rather than handed out again.
// Seen failing before the Store remembered what it wrote: the fetch
// returned IDs of an earlier segment.
func TestMaxIDLoweredByHand(t *testing.T) {
	srv := testenv.NATS(t)
	s, log := openLogged(t, srv)
	mustCreate(t, s, "orders", 10)
	mustFetch(t, s, "orders")
	mustFetch(t, s, "orders") // max_id 21
	put(t, bucket(t, srv, kv.DefaultBucket), "orders", `{"max_id":11,"step":10}`)
	if a, err := s.Fetch(ctx, "orders", 0); !errors.Is(err, kv.ErrMaxIDLowered) {
		t.Fatalf("Fetch after max_id was lowered by hand = %+v, %v, want ErrMaxIDLowered", a, err)
	}
	checkLogged(t, log, "refusing a fetch below what this worker handed out", "max_id 11")
	// Put back above what was handed out, the tag is served again.
	put(t, bucket(t, srv, kv.DefaultBucket), "orders", `{"max_id":21,"step":10}`)
	if a := mustFetch(t, s, "orders"); a.Start != 21 {
		t.Errorf("Fetch after the value was put back = %+v, want it to start at 21", a)
	}
}

// TestGiveBackWithUnconfirmedWrite: a give-back whose write lands but is
// not confirmed (its reply is lost, as in a JetStream leader election) must
// not make the Store take its own lowered value for one lowered by hand
// once the bucket answers again. Seen failing while the Store vouched for
// the old max_id until the write was confirmed: the next Fetch was refused
// with ErrMaxIDLowered. (The write was made unconfirmed by a max age added
// to the bucket meanwhile until the give-back checked the bucket before
// writing.)
func TestGiveBackWithUnconfirmedWrite(t *testing.T) {
	srv := testenv.NATS(t)
	s := newStore(t, srv, kv.Settings{Logger: quiet})
	mustCreate(t, s, "orders", 10)
	a := mustFetch(t, s, "orders") // 1..10, max_id 11
	lossy := &testenv.UnansweredKV{}
	kv.WrapKeyValue(s, func(k jetstream.KeyValue) jetstream.KeyValue { lossy.KeyValue = k; return lossy })
	lossy.Drop("orders", 1, true)
	gctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	defer cancel()
	if _, err := s.GiveBack(gctx, "orders", a.End, a.Start+3); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("GiveBack with its reply lost: %v, want %v", err, context.DeadlineExceeded)
	}
	if got := rawValue(t, bucket(t, srv, kv.DefaultBucket), "orders"); !strings.Contains(got, `"max_id":4`) {
		t.Fatalf("the give-back's write did not land (value %s): the test sets nothing up", got)
	}
	b, err := s.Fetch(ctx, "orders", 0)
	if err != nil {
		t.Fatalf("Fetch after the unconfirmed give-back: %v", err)
	}
	if b.Start != a.Start+3 {
		t.Errorf("Fetch: %+v, want a segment from %d (the IDs given back)", b, a.Start+3)
	}
}

// TestRestoredBucket: the server's store restored from an older backup of
// its disk (a volume or VM snapshot; nats stream restore of a backup in
// nats-server's first snapshot format does the same) while a worker runs. The
// stream keeps the creation time it had when the backup was taken, and so
// does the proof record in it, but its revisions and max_ids are the
// backup's: the running Store's compare-and-swap on the key read again
// succeeds, and would hand out again the IDs it fetched since the backup.
// Seen failing before the Guard checked that a write's revision lies above
// every sequence it had seen: Fetch after the restore returned 11..20,
// already handed out; and, with that check but not kept after the first
// refusal, the last Fetch of orders returned 11..20 again.
func TestRestoredBucket(t *testing.T) {
	n := testenv.StartNATSServer(t)
	nc, err := nats.Connect(n.URL(), nats.MaxReconnects(-1), nats.ReconnectWait(20*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	log := &logBuffer{}
	s, err := kv.New(ctx, js, kv.Settings{Logger: log.Logger()})
	if err != nil {
		t.Fatal(err)
	}
	restart := func(between func()) {
		t.Helper()
		n.Stop()
		between()
		if err := n.Start(); err != nil {
			t.Fatal(err)
		}
		deadline := time.Now().Add(time.Minute) // bounds a hang
		for !nc.IsConnected() {
			if time.Now().After(deadline) {
				t.Fatal("the worker did not reconnect")
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	mustCreate(t, s, "orders", 10)
	mustCreate(t, s, "other", 10)
	mustFetch(t, s, "orders")
	backup := t.TempDir()
	restart(func() {
		if err := os.CopyFS(backup, os.DirFS(n.Opts.StoreDir)); err != nil {
			t.Fatal(err)
		}
	})
	var served []tagmodel.Allocation
	for range 3 {
		served = append(served, mustFetch(t, s, "orders"))
	}
	restart(func() {
		if err := os.RemoveAll(n.Opts.StoreDir); err != nil {
			t.Fatal(err)
		}
		if err := os.CopyFS(n.Opts.StoreDir, os.DirFS(backup)); err != nil {
			t.Fatal(err)
		}
	})

	// Every fetch is refused, also once the writes refused (they land)
	// have carried the stream's sequence past what the worker had seen.
	for _, tag := range []string{"orders", "other", "other", "other", "other", "orders"} {
		a, err := s.Fetch(ctx, tag, 0)
		for _, b := range served {
			if err == nil && tag == "orders" && a.Start < b.End && b.Start < a.End {
				t.Fatalf("Fetch(%q) after the restore = %+v, overlapping %+v handed out before it", tag, a, b)
			}
		}
		if !errors.Is(err, kv.ErrBucketRecreated) {
			t.Errorf("Fetch(%q) after the restore = %+v, %v, want ErrBucketRecreated", tag, a, err)
		}
	}
	checkLogged(t, log, "restored from a backup")
}

// TestGiveBackIntoRecreatedBucket: the bucket deleted and created again
// while a worker runs, its values put back by hand as the recovery says
// (docs/reliability.md), and the worker then stopped, which gives its
// segments back. The give-back is a compare-and-swap on the revision the
// worker remembers from the old stream; the new stream's key may stand at
// that very revision, and the write then lowers the max_id put back, so
// that a worker started afterwards hands out again what was handed out
// before. The give-back must write nothing into a stream other than the
// one the Store opened.
func TestGiveBackIntoRecreatedBucket(t *testing.T) {
	srv := testenv.NATS(t)
	old := newStore(t, srv, kv.Settings{Logger: quiet})
	mustCreate(t, old, "orders", 10) // revision 2, after the proof record
	a := mustFetch(t, old, "orders") // 1..10, revision 3, remembered
	if err := newJS(t, srv).DeleteKeyValue(ctx, kv.DefaultBucket); err != nil {
		t.Fatal(err)
	}
	// Recovery: the value put back above every ID handed out, and a
	// worker started on it (the proof record, then a fetch): orders
	// stands at revision 3 again.
	restored := newStore(t, srv, kv.Settings{Logger: quiet})
	put(t, bucket(t, srv, kv.DefaultBucket), "orders", `{"max_id":1000,"step":10}`)
	mustFetch(t, restored, "orders") // 1000..1009, revision 3

	if _, err := old.GiveBack(ctx, "orders", a.End, a.Start+3); !errors.Is(err, kv.ErrBucketRecreated) {
		t.Errorf("GiveBack into the re-created bucket: %v, want ErrBucketRecreated", err)
	}
	later := newStore(t, srv, kv.Settings{Logger: quiet})
	if b := mustFetch(t, later, "orders"); b.Start < 1010 {
		t.Errorf("Fetch by a worker started afterwards = %+v, want it above 1009 (the value put back, and the fetch since)", b)
	}
}
