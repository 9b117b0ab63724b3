package ownership

import (
	"context"
	"log/slog"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/dispenser-dev/dispenser/internal/kvbucket"
	"github.com/dispenser-dev/dispenser/testenv"
)

// clock is an injected wall and monotonic clock.
type clock struct {
	mu   sync.Mutex
	wall time.Time
	mono time.Duration
}

func (c *clock) Now() time.Time      { c.mu.Lock(); defer c.mu.Unlock(); return c.wall }
func (c *clock) Mono() time.Duration { c.mu.Lock(); defer c.mu.Unlock(); return c.mono }
func (c *clock) Add(d time.Duration) { c.mu.Lock(); c.wall = c.wall.Add(d); c.mono += d; c.mu.Unlock() }

// worker is one Leases with its own clock and a record of its callbacks.
type worker struct {
	*Leases
	clock    *clock
	mu       sync.Mutex
	acquired []string
	lost     []string
}

func newBucket(tb testing.TB) jetstream.KeyValue {
	tb.Helper()
	js, err := jetstream.New(testenv.Connect(tb, testenv.NATS(tb)))
	if err != nil {
		tb.Fatal(err)
	}
	kv, err := js.CreateKeyValue(context.Background(), jetstream.KeyValueConfig{Bucket: DefaultBucket, History: 1})
	if err != nil {
		tb.Fatal(err)
	}
	return kv
}

var t0 = time.Date(2026, 6, 1, 12, 0, 0, 0, time.UTC)

// newWorker starts Leases named owner on kv; heartbeats run only when the
// test calls heartbeat().
// opts change the settings before the start.
func newWorker(tb testing.TB, kv jetstream.KeyValue, owner string, skew time.Duration, opts ...func(*Settings)) *worker {
	tb.Helper()
	w := &worker{clock: &clock{wall: t0.Add(skew)}}
	st := Settings{
		Bucket: DefaultBucket, Owner: owner, Subject: "owner." + owner, Lease: 5 * time.Second, Heartbeat: time.Hour,
		Now: w.clock.Now, mono: w.clock.Mono, Logger: slog.New(slog.DiscardHandler),
		OnAcquire: func(tag string) { w.mu.Lock(); w.acquired = append(w.acquired, tag); w.mu.Unlock() },
		OnLose:    func(tag string) { w.mu.Lock(); w.lost = append(w.lost, tag); w.mu.Unlock() },
	}
	for _, o := range opts {
		o(&st)
	}
	w.Leases = start(kv, st)
	tb.Cleanup(w.Close)
	return w
}

func claim(tb testing.TB, w *worker, tag string) Route {
	tb.Helper()
	r, err := w.Claim(context.Background(), tag)
	if err != nil {
		tb.Fatalf("%s: Claim(%s): %v", w.cfg.Owner, tag, err)
	}
	return r
}

func TestClaimAndRoute(t *testing.T) {
	kv := newBucket(t)
	a, b := newWorker(t, kv, "a", 0), newWorker(t, kv, "b", 0)
	if r := claim(t, a, "orders"); !r.Self {
		t.Fatalf("a's claim of a free tag: %+v, want Self", r)
	}
	if !a.Owns("orders") || b.Owns("orders") {
		t.Fatalf("Owns: a %v, b %v; want true, false", a.Owns("orders"), b.Owns("orders"))
	}
	if r := claim(t, b, "orders"); r.Self || r.Owner != "a" || r.Subject != "owner.a" {
		t.Fatalf("b's claim of a's tag: %+v, want a route to a", r)
	}
	if r, err := b.Route(context.Background(), "orders"); err != nil || r.Subject != "owner.a" {
		t.Fatalf("b's route: %+v, %v; want owner.a", r, err)
	}
	a.mu.Lock()
	got := slices.Clone(a.acquired)
	a.mu.Unlock()
	if len(got) != 1 || got[0] != "orders" {
		t.Errorf("a's OnAcquire calls %v, want [orders]", got)
	}
}

