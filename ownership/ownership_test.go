package ownership

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/dispenser-dev/dispenser/internal/kvbucket"
	"github.com/dispenser-dev/dispenser/internal/tests/wait"
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

// Jump moves the wall clock only, as a resume from suspend does (the
// monotonic clock stood still) or a clock step.
func (c *clock) Jump(d time.Duration) { c.mu.Lock(); c.wall = c.wall.Add(d); c.mu.Unlock() }

// Set sets the wall clock only.
func (c *clock) Set(t time.Time) { c.mu.Lock(); c.wall = t; c.mu.Unlock() }

// worker is one Leases with its own clock and a record of its callbacks.
type worker struct {
	*Leases
	clock    *clock
	mu       sync.Mutex
	acquired []string
	lost     []string
}

// nopServing serves nothing.
type nopServing struct{}

func (nopServing) Reset(string)      {}
func (nopServing) Plain(string) bool { return false }

// bucketConfig is the owners bucket of newBucket and newJSBucket.
var bucketConfig = jetstream.KeyValueConfig{Bucket: DefaultBucket, History: 1}

func newBucket(tb testing.TB) jetstream.KeyValue {
	tb.Helper()
	_, kv := newJSBucket(tb)
	return kv
}

// newJSBucket creates the owners bucket (bucketConfig) on a nats-server of
// its own, and returns it with its JetStream, for tests that delete and
// create it again.
func newJSBucket(tb testing.TB) (jetstream.JetStream, jetstream.KeyValue) {
	tb.Helper()
	js, err := jetstream.New(testenv.Connect(tb, testenv.NATS(tb)))
	if err != nil {
		tb.Fatal(err)
	}
	kv, err := js.CreateKeyValue(context.Background(), bucketConfig)
	if err != nil {
		tb.Fatal(err)
	}
	return js, kv
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
		hooks: hooks{
			acquired: func(tag string) { w.mu.Lock(); w.acquired = append(w.acquired, tag); w.mu.Unlock() },
			lost:     func(tag string) { w.mu.Lock(); w.lost = append(w.lost, tag); w.mu.Unlock() },
		},
	}
	for _, o := range opts {
		o(&st)
	}
	l, err := start(context.Background(), nil, kv, st)
	if err != nil {
		tb.Fatal(err)
	}
	w.Leases = l
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
		t.Errorf("a's acquired hook calls %v, want [orders]", got)
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
		s.hooks.plain = func(tag string) bool { mu.Lock(); defer mu.Unlock(); return plain[tag] }
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
		t.Errorf("a's lost hook calls %v, want [orders]", lost)
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

// TestHandOverKeepsRoutes: a worker shutting down hands its tags over at
// once and claims none, but still knows where their requests go: after
// another worker takes the tag over, the first routes to it (Close stops
// the watcher, and its routes with it).
func TestHandOverKeepsRoutes(t *testing.T) {
	kv := newBucket(t)
	a, b := newWorker(t, kv, "a", 0), newWorker(t, kv, "b", 0)
	claim(t, a, "orders")
	a.HandOver()
	if a.Owns("orders") {
		t.Fatal("a owns orders after HandOver")
	}
	if _, err := a.Claim(context.Background(), "invoices"); !errors.Is(err, ErrClosed) {
		t.Fatalf("a's Claim after HandOver: %v, want ErrClosed", err)
	}
	if r := claim(t, b, "orders"); !r.Self {
		t.Fatalf("b after a's hand-over: %+v, want Self", r)
	}
	wait.For(t, 10*time.Second, "a routes orders to b", func() bool {
		r, err := a.Route(context.Background(), "orders")
		if err != nil {
			t.Fatalf("a's Route after HandOver: %v", err)
		}
		return r.Subject == "owner.b"
	})
	if r, ok := a.Cached("orders"); !ok || r.Subject != "owner.b" {
		t.Errorf("a's Cached after HandOver: %+v, %v; want owner.b", r, ok)
	}
	a.mu.Lock()
	lost := slices.Clone(a.lost)
	a.mu.Unlock()
	if !slices.Equal(lost, []string{"orders"}) {
		t.Errorf("a's lost hook calls %v, want [orders]", lost)
	}
	a.Close() // after HandOver, as the worker does
}

