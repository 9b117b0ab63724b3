package lease_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/dispenser-dev/dispenser/internal/kvbucket"
	"github.com/dispenser-dev/dispenser/lease"
	"github.com/dispenser-dev/dispenser/testenv"
)

var t0 = time.Date(2026, 6, 1, 12, 0, 0, 0, time.UTC)

// clock is an injected wall and monotonic clock. It is safe for concurrent
// use.
type clock struct {
	mu   sync.Mutex // protects wall and mono
	wall time.Time
	mono time.Duration
}

func (c *clock) Now() time.Time      { c.mu.Lock(); defer c.mu.Unlock(); return c.wall }
func (c *clock) Mono() time.Duration { c.mu.Lock(); defer c.mu.Unlock(); return c.mono }

// Add moves both clocks.
func (c *clock) Add(d time.Duration) { c.mu.Lock(); c.wall = c.wall.Add(d); c.mono += d; c.mu.Unlock() }

// Suspend moves the wall clock only, as a suspended machine sees on resume.
func (c *clock) Suspend(d time.Duration) { c.mu.Lock(); c.wall = c.wall.Add(d); c.mu.Unlock() }

func (c *clock) Clock() lease.Clock { return lease.Clock{Now: c.Now, Mono: c.Mono} }

// newBucket returns a fresh bucket on an embedded JetStream server.
func newBucket(tb testing.TB, js jetstream.JetStream, name string) jetstream.KeyValue {
	tb.Helper()
	return testenv.CreateKeyValue(tb, js, jetstream.KeyValueConfig{Bucket: name, History: 1})
}

func newJetStream(tb testing.TB) jetstream.JetStream {
	tb.Helper()
	js, err := jetstream.New(testenv.Connect(tb, testenv.NATS(tb)))
	if err != nil {
		tb.Fatal(err)
	}
	return js
}

func settings(tb testing.TB, c *clock, l time.Duration) lease.Settings {
	tb.Helper()
	s, err := lease.Settings{Lease: l, Clock: c.Clock()}.Check()
	if err != nil {
		tb.Fatal(err)
	}
	return s
}

func raw(b string) func(time.Time) ([]byte, error) {
	return func(time.Time) ([]byte, error) { return []byte(b), nil }
}

func TestSettings(t *testing.T) {
	got, err := lease.Settings{}.Check()
	if err != nil {
		t.Fatal(err)
	}
	if got.Lease != lease.DefaultLease || got.Heartbeat != lease.DefaultHeartbeat || got.Now == nil || got.Mono == nil {
		t.Fatalf("defaults: Lease %v, Heartbeat %v, Now set %v, Mono set %v; want %v, %v, set, set",
			got.Lease, got.Heartbeat, got.Now != nil, got.Mono != nil, lease.DefaultLease, lease.DefaultHeartbeat)
	}
	if got, err := (lease.Settings{Lease: 3 * time.Second}).Check(); err != nil || got.Heartbeat != time.Second {
		t.Fatalf("short lease: Heartbeat %v, %v; want a third of the lease, 1s", got.Heartbeat, err)
	}
	tests := []struct {
		name string
		s    lease.Settings
	}{
		{name: "lease too short", s: lease.Settings{Lease: time.Millisecond}},
		{name: "negative lease", s: lease.Settings{Lease: -time.Second}},
		{name: "lease above MaxLease", s: lease.Settings{Lease: time.Hour, MaxLease: time.Minute}},
		{name: "negative MaxLease", s: lease.Settings{MaxLease: -1}},
		{name: "heartbeat not below lease", s: lease.Settings{Lease: time.Second, Heartbeat: time.Second}},
		{name: "negative heartbeat", s: lease.Settings{Lease: time.Second, Heartbeat: -1}},
		{name: "Read without Now and Mono", s: lease.Settings{Clock: lease.Clock{Read: func() (time.Time, time.Duration) { return t0, 0 }}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if _, err := tt.s.Check(); !errors.Is(err, lease.ErrInvalidSettings) {
				t.Fatalf("Check() = %v, want ErrInvalidSettings", err)
			}
		})
	}
}