// TestTakeoverOnlyAfterFencing: an owner that cannot renew stops serving a
// lease after its last renewal; nobody may take over before the lease
// expired plus one more lease, even with a clock ahead by almost a lease;
// then one may, and the old owner learns it lost at its next heartbeat.
func TestTakeoverOnlyAfterFencing(t *testing.T) {
	kv := newBucket(t)
	a := newWorker(t, kv, "a", 0)
	b := newWorker(t, kv, "b", 4*time.Second) // b's clock is 4s ahead
	claim(t, a, "orders")
	a.clock.Add(2 * time.Second)
	a.renew("orders") // lease now to a's t=7s
	a.clock.Add(4999 * time.Millisecond)
	if !a.Owns("orders") {
		t.Fatal("a fenced before its lease ran out")
	}
	a.clock.Add(2 * time.Millisecond) // partitioned: no renewal
	if a.Owns("orders") {
		t.Fatal("a still serves past its lease without a renewal")
	}
	// b at a's t=7.001s + 4s skew = 11.001s: expired (7s) but not past
	// expiry plus a lease (12s by b's clock).
	b.clock.Add(7001 * time.Millisecond)
	if r := claim(t, b, "orders"); r.Self {
		t.Fatal("b took over before expiry plus one lease")
	}
	b.clock.Add(time.Second)
	if r := claim(t, b, "orders"); !r.Self {
		t.Fatalf("b's claim after expiry plus a lease: %+v, want Self", r)
	}
	if got := b.Stats().Handovers; got != 1 {
		t.Errorf("handovers = %d, want 1", got)
	}
	a.renew("orders") // if the watcher has not told it already
	a.mu.Lock()
	lost := slices.Clone(a.lost)
	a.mu.Unlock()
	if a.Owns("orders") || len(lost) != 1 {
		t.Fatalf("a after b's takeover: owns %v, lost %v; want false, [orders]", a.Owns("orders"), lost)
	}
}

func TestReleaseHandsOverAtOnce(t *testing.T) {
	kv := newBucket(t)
	a, b := newWorker(t, kv, "a", 0), newWorker(t, kv, "b", 0)
	claim(t, a, "orders")
	a.Release("orders")
	if a.Owns("orders") {
		t.Fatal("a owns after Release")
	}
	if r := claim(t, b, "orders"); !r.Self {
		t.Fatalf("b after a's release: %+v, want Self", r)
	}
}

// TestTagMadePlainReleased: a held tag known to be plain now is released at
// the next heartbeat, so another worker may claim it at once; the others,
// including one Plain knows nothing about, are renewed.
func TestTagMadePlainReleased(t *testing.T) {
	kv := newBucket(t)
	var mu sync.Mutex
	plain := map[string]bool{}
	a := newWorker(t, kv, "a", 0, func(s *Settings) {
		s.Plain = func(tag string) bool { mu.Lock(); defer mu.Unlock(); return plain[tag] }
	})
	b := newWorker(t, kv, "b", 0)
	claim(t, a, "orders")
	claim(t, a, "invoices")
	a.heartbeat()
	if !a.Owns("orders") || !a.Owns("invoices") {
		t.Fatal("a lost a tag that is not known to be plain at a heartbeat")
	}
	mu.Lock()
	plain["orders"] = true // tags update orders --ordered=false
	mu.Unlock()
	a.heartbeat()
	if a.Owns("orders") || !a.Owns("invoices") {
		t.Fatalf("after the heartbeat: a owns orders %v, invoices %v; want false, true", a.Owns("orders"), a.Owns("invoices"))
	}
	a.mu.Lock()
	lost := slices.Clone(a.lost)
	a.mu.Unlock()
	if !slices.Equal(lost, []string{"orders"}) {
		t.Errorf("a's OnLose calls %v, want [orders]", lost)
	}
	if r := claim(t, b, "orders"); !r.Self {
		t.Fatalf("b's claim of the released tag: %+v, want Self", r)
	}
}

func TestCloseReleasesAll(t *testing.T) {
	kv := newBucket(t)
	a, b := newWorker(t, kv, "a", 0), newWorker(t, kv, "b", 0)
	claim(t, a, "x")
	claim(t, a, "y")
	a.Close()
	for _, tag := range []string{"x", "y"} {
		if r := claim(t, b, tag); !r.Self {
			t.Fatalf("b's claim of %s after a closed: %+v", tag, r)
		}
	}
	if _, err := a.Claim(context.Background(), "z"); err == nil {
		t.Fatal("Claim after Close succeeded")
	}
}

// TestDeletedKey: a key deleted by hand counts as a lease that expired when
// it was deleted: not claimable at once, since its owner may still serve.
func TestDeletedKey(t *testing.T) {
	kv := newBucket(t)
	a := newWorker(t, kv, "a", 0)
	claim(t, a, "orders")
	if err := kv.Delete(context.Background(), "orders"); err != nil {
		t.Fatal(err)
	}
	e, err := kvbucket.Latest(context.Background(), kv, "orders")
	if err != nil || e == nil {
		t.Fatal(err)
	}
	b := newWorker(t, kv, "b", 0)
	b.clock.mu.Lock()
	b.clock.wall = e.Created() // at the deletion, by b's clock
	b.clock.mu.Unlock()
	if r := claim(t, b, "orders"); r.Self {
		t.Fatal("b claimed a key deleted a moment ago")
	}
	b.clock.Add(5*time.Second + time.Millisecond)
	if r := claim(t, b, "orders"); !r.Self {
		t.Fatalf("b's claim a lease after the deletion: %+v, want Self", r)
	}
}
