package witness_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/dispenser-dev/dispenser/internal/kvbucket"
	"github.com/dispenser-dev/dispenser/internal/tests/testdb"
	"github.com/dispenser-dev/dispenser/segment/postgres"
	"github.com/dispenser-dev/dispenser/segment/witness"
	"github.com/dispenser-dev/dispenser/tagmodel"
	"github.com/dispenser-dev/dispenser/testenv"
)

func TestMain(m *testing.M) { os.Exit(testenv.Run(m)) }

var quiet = slog.New(slog.DiscardHandler)

// env is a migrated database with tag "t" (step 10, from 1) and a NATS
// server with JetStream.
type env struct {
	pool *pgxpool.Pool
	pg   *postgres.Store
	ns   *server.Server
	js   jetstream.JetStream
}

func newEnv(tb testing.TB) *env {
	tb.Helper()
	db := testdb.New(tb, map[string]int64{"t": 10})
	e := &env{pool: db.Pool, pg: db.Store, ns: testenv.NATS(tb)}
	var err error
	if e.js, err = jetstream.New(testenv.Connect(tb, e.ns)); err != nil {
		tb.Fatal(err)
	}
	return e
}

// open returns a witness Store over the env's database, as one worker.
func (e *env) open(tb testing.TB, s witness.Settings) *witness.Store {
	tb.Helper()
	if s.Logger == nil {
		s.Logger = quiet
	}
	w, err := witness.Open(context.Background(), e.js, e.pg, s)
	if err != nil {
		tb.Fatal(err)
	}
	return w
}

func (e *env) setMaxID(tb testing.TB, tag string, maxID int64) {
	tb.Helper()
	if _, err := e.pool.Exec(context.Background(), "UPDATE leaf_alloc SET max_id = $2 WHERE biz_tag = $1", tag, maxID); err != nil {
		tb.Fatal(err)
	}
}

func fetch(tb testing.TB, s tagmodel.Store, tag string) tagmodel.Allocation {
	tb.Helper()
	a, err := s.Fetch(context.Background(), tag, 0)
	if err != nil {
		tb.Fatalf("Fetch(%q): %v", tag, err)
	}
	return a
}

func overlaps(a, b tagmodel.Allocation) bool { return a.Start < b.End && b.Start < a.End }

// TestLostWritesAreCaught lowers max_id behind the witness's back, as a
// failover to a replica that missed the last fetches, a restored backup or
// an administrator would: without the witness the store hands out a segment
// again (the scenario can fail), with it the next segment lies above
// everything served and the rollback is counted.
func TestLostWritesAreCaught(t *testing.T) {
	tests := []struct {
		name        string
		witness     bool
		wantOverlap bool
	}{
		{"without the witness the store repeats a segment", false, true},
		{"with the witness no segment is served twice", true, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := newEnv(t)
			var store tagmodel.Store = e.pg
			type rollback struct{ mark, before int64 }
			var got []rollback
			if tt.witness {
				store = e.open(t, witness.Settings{OnRollback: func(tag string, mark, before int64) {
					got = append(got, rollback{mark, before})
				}})
			}
			var served []tagmodel.Allocation
			for range 3 {
				served = append(served, fetch(t, store, "t"))
			}
			e.setMaxID(t, "t", 11) // the database forgot the last two fetches
			next := fetch(t, store, "t")
			overlap := false
			for _, s := range served {
				overlap = overlap || overlaps(s, next)
			}
			if overlap != tt.wantOverlap {
				t.Fatalf("segment %+v after %+v: overlap %v, want %v", next, served, overlap, tt.wantOverlap)
			}
			if !tt.witness {
				return
			}
			if want := []rollback{{31, 11}}; len(got) != 1 || got[0] != want[0] {
				t.Errorf("rollbacks reported %v, want %v", got, want)
			}
			if next.Start != 31 {
				t.Errorf("next segment starts at %d, want 31 (the mark)", next.Start)
			}
			if w := store.(*witness.Store); w.Rollbacks() != 1 {
				t.Errorf("Rollbacks() = %d, want 1", w.Rollbacks())
			}
		})
	}
}