// TestDeletedKey: a key deleted by hand counts as a lease that expired
// DeletedKeyMargin after it was deleted: not claimable at once, since its
// owner may still serve, nor a lease later as the old code had it.
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
	b.clock.Set(e.Created()) // at the deletion, by b's clock
	if r := claim(t, b, "orders"); r.Self {
		t.Fatal("b claimed a key deleted a moment ago")
	}
	b.clock.Add(5*time.Second + time.Millisecond)
	if r := claim(t, b, "orders"); r.Self {
		t.Fatal("b claimed a deleted key a lease after the deletion, before DeletedKeyMargin")
	}
	b.clock.Set(e.Created().Add(DeletedKeyMargin + 5*time.Second + time.Millisecond))
	if r := claim(t, b, "orders"); !r.Self {
		t.Fatalf("b's claim the margin plus a lease after the deletion: %+v, want Self", r)
	}
}

// TestAcquireBeforeVisible: the Serving's Reset on acquiring runs before
// the lease is visible to Owns and Cached, and on losing after it is gone.
// The old code published the lease first.
func TestAcquireBeforeVisible(t *testing.T) {
	kv := newBucket(t)
	var w *worker
	var during []string
	w = newWorker(t, kv, "a", 0, func(s *Settings) {
		s.hooks.acquired = func(tag string) {
			if w.Owns(tag) {
				during = append(during, "acquire: Owns true")
			}
			if r, _ := w.Cached(tag); r.Self {
				during = append(during, "acquire: Cached Self")
			}
		}
		s.hooks.lost = func(tag string) {
			if w.Owns(tag) {
				during = append(during, "lose: Owns true")
			}
		}
	})
	claim(t, w, "orders")
	if !w.Owns("orders") {
		t.Fatal("no ownership after the claim")
	}
	w.Release("orders")
	if len(during) != 0 {
		t.Fatalf("ownership visible while the buffers were reset: %v", during)
	}
}

// TestClaimUnderway: while a claim's write has landed but its lease is not
// in place (the Reset on acquiring runs), ClaimUnderway gives a channel;
// it is closed only once Owns holds, and afterwards, and for a claim that
// does not win, there is none. Package dispenser's forwarded and direct
// requests wait on it (dispenser.TestRequestDuringClaimWaitsForIt).
func TestClaimUnderway(t *testing.T) {
	kv := newBucket(t)
	var a *worker
	var underway <-chan struct{}
	var ownedDuring bool
	a = newWorker(t, kv, "a", 0, func(s *Settings) {
		s.hooks.acquired = func(tag string) {
			underway = a.ClaimUnderway(tag)
			ownedDuring = a.Owns(tag)
		}
	})
	b := newWorker(t, kv, "b", 0)
	if ch := a.ClaimUnderway("orders"); ch != nil {
		t.Fatal("a claim under way before any claim")
	}
	if r := claim(t, a, "orders"); !r.Self {
		t.Fatalf("a's claim of a free tag: %+v, want Self", r)
	}
	switch {
	case underway == nil:
		t.Fatal("no claim under way while the claim's Reset ran")
	case ownedDuring:
		t.Fatal("Owns held while the claim's Reset ran")
	}
	select {
	case <-underway:
	default:
		t.Fatal("the claim ended, its channel is still open")
	}
	if !a.Owns("orders") {
		t.Fatal("no ownership after the claim")
	}
	if ch := a.ClaimUnderway("orders"); ch != nil {
		t.Fatal("a claim under way after the claim ended")
	}
	if r := claim(t, b, "orders"); r.Self || r.Owner != "a" {
		t.Fatalf("b's claim of a's tag: %+v, want a's route", r)
	}
	if ch := b.ClaimUnderway("orders"); ch != nil {
		t.Fatal("b: a claim under way after its claim ended")
	}
}