func TestClaimableAt(t *testing.T) {
	const l = 10 * time.Second
	tests := []struct {
		name  string
		terms lease.Terms
		want  time.Time
	}{
		{name: "released", terms: lease.Terms{Lease: l, Expires: t0, Released: true}, want: time.Time{}},
		{name: "a lease after expiry", terms: lease.Terms{Lease: l, Expires: t0}, want: t0.Add(l)},
		{name: "a lease after a later bound", terms: lease.Terms{Lease: l, Expires: t0, Until: t0.Add(time.Minute)}, want: t0.Add(time.Minute + l)},
		{name: "an earlier bound never before expiry", terms: lease.Terms{Lease: l, Expires: t0, Until: t0.Add(-time.Minute)}, want: t0},
		{name: "no message", terms: lease.Terms{}, want: time.Time{}},
		{name: "deleted key", terms: lease.Deleted(t0, lease.DeletedMargin(l), l), want: t0.Add(lease.DeletedKeyMargin + l)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := tt.terms.ClaimableAt(); !got.Equal(tt.want) {
				t.Fatalf("ClaimableAt() = %v, want %v", got, tt.want)
			}
		})
	}
}

func TestDeletedMargin(t *testing.T) {
	tests := []struct {
		name    string
		longest time.Duration
		want    time.Duration
	}{
		{name: "short leases", longest: time.Second, want: lease.DeletedKeyMargin},
		{name: "long lease", longest: time.Hour, want: 2 * time.Hour},
		{name: "none recorded", longest: 0, want: lease.DeletedKeyMargin},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := lease.DeletedMargin(tt.longest); got != tt.want {
				t.Fatalf("DeletedMargin(%v) = %v, want %v", tt.longest, got, tt.want)
			}
		})
	}
}

// TestDefaultClockReadsBothAtOnce checks the real clocks Check fills in:
// Read gives what Now and Mono give, from the same origin, so a fence
// extended from a Grant of Now and Mono is checked against both clocks by
// one Read.
func TestDefaultClockReadsBothAtOnce(t *testing.T) {
	s, err := lease.Settings{}.Check()
	if err != nil {
		t.Fatal(err)
	}
	if s.Read == nil {
		t.Fatal("Check left Read unset with the real clocks")
	}
	monoBefore, wallBefore := s.Mono(), s.Now()
	wall, mono := s.Read()
	monoAfter, wallAfter := s.Mono(), s.Now()
	if mono < monoBefore || mono > monoAfter {
		t.Fatalf("Read's monotonic reading %v not between Mono's %v and %v: another origin", mono, monoBefore, monoAfter)
	}
	if wall.Before(wallBefore) || wall.After(wallAfter) {
		t.Fatalf("Read's wall reading %v not between Now's %v and %v", wall, wallBefore, wallAfter)
	}
	if s, err := (lease.Settings{Clock: lease.Clock{Mono: s.Mono}}).Check(); err != nil || s.Read != nil {
		t.Fatalf("Check with a Mono of its own: Read set %v, %v; want unset (Now and Mono are read apart)", s.Read != nil, err)
	}
}