// TestGiveBackIsNotARollback: a give-back lowers the mark first, so the next
// fetch (from the lowered max_id) is no rollback; a worker that was not the
// last to fetch gives nothing back; a restore below a give-back is still
// caught.
func TestGiveBackIsNotARollback(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t)
	a, b := e.open(t, witness.Settings{}), e.open(t, witness.Settings{})
	first := fetch(t, a, "t") // 1..10
	if ok, err := a.GiveBack(ctx, "t", first.End, 4); err != nil || !ok {
		t.Fatalf("GiveBack = %v, %v; want true", ok, err)
	}
	if next := fetch(t, b, "t"); next.Start != 4 {
		t.Fatalf("after the give-back: segment %+v, want it to start at 4", next)
	}
	if a.Rollbacks()+b.Rollbacks() != 0 {
		t.Fatalf("a give-back was counted as a rollback")
	}
	// a is no longer the last to fetch: its give-back changes nothing.
	if ok, err := a.GiveBack(ctx, "t", first.End, 5); err != nil || ok {
		t.Fatalf("stale GiveBack = %v, %v; want false", ok, err)
	}
	tag, err := e.pg.Tag(ctx, "t")
	if err != nil || tag.MaxID != 14 {
		t.Fatalf("max_id = %d, %v; want 14", tag.MaxID, err)
	}
	// A backup from before everything: caught, above the mark.
	e.setMaxID(t, "t", 1)
	if next := fetch(t, a, "t"); next.Start != 14 {
		t.Fatalf("after the restore: segment %+v, want it to start at 14", next)
	}
	if got := a.Rollbacks(); got != 1 {
		t.Fatalf("Rollbacks() = %d, want 1", got)
	}
}