// TestDeletedKeyMarginCoversLongestLease is issue 21's point 3: two
// workers with different leases. a holds a 50 s lease, its key is deleted
// by hand; b, with a 5 s lease, must not claim before twice a's lease
// (recorded in the bucket) has passed since the delete; the old code let
// it claim 5 s after it. a, seeing the delete, stops at once.
func TestDeletedKeyMarginCoversLongestLease(t *testing.T) {
	kv := newBucket(t)
	a := newWorker(t, kv, "a", 0, func(s *Settings) { s.Lease = 50 * time.Second })
	b := newWorker(t, kv, "b", 0)
	claim(t, a, "orders")
	if err := kv.Delete(context.Background(), "orders"); err != nil {
		t.Fatal(err)
	}
	e, err := kvbucket.Latest(context.Background(), kv, "orders")
	if err != nil || e == nil || e.Operation() != jetstream.KeyValueDelete {
		t.Fatalf("latest after delete: %v, %v", e, err)
	}
	wait.For(t, 10*time.Second, "a stops serving the deleted key", func() bool { return !a.Owns("orders") })
	for _, after := range []time.Duration{6 * time.Second, DeletedKeyMargin + 6*time.Second, 100*time.Second + 5*time.Second} {
		b.clock.Set(e.Created().Add(after))
		if r := claim(t, b, "orders"); r.Self {
			t.Fatalf("b claimed the key %v after its deletion, within twice a's 50s lease plus b's lease", after)
		}
	}
	b.clock.Set(e.Created().Add(105*time.Second + time.Millisecond))
	if r := claim(t, b, "orders"); !r.Self {
		t.Fatalf("b's claim twice a's lease plus its own after the deletion: %+v, want Self", r)
	}
}

// TestDeletedKeyHolderStops: a holder stops at once when it sees its key
// deleted or purged, by the watcher or at its heartbeat.
func TestDeletedKeyHolderStops(t *testing.T) {
	for _, tt := range []struct {
		name   string
		remove func(jetstream.KeyValue) error
	}{
		{"delete", func(kv jetstream.KeyValue) error { return kv.Delete(context.Background(), "orders") }},
		{"purge", func(kv jetstream.KeyValue) error { return kv.Purge(context.Background(), "orders") }},
	} {
		t.Run(tt.name, func(t *testing.T) {
			kv := newBucket(t)
			a := newWorker(t, kv, "a", 0)
			claim(t, a, "orders")
			if err := tt.remove(kv); err != nil {
				t.Fatal(err)
			}
			wait.For(t, 10*time.Second, "a stops serving", func() bool { return !a.Owns("orders") })
			a.mu.Lock()
			lost := slices.Clone(a.lost)
			a.mu.Unlock()
			if !slices.Equal(lost, []string{"orders"}) {
				t.Fatalf("lost hook calls %v, want [orders]", lost)
			}
		})
	}
}

// TestSuspendedOwnerStops is issue 21's point 10: after a suspend the
// monotonic clock has not moved but the wall clock has, past the lease's
// expiry; the owner must stop. The old code, checking the monotonic clock
// only, went on serving.
func TestSuspendedOwnerStops(t *testing.T) {
	kv := newBucket(t)
	a := newWorker(t, kv, "a", 0)
	claim(t, a, "orders")
	a.clock.Jump(4 * time.Second)
	if !a.Owns("orders") {
		t.Fatal("a stopped within its lease")
	}
	a.clock.Jump(time.Second) // resumed a lease after its last heartbeat
	if a.Owns("orders") {
		t.Fatal("a serves past its record's expiry by the wall clock (monotonic clock stopped while suspended)")
	}
	a.renew("orders") // nobody took over: the renewal succeeds
	if !a.Owns("orders") {
		t.Fatal("a does not serve after renewing its untouched lease")
	}
}