// TestFenceBothClocks checks that a lease is valid only while both clocks
// say so: a suspended machine's monotonic clock stood still, a stepped
// wall clock is caught by the monotonic one.
func TestFenceBothClocks(t *testing.T) {
	const l = 10 * time.Second
	tests := []struct {
		name  string
		after func(c *clock)
		want  bool
	}{
		{name: "within the lease", after: func(c *clock) { c.Add(l - time.Millisecond) }, want: true},
		{name: "lease over on both", after: func(c *clock) { c.Add(l) }, want: false},
		{name: "suspended past the expiry", after: func(c *clock) { c.Suspend(l) }, want: false},
		{name: "wall clock stepped back", after: func(c *clock) { c.Add(l); c.Suspend(-time.Hour) }, want: false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := &clock{wall: t0, mono: time.Hour}
			var f lease.Fence
			f.Extend(lease.Grant{Sent: c.Now(), Mono: c.Mono()}, l)
			tt.after(c)
			if got := f.Valid(c.Clock()); got != tt.want {
				t.Fatalf("Valid() = %v, want %v", got, tt.want)
			}
		})
	}
	// A Clock with Read: Valid reads both clocks from it, at once, and
	// still refuses when either one is past the lease.
	for _, tt := range tests {
		t.Run("read at once/"+tt.name, func(t *testing.T) {
			c := &clock{wall: t0, mono: time.Hour}
			var f lease.Fence
			f.Extend(lease.Grant{Sent: c.Now(), Mono: c.Mono()}, l)
			tt.after(c)
			apart := func() { t.Error("Valid read the clocks apart, with Read set") }
			both := lease.Clock{Now: func() time.Time { apart(); return c.Now() }, Mono: func() time.Duration { apart(); return c.Mono() },
				Read: func() (time.Time, time.Duration) { return c.Now(), c.Mono() }}
			if got := f.Valid(both); got != tt.want {
				t.Fatalf("Valid() = %v, want %v", got, tt.want)
			}
		})
	}
	t.Run("extend keeps the later end", func(t *testing.T) {
		c := &clock{wall: t0}
		var f lease.Fence
		f.Extend(lease.Grant{Sent: t0, Mono: 0}, l)
		f.Extend(lease.Grant{Sent: t0.Add(-time.Hour), Mono: -time.Hour}, l) // an older grant
		c.Add(l - time.Millisecond)
		if !f.Valid(c.Clock()) {
			t.Fatal("an older grant shortened the lease")
		}
	})
	t.Run("revoke", func(t *testing.T) {
		c := &clock{wall: t0}
		var f lease.Fence
		f.Extend(lease.Grant{Sent: t0}, l)
		f.Revoke()
		if f.Valid(c.Clock()) {
			t.Fatal("valid after Revoke")
		}
	})
	// After Revoke, the next Extend alone says how long the fence is
	// valid, on each clock: nothing of the revoked lease is left to keep
	// it valid longer.
	t.Run("revoke forgets the wall clock end", func(t *testing.T) {
		// Claimed again after the wall clock was stepped back an hour,
		// then suspended past the new lease: the monotonic clock stood
		// still, only the new grant's wall end catches it.
		c := &clock{wall: t0, mono: time.Hour}
		var f lease.Fence
		f.Extend(lease.Grant{Sent: c.Now(), Mono: c.Mono()}, l)
		f.Revoke()
		c.Suspend(-time.Hour)
		f.Extend(lease.Grant{Sent: c.Now(), Mono: c.Mono()}, l)
		c.Suspend(l)
		if f.Valid(c.Clock()) {
			t.Fatal("valid past the new grant's wall end: the revoked lease's wall end kept it valid")
		}
	})
	t.Run("revoke forgets the monotonic end", func(t *testing.T) {
		// A grant read before the Revoke (a renewal whose answer came
		// after the loss) extends the fence to its own ends only.
		c := &clock{wall: t0, mono: time.Hour}
		var f lease.Fence
		older := lease.Grant{Sent: c.Now(), Mono: c.Mono()}
		c.Add(l / 2)
		f.Extend(lease.Grant{Sent: c.Now(), Mono: c.Mono()}, l)
		f.Revoke()
		f.Extend(older, l)
		c.Add(l / 2)
		c.Suspend(-time.Hour) // the wall clock alone would still say valid
		if f.Valid(c.Clock()) {
			t.Fatal("valid past the older grant's monotonic end: the revoked lease's monotonic end kept it valid")
		}
	})
}