// TestConcurrentWorkers: many workers fetching one tag at once race between
// the database and the witness; every segment they get is unique and none
// of the races counts as a rollback.
func TestConcurrentWorkers(t *testing.T) {
	e := newEnv(t)
	const workers, each = 4, 30
	var mu sync.Mutex
	var got []tagmodel.Allocation
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	stores := make([]*witness.Store, workers)
	for i := range stores {
		stores[i] = e.open(t, witness.Settings{})
	}
	for _, s := range stores {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range each {
				a, err := s.Fetch(context.Background(), "t", 0)
				if errors.Is(err, witness.ErrConflict) {
					continue // retried by the allocator later
				}
				if err != nil {
					errs <- err
					return
				}
				mu.Lock()
				got = append(got, a)
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if len(got) < workers*each/2 {
		t.Fatalf("only %d of %d fetches succeeded", len(got), workers*each)
	}
	for i := range got {
		for j := range i {
			if overlaps(got[i], got[j]) {
				t.Fatalf("segments %+v and %+v overlap", got[i], got[j])
			}
		}
	}
	for i, s := range stores {
		if n := s.Rollbacks(); n != 0 {
			t.Errorf("worker %d counted %d rollbacks in plain races", i, n)
		}
	}
}

// TestWitnessUnreachable: with the NATS server gone, no segment is returned
// (the one the database handed out meanwhile is skipped); once the server is
// back, fetching resumes above everything served.
func TestWitnessUnreachable(t *testing.T) {
	e := newEnv(t)
	opts := testenv.NATSOptions(t.TempDir())
	ns := testenv.StartNATS(t, opts)
	t.Cleanup(func() { ns.Shutdown() })
	opts.Port = ns.Addr().(*net.TCPAddr).Port
	js, err := jetstream.New(testenv.Connect(t, ns, nats.ReconnectWait(50*time.Millisecond), nats.MaxReconnects(-1)))
	if err != nil {
		t.Fatal(err)
	}
	w, err := witness.Open(context.Background(), js, e.pg, witness.Settings{Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	before := fetch(t, w, "t")
	ns.Shutdown()
	ns.WaitForShutdown()
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	if a, err := w.Fetch(ctx, "t", 0); err == nil {
		t.Fatalf("witness down: Fetch = %+v, want an error", a)
	}
	ns = testenv.StartNATS(t, opts)
	t.Cleanup(func() { ns.Shutdown() })
	deadline := time.Now().Add(30 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		a, err := w.Fetch(ctx, "t", 0)
		cancel()
		if err == nil {
			if a.Start < before.End+10 {
				t.Fatalf("after the outage: segment %+v, want it above %d and past the skipped segment", a, before.End)
			}
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("witness back: Fetch still fails: %v", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TestDeletedMarkIsRefused: a tag whose mark was deleted is not served
// (the witness no longer knows what was), until the mark is put back.
func TestDeletedMarkIsRefused(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t)
	w := e.open(t, witness.Settings{})
	fetch(t, w, "t")
	kv, err := e.js.KeyValue(ctx, witness.DefaultBucket)
	if err != nil {
		t.Fatal(err)
	}
	if err := kv.Delete(ctx, "t"); err != nil {
		t.Fatal(err)
	}
	fresh := e.open(t, witness.Settings{}) // no cached mark
	if a, err := fresh.Fetch(ctx, "t", 0); !errors.Is(err, witness.ErrMarkDeleted) {
		t.Fatalf("Fetch = %+v, %v; want ErrMarkDeleted", a, err)
	}
	if _, err := kv.Put(ctx, "t", []byte(`{"mark":100}`)); err != nil {
		t.Fatal(err)
	}
	if a := fetch(t, fresh, "t"); a.Start < 100 {
		t.Fatalf("after the mark was put back: %+v, want it above 100", a)
	}
}

// TestOpenRefusesBucketsThatForget: a witness bucket with a TTL would forget
// marks and with them the protection.
func TestOpenRefusesBucketsThatForget(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	if _, err := e.js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "ttl_witness", TTL: time.Hour}); err != nil {
		t.Fatal(err)
	}
	if _, err := witness.Open(ctx, e.js, e.pg, witness.Settings{Bucket: "ttl_witness"}); !errors.Is(err, kvbucket.ErrTTL) {
		t.Fatalf("Open on a bucket with a TTL: %v, want kvbucket.ErrTTL", err)
	}
}

// TestLostWritesLessThanAStepAreCaught: a store that lost less than one
// segment (its refused segment reaches the mark) is reported as a rollback
// too, not taken for a race between workers.
func TestLostWritesLessThanAStepAreCaught(t *testing.T) {
	e := newEnv(t)
	w := e.open(t, witness.Settings{})
	fetch(t, w, "t")       // 1..10, mark 11
	fetch(t, w, "t")       // 11..20, mark 21
	e.setMaxID(t, "t", 16) // lost half a segment
	next := fetch(t, w, "t")
	if next.Start < 21 {
		t.Fatalf("segment %+v below the mark 21", next)
	}
	if got := w.Rollbacks(); got != 1 {
		t.Fatalf("Rollbacks() = %d, want 1", got)
	}
}

// TestUnansweredMarkWriteRetried: a fetch whose mark writes get no reply
// (a leader election of the witness bucket) keeps the segment it took from
// the store and completes once a write is answered, or finds that its
// write landed: one segment taken from the store, no rollback counted.
// Before, the fetch failed at its first unanswered write and the next one
// took a new segment.
func TestUnansweredMarkWriteRetried(t *testing.T) {
	for _, land := range []bool{false, true} {
		t.Run(fmt.Sprintf("landed=%v", land), func(t *testing.T) {
			e := newEnv(t)
			kv := testenv.CreateKeyValue(t, e.js, jetstream.KeyValueConfig{Bucket: "w"})
			lossy := &testenv.UnansweredKV{KeyValue: kv}
			w := witness.New(lossy, e.pg, witness.Settings{Logger: quiet})
			first := fetch(t, w, "t")
			lossy.Drop("", 2, land)
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			a, err := w.Fetch(ctx, "t", 0)
			if err != nil {
				t.Fatalf("Fetch with two unanswered mark writes: %v", err)
			}
			if a.Start != first.End {
				t.Errorf("segment %d..%d after %d..%d: want the next one, no segment skipped", a.Start, a.End, first.Start, first.End)
			}
			if m, _, err := w.Mark(ctx, "t"); err != nil || m != a.End {
				t.Errorf("mark = %d (%v), want %d", m, err, a.End)
			}
			if n := w.Rollbacks(); n != 0 {
				t.Errorf("rollbacks = %d, want 0", n)
			}
		})
	}
}