// TestClaimStorm is issue 21's point 11: many requests for a tag whose
// owner died, each retrying Claim as routeOrdered does, read the key a
// bounded number of times; the old code read it (a new consumer each time)
// once per call.
func TestClaimStorm(t *testing.T) {
	kv := newBucket(t)
	a := newWorker(t, kv, "a", 0)
	b := newWorker(t, kv, "b", 0)
	claim(t, a, "orders") // a dies: no heartbeat, no release
	b.clock.Add(5*time.Second + time.Millisecond)
	before := b.Stats().Lookups
	const requests, retries = 100, 20
	var wg sync.WaitGroup
	errs := make(chan error, requests)
	for range requests {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range retries {
				if r, err := b.Claim(context.Background(), "orders"); err != nil || r.Self {
					errs <- fmt.Errorf("claim before the lease is claimable: %+v, %v", r, err)
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if n := b.Stats().Lookups - before; n > 5 {
		t.Fatalf("%d claims read the bucket %d times, want a handful", requests*retries, n)
	}
	b.clock.Add(5 * time.Second)
	if r := claim(t, b, "orders"); !r.Self {
		t.Fatalf("claim once claimable: %+v, want Self", r)
	}
}

// TestLateWatcherEvent is issue 21's point 12: a watcher event older than
// the holder's own write (the previous owner's, delivered late) must not
// make it lose its fresh lease, and an older read must not replace a newer
// cached value.
func TestLateWatcherEvent(t *testing.T) {
	kv := newBucket(t)
	a := newWorker(t, kv, "a", 0)
	b := newWorker(t, kv, "b", 0)
	claim(t, b, "orders")
	old, err := kv.Get(context.Background(), "orders")
	if err != nil {
		t.Fatal(err)
	}
	b.Release("orders")
	claim(t, a, "orders")
	a.observe(old) // b's claim, delivered late
	if !a.Owns("orders") {
		t.Fatal("a lost its lease to an event older than its claim")
	}
	// c caches a's claim, then reads b's old one late.
	c := newWorker(t, kv, "c", 0)
	if r, err := c.Route(context.Background(), "orders"); err != nil || r.Owner != "a" {
		t.Fatalf("c's route: %+v, %v; want a", r, err)
	}
	c.observe(old)
	if r, ok := c.Cached("orders"); !ok || r.Owner != "a" {
		t.Fatalf("c's cached route after a late older value: %+v, %v; want a", r, ok)
	}
}

// TestBucketRecreated is issue 21's point 14: the bucket is deleted and
// created again while a holds a lease; b claims the tag in the new stream
// at the revision a holds. a must not renew it (the old code's
// compare-and-swap matched b's record) and must stop serving.
func TestBucketRecreated(t *testing.T) {
	js, kv := newJSBucket(t)
	ctx, cfg := context.Background(), bucketConfig
	a := newWorker(t, kv, "a", 0)
	claim(t, a, "orders")
	a.mu.Lock()
	rev := a.owned["orders"].rev
	a.mu.Unlock()
	if err := js.DeleteKeyValue(ctx, DefaultBucket); err != nil {
		t.Fatal(err)
	}
	kv2 := testenv.CreateKeyValue(t, js, cfg)
	// Fill the new stream up to a's revision, as other keys would.
	for i := uint64(1); i+1 < rev; i++ {
		if _, err := kv2.Put(ctx, fmt.Sprintf("filler%d", i), []byte("{}")); err != nil {
			t.Fatal(err)
		}
	}
	b := newWorker(t, kv2, "b", 0)
	claim(t, b, "orders")
	e, err := kv2.Get(ctx, "orders")
	if err != nil || e.Revision() > rev+1 {
		t.Fatalf("b's record at revision %v (%v), want at most a's %d plus the longest-lease record", e, err, rev)
	}
	a.heartbeat()
	if a.Owns("orders") {
		t.Fatal("a still serves after its bucket was recreated")
	}
	if r := claim(t, b, "orders"); !r.Self {
		t.Fatalf("b lost the tag: %+v", r)
	}
	got, err := kv2.Get(ctx, "orders")
	if err != nil || got.Revision() != e.Revision() {
		t.Fatalf("b's record was overwritten: now revision %v (%v), b wrote %d", got, err, e.Revision())
	}
	if _, err := a.Claim(ctx, "other"); !errors.Is(err, ErrBucketRecreated) {
		t.Fatalf("a's claim on the recreated bucket: %v, want ErrBucketRecreated", err)
	}
}

// TestPurgedBucketWaitsAMargin: `nats stream purge` of the owners bucket
// leaves no marker under a held key; a claimant must still wait as for a
// deleted key (from when the loss was found), not take the tag at once
// while its owner serves until its next heartbeat. A brand-new bucket's
// tags stay claimable at once. Seen failing before the loss was recorded:
// b took the tag right after the purge.
func TestPurgedBucketWaitsAMargin(t *testing.T) {
	ctx := context.Background()
	js, err := jetstream.New(testenv.Connect(t, testenv.NATS(t)))
	if err != nil {
		t.Fatal(err)
	}
	kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: DefaultBucket, History: 1})
	if err != nil {
		t.Fatal(err)
	}
	a, b := newWorker(t, kv, "a", 0), newWorker(t, kv, "b", 0)
	if r := claim(t, a, "orders"); !r.Self {
		t.Fatalf("a's claim in a new bucket: %+v, want Self at once", r)
	}
	st, err := js.Stream(ctx, "KV_"+DefaultBucket)
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Purge(ctx); err != nil {
		t.Fatal(err)
	}
	found := b.clock.Now()
	for _, after := range []time.Duration{0, DeletedKeyMargin, 2 * MaxLease} {
		b.clock.Set(found.Add(after))
		if r := claim(t, b, "orders"); r.Self {
			t.Fatalf("b claimed the tag %v after the purge, while a may still serve it", after)
		}
	}
	b.clock.Set(found.Add(2*MaxLease + 5*time.Second + time.Millisecond))
	if r := claim(t, b, "orders"); !r.Self {
		t.Fatalf("b's claim a margin and a lease after the purge: %+v, want Self", r)
	}
}

// TestHeartbeatWritesNoCoveredRecord: a heartbeat round whose lease the
// record of the longest lease already covers reads it and writes nothing,
// so that workers do not rewrite one shared key every round (each write
// reaches every worker's watcher, and three conflicts in a row would renew
// no lease). Seen failing while every round wrote it.
func TestHeartbeatWritesNoCoveredRecord(t *testing.T) {
	kv := newBucket(t)
	a := newWorker(t, kv, "a", 0)
	claim(t, a, "orders")
	before, err := kv.Get(context.Background(), LeasesKey)
	if err != nil {
		t.Fatal(err)
	}
	a.heartbeat()
	after, err := kv.Get(context.Background(), LeasesKey)
	if err != nil {
		t.Fatal(err)
	}
	if after.Revision() != before.Revision() {
		t.Errorf("%s rewritten by a heartbeat (revision %d, then %d)", LeasesKey, before.Revision(), after.Revision())
	}
	if !a.Owns("orders") {
		t.Error("a stopped owning orders after the heartbeat")
	}
}

// TestLandedRenewalAdopted: a renewal whose answer was lost (it timed out)
// but which landed leaves the key one revision past what the owner knows,
// holding the owner's own record. The next renewal's compare-and-swap
// conflicts; the owner must recognise its session and adopt the revision,
// not drop the tag as lost, and the adoption must not extend its fence.
// The old code dropped the tag on any conflict.
func TestLandedRenewalAdopted(t *testing.T) {
	kv := newBucket(t)
	a := newWorker(t, kv, "a", 0)
	claim(t, a, "orders")
	rev, _ := heldRev(a.Leases, "orders")
	// The landed write, a second after the claim.
	a.clock.Add(time.Second)
	data, err := json.Marshal(a.newRecord(a.clock.Now()))
	if err != nil {
		t.Fatal(err)
	}
	landed, err := kv.Update(context.Background(), "orders", data, rev)
	if err != nil {
		t.Fatal(err)
	}
	if retry := a.renew("orders"); !retry {
		t.Error("renew after a conflict with its own write: retry = false, want true")
	}
	if got, _ := heldRev(a.Leases, "orders"); got != landed {
		t.Errorf("held revision %d after the conflict, want the landed write's %d", got, landed)
	}
	if !a.Owns("orders") || a.Stats().Losses != 0 {
		t.Fatalf("a after its own landed write: owns %v, losses %d; want true, 0", a.Owns("orders"), a.Stats().Losses)
	}
	// Not extended by the adoption: the claim's lease (5 s) still ends it.
	a.clock.Add(4001 * time.Millisecond)
	if a.Owns("orders") {
		t.Error("a's fence extended by adopting a write whose send time it does not know")
	}
	if retry := a.renew("orders"); retry {
		t.Error("renew on the adopted revision: retry = true, want false")
	}
	if !a.Owns("orders") {
		t.Error("a does not own orders after renewing on the adopted revision")
	}
}

// TestUnansweredClaimRetried: a claim whose compare-and-swap gets no reply
// (a leader election) is tried again after an attempt, and wins: the
// write was dropped, or it landed and the key holds this worker's own
// record, which it takes back at once. Before, the claim waited a whole
// lease (5 s here) for the reply and failed.
func TestUnansweredClaimRetried(t *testing.T) {
	for _, land := range []bool{false, true} {
		t.Run(fmt.Sprintf("landed=%v", land), func(t *testing.T) {
			lossy := &testenv.UnansweredKV{KeyValue: newBucket(t)}
			lossy.Drop("orders", 1, land)
			a := newWorker(t, lossy, "a", 0)
			r, err := a.Claim(context.Background(), "orders")
			if err != nil || !r.Self {
				t.Fatalf("Claim with an unanswered compare-and-swap: %+v, %v; want this worker the owner", r, err)
			}
			if !a.Owns("orders") {
				t.Fatal("a does not own orders after its claim")
			}
		})
	}
}

// TestClaimReadsAStaleCache: a worker whose watcher missed a takeover (a
// watcher the server lost in a restart comes back seconds later, without
// what happened meanwhile) finds the new owner when it asks Claim, instead
// of waiting on its cache until the request's time runs out. (With Claim
// trusting a settled cache, it answers "no owner, wait" until the cache
// changes: the chaos test's ordered requests timed out after a nats-server
// restart and a takeover, seed 1795683191234249145.)
func TestClaimReadsAStaleCache(t *testing.T) {
	kv := newBucket(t)
	a := newWorker(t, kv, "a", 0)
	b := newWorker(t, kv, "b", 0)
	c := newWorker(t, kv, "c", 0)
	claim(t, a, "orders") // a dies: no heartbeat, no release
	wait.For(t, 10*time.Second, "b sees a's lease", func() bool { r, ok := b.Cached("orders"); return ok && r.Owner == "a" })
	b.mu.Lock()
	stale := b.routes["orders"]
	b.mu.Unlock()
	c.clock.Add(10*time.Second + time.Millisecond) // a's lease claimable for c
	if r := claim(t, c, "orders"); !r.Self {
		t.Fatalf("c's claim once claimable: %+v, want Self", r)
	}
	// By b's clock a's lease has expired but is not claimable yet: b's
	// cache says "settled, wait". Its watcher saw c's takeover; undo that,
	// as a watcher lost in a restart would have missed it.
	b.clock.Add(6 * time.Second)
	wait.For(t, 10*time.Second, "b's watcher sees c's takeover", func() bool { r, ok := b.Cached("orders"); return ok && r.Owner == "c" })
	b.mu.Lock()
	b.routes["orders"] = stale
	b.mu.Unlock()
	if r := claim(t, b, "orders"); r.Owner != "c" {
		t.Fatalf("b's Claim with a stale cache = %+v, want the route to c", r)
	}
}

// TestReleaseAfterALandedRenewal: a renewal whose answer was given up (a
// heartbeat round cancelled by Close) may still land, moving the key past
// the revision the owner knows. The release must still hand the tag over
// at once: seen failing before the release adopted its own newer record
// ("ownership: release failed; ... key revision mismatch" in a rolling
// upgrade, the tag then without an owner for two leases): b's claim right
// after a's Close found a live lease.
func TestReleaseAfterALandedRenewal(t *testing.T) {
	kv := newBucket(t)
	a, b := newWorker(t, kv, "a", 0), newWorker(t, kv, "b", 0)
	claim(t, a, "orders")
	// The renewal that landed unanswered: a's own record, written again.
	e, err := kv.Get(context.Background(), "orders")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := kv.Update(context.Background(), "orders", e.Value(), e.Revision()); err != nil {
		t.Fatal(err)
	}
	a.Close()
	if r := claim(t, b, "orders"); !r.Self {
		t.Fatalf("b's claim right after a closed: %+v, want Self (a's release must land)", r)
	}
}

// TestCachedTrustsTheHoldingUntilACheckFails: Cached says Self for a held
// lease without reading a clock until a check (Owns) finds the lease run
// out; from then on it reads the clocks, until a renewal extends the lease.
// What is served rests on Owns, which package dispenser checks after
// taking: Cached may say Self a moment after the lease ran out.
func TestCachedTrustsTheHoldingUntilACheckFails(t *testing.T) {
	kv := newBucket(t)
	var reads atomic.Int64
	a := newWorker(t, kv, "a", 0, func(s *Settings) {
		now, mono := s.Now, s.mono
		s.Now = func() time.Time { reads.Add(1); return now() }
		s.mono = func() time.Duration { reads.Add(1); return mono() }
	})
	claim(t, a, "orders")
	cached := func(when string, wantSelf bool, wantReads int64) {
		t.Helper()
		reads.Store(0)
		r, _ := a.Cached("orders")
		if got := reads.Load(); r.Self != wantSelf || got != wantReads {
			t.Fatalf("%s: Cached Self %v after %d clock reads; want Self %v after %d", when, r.Self, got, wantSelf, wantReads)
		}
	}
	cached("held", true, 0)
	a.clock.Add(6 * time.Second) // past the 5 s lease, not renewed
	cached("run out, not checked yet", true, 0)
	if a.Owns("orders") {
		t.Fatal("Owns past the lease")
	}
	cached("after Owns found the lease run out", false, 2)
	a.renew("orders")
	if !a.Owns("orders") {
		t.Fatal("not Owns after a renewal")
	}
	cached("renewed", true, 0)
}

// TestKeyChangedDuringClaim: the claim's write landed, and before its
// lease is in place (the Serving's Reset runs) the key changes: here it is
// deleted by hand, which the watcher reports while the lease is not yet
// this worker's to drop. The claim must not put the lease in place: Owns
// stays false and the lost hook runs, as it would for a key deleted a
// moment later (TestDeletedKeyHolderStops).
func TestKeyChangedDuringClaim(t *testing.T) {
	kv := newBucket(t)
	var a *worker
	var deleted atomic.Bool
	a = newWorker(t, kv, "a", 0, func(s *Settings) {
		s.hooks.acquired = func(tag string) {
			if deleted.Swap(true) {
				return
			}
			// The claim's own write, read from the bucket: the watcher
			// may not have reported it yet, and a revision past it can
			// only be the delete's.
			e, err := kv.Get(context.Background(), tag)
			if err != nil {
				t.Error(err)
				return
			}
			mine := e.Revision()
			if err := kv.Delete(context.Background(), tag); err != nil {
				t.Error(err)
				return
			}
			// Not wait.For: the claim runs on a goroutine of its own.
			for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
				a.Leases.mu.Lock()
				seen := a.routes[tag].rev > mine
				a.Leases.mu.Unlock()
				if seen {
					return
				}
				if time.Now().After(deadline) {
					t.Error("the watcher did not report the delete within 10s")
					return
				}
			}
		}
	})
	if r := claim(t, a, "orders"); r.Self {
		t.Fatalf("the claim of a key deleted before its lease was in place: %+v, want not Self", r)
	}
	if a.Owns("orders") {
		t.Fatal("a owns a tag whose key was deleted after its claim's write, before its lease was in place")
	}
	a.mu.Lock()
	lost := slices.Clone(a.lost)
	a.mu.Unlock()
	if !slices.Equal(lost, []string{"orders"}) {
		t.Fatalf("lost hook calls %v, want [orders]", lost)
	}
}