// TestClaimWritesOnlyWhenClaimable claims a real key with terms around
// their ClaimableAt: a claim before it fails with ErrNotClaimable and
// writes nothing; one after it lands.
func TestClaimWritesOnlyWhenClaimable(t *testing.T) {
	js := newJetStream(t)
	kv := newBucket(t, js, "claimable")
	ctx := context.Background()
	c := &clock{wall: t0}
	s := settings(t, c, time.Second)
	rev, err := kv.Create(ctx, "k", []byte("held"))
	if err != nil {
		t.Fatal(err)
	}
	prev := lease.Terms{Lease: time.Second, Expires: t0.Add(time.Second)}
	for _, at := range []time.Time{t0, prev.Expires, prev.ClaimableAt()} {
		c.mu.Lock()
		c.wall = at
		c.mu.Unlock()
		if _, err := s.Claim(ctx, kv, "k", rev, prev, raw("mine")); !errors.Is(err, lease.ErrNotClaimable) {
			t.Fatalf("claim at %v (claimable after %v): %v, want ErrNotClaimable", at, prev.ClaimableAt(), err)
		}
		if e, err := kv.Get(ctx, "k"); err != nil || e.Revision() != rev {
			t.Fatalf("after a refused claim the key is at %v (%v), want revision %d unchanged", e, err, rev)
		}
	}
	c.Add(time.Nanosecond)
	g, err := s.Claim(ctx, kv, "k", rev, prev, raw("mine"))
	if err != nil {
		t.Fatalf("claim after ClaimableAt: %v", err)
	}
	if g.Rev <= rev || !g.Sent.Equal(c.Now()) {
		t.Fatalf("grant %+v, want a revision above %d sent at %v", g, rev, c.Now())
	}
}

// TestOneOfConcurrentClaimsLands lets several claimants claim the same
// revision of a real key at once: exactly one write lands, and every other
// one is a conflict (kvbucket.Conflict) and changes nothing.
func TestOneOfConcurrentClaimsLands(t *testing.T) {
	js := newJetStream(t)
	kv := newBucket(t, js, "race")
	ctx := context.Background()
	c := &clock{wall: t0}
	s := settings(t, c, time.Second)
	for round, rev := range []uint64{0, 0} { // a key without any message, then the winner's record released
		if round == 1 {
			e, err := kv.Get(ctx, "k")
			if err != nil {
				t.Fatal(err)
			}
			rev = e.Revision()
		}
		const n = 8
		errs := make([]error, n)
		var wg sync.WaitGroup
		for i := range n {
			wg.Go(func() { _, errs[i] = s.Claim(ctx, kv, "k", rev, lease.Terms{Released: true}, raw("claimant")) })
		}
		wg.Wait()
		won := 0
		for i, err := range errs {
			switch {
			case err == nil:
				won++
			case !kvbucket.Conflict(err):
				t.Fatalf("round %d claimant %d: %v, want a conflict", round, i, err)
			}
		}
		if won != 1 {
			t.Fatalf("round %d: %d claims landed on revision %d, want 1", round, won, rev)
		}
	}
}

func TestStream(t *testing.T) {
	js := newJetStream(t)
	ctx := context.Background()
	tests := []struct {
		name  string
		after func(t *testing.T, bucket string)
		want  error
	}{
		{name: "unchanged", after: func(*testing.T, string) {}},
		{name: "deleted", after: func(t *testing.T, bucket string) {
			if err := js.DeleteKeyValue(ctx, bucket); err != nil {
				t.Fatal(err)
			}
		}, want: lease.ErrBucketDeleted},
		{name: "recreated", after: func(t *testing.T, bucket string) {
			if err := js.DeleteKeyValue(ctx, bucket); err != nil {
				t.Fatal(err)
			}
			newBucket(t, js, bucket)
		}, want: lease.ErrRecreated},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			kv := newBucket(t, js, "stream_"+tt.name)
			st, err := lease.NewStream(ctx, kv)
			if err != nil {
				t.Fatal(err)
			}
			tt.after(t, kv.Bucket())
			err = st.Check(ctx)
			if tt.want == nil && err != nil || tt.want != nil && !errors.Is(err, tt.want) {
				t.Fatalf("Check() = %v, want %v", err, tt.want)
			}
		})
	}
}