// TestTakenOverHolderStops: another worker's record under a key this
// worker holds (a claimant whose wall clock ran far ahead took it over)
// makes this worker stop serving at once, by the watcher, while its own
// clocks still say its lease is valid.
func TestTakenOverHolderStops(t *testing.T) {
	kv := newBucket(t)
	a := newWorker(t, kv, "a", 0)
	b := newWorker(t, kv, "b", time.Hour) // b's wall clock an hour ahead
	if r := claim(t, a, "orders"); !r.Self {
		t.Fatalf("a's claim of a free tag: %+v, want Self", r)
	}
	if r := claim(t, b, "orders"); !r.Self {
		t.Fatalf("b's claim an hour later by its clock: %+v, want Self", r)
	}
	// Wait for the lost hook itself: lose revokes the fence (Owns turns
	// false) before it calls the hook.
	lost := func() []string {
		a.mu.Lock()
		defer a.mu.Unlock()
		return slices.Clone(a.lost)
	}
	wait.For(t, 10*time.Second, "a stops serving the tag b took over", func() bool { return len(lost()) > 0 })
	if got := lost(); !slices.Equal(got, []string{"orders"}) {
		t.Fatalf("lost hook calls %v, want [orders]", got)
	}
	if a.Owns("orders") {
		t.Fatal("a still owns the tag b took over after losing it")
	}
}

// TestHandOverDuringClaim: HandOver (or Close) runs while a claim's Reset
// runs, after the claim's write landed and before its lease is in place,
// so it finds no lease to release. The claim must release it itself: it
// fails with ErrClosed, Owns stays false, and another worker takes the tag
// over at once rather than a lease and more later.
func TestHandOverDuringClaim(t *testing.T) {
	for _, tt := range []struct {
		name string
		stop func(*worker)
	}{
		{"hand-over", func(w *worker) { w.HandOver() }},
		{"close", func(w *worker) { w.Close() }},
	} {
		t.Run(tt.name, func(t *testing.T) {
			kv := newBucket(t)
			var a *worker
			var once sync.Once
			a = newWorker(t, kv, "a", 0, func(s *Settings) {
				s.hooks.acquired = func(string) { once.Do(func() { tt.stop(a) }) }
			})
			b := newWorker(t, kv, "b", 0)
			if r, err := a.Claim(context.Background(), "orders"); !errors.Is(err, ErrClosed) {
				t.Fatalf("a's claim, stopped during its Reset: %+v, %v; want ErrClosed", r, err)
			}
			if a.Owns("orders") {
				t.Fatal("a owns the tag it claimed while it stopped")
			}
			if r := claim(t, b, "orders"); !r.Self {
				t.Fatalf("b's claim after a stopped: %+v, want Self at once (a's claim released)", r)
			}
		})
	}
}

// TestReleaseIntoRecreatedBucket: the bucket is deleted and created again
// while a holds a lease, b claims the tag in the new stream at the very
// revision a holds, and a then hands its tags over (a worker's stop)
// before any heartbeat of its found the bucket recreated. a's release is
// a compare-and-swap on that revision: it must not land on b's record,
// which would mark b's lease released, claimable at once while b serves.
func TestReleaseIntoRecreatedBucket(t *testing.T) {
	js, kv := newJSBucket(t)
	ctx, cfg := context.Background(), bucketConfig
	a := newWorker(t, kv, "a", 0)
	claim(t, a, "orders")
	rev, _ := heldRev(a.Leases, "orders")
	if err := js.DeleteKeyValue(ctx, DefaultBucket); err != nil {
		t.Fatal(err)
	}
	kv2 := testenv.CreateKeyValue(t, js, cfg)
	b := newWorker(t, kv2, "b", 0)
	// Fill the new stream, as other keys would, so that b's claim (the
	// longest-lease record, then the tag's) lands at a's revision.
	for {
		st, err := kv2.Status(ctx)
		if err != nil {
			t.Fatal(err)
		}
		last := st.(*jetstream.KeyValueBucketStatus).StreamInfo().State.LastSeq
		if last+2 >= rev {
			break
		}
		if _, err := kv2.Put(ctx, fmt.Sprintf("filler%d", last), []byte("{}")); err != nil {
			t.Fatal(err)
		}
	}
	claim(t, b, "orders")
	e, err := kv2.Get(ctx, "orders")
	if err != nil || e.Revision() != rev {
		t.Fatalf("b's record at revision %v (%v), want a's %d: the test sets nothing up", e.Revision(), err, rev)
	}
	a.HandOver()
	got, err := kv2.Get(ctx, "orders")
	if err != nil || got.Revision() != e.Revision() {
		t.Fatalf("b's record was overwritten by a's release: now %q at revision %v (%v), b wrote revision %d",
			got.Value(), got.Revision(), err, e.Revision())
	}
}
