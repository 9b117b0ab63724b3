package lease

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/dispenser-dev/dispenser/internal/kvbucket"
)

// Defaults and limits.
const (
	// DefaultLease and DefaultHeartbeat are Settings' defaults (the
	// heartbeat is Lease/3 where that is shorter), sized from JetStream
	// leader elections: a holder on the majority side of a partition that
	// cut off its bucket's stream leader renews once the majority has
	// elected a new one, 5-9 s later as measured on a 3-node cluster on a
	// busy 2-core machine (nats-server's raft election timeout is 4-9 s).
	// A lease rides out an election shorter than Lease - Heartbeat -
	// MaxAttempt - MaxAttempt/4, 11.75 s with these defaults. The cost:
	// after a holder crashes, what it held waits about two leases
	// (ClaimableAt) before another takes it over; a graceful release
	// frees it at once.
	DefaultLease     = 15 * time.Second
	DefaultHeartbeat = 2 * time.Second
	// MinLease is the shortest lease accepted.
	MinLease = 10 * time.Millisecond
	// DeletedKeyMargin is the least time between a key's delete or purge
	// marker and the end of its last holder's lease as a claimant counts
	// it (DeletedMargin).
	DeletedKeyMargin = time.Minute
)

// Errors of this package; test with errors.Is.
var (
	// ErrInvalidSettings means a Settings field is out of range.
	ErrInvalidSettings = errors.New("lease: invalid settings")
	// ErrNotClaimable means a claim came before the record's ClaimableAt
	// by the claimant's wall clock; nothing was written.
	ErrNotClaimable = errors.New("lease: not claimable yet")
	// ErrRecreated means the bucket's stream is not the one NewStream
	// found: it was deleted and created again.
	ErrRecreated = errors.New("lease: bucket was deleted and recreated")
	// ErrBucketDeleted means the bucket's stream no longer exists.
	ErrBucketDeleted = errors.New("lease: bucket was deleted")
)

// Clock is a holder's pair of clocks. The zero value reads the real ones.
type Clock struct {
	// Now is the wall clock. Default time.Now.
	Now func() time.Time
	// Mono is the monotonic clock, a duration since any fixed point; it
	// stops while the machine is suspended. Default: time since
	// Settings.Check on the real monotonic clock.
	Mono func() time.Duration
	// Read, if set, reads both clocks at once: what Now and Mono would
	// return if read one right after the other; set it only with both.
	// Fence.Valid uses it.
	// Settings.Check sets it when it fills in Now and Mono both: one
	// time.Now, which reads the wall clock and the monotonic clock both
	// (its monotonic reading, less the one of Mono's origin, is Mono),
	// where Now then Mono read the monotonic clock twice. A clock read is
	// a large part of what an ordered tag's owner adds to a request.
	Read func() (time.Time, time.Duration)
}

// read reads both clocks: Read if set, else Mono then Now.
func (c Clock) read() (time.Time, time.Duration) {
	if c.Read != nil {
		return c.Read()
	}
	mono := c.Mono()
	return c.Now(), mono
}

// Settings are the terms one holder takes leases on. Zero values mean the
// documented defaults; Check fills them in and validates, once.
type Settings struct {
	// Lease is how long a lease lives without a renewal, MinLease to
	// MaxLease. Default DefaultLease.
	Lease time.Duration
	// Heartbeat is the interval of renewals, in (0, Lease). Default
	// DefaultHeartbeat, or Lease/3 if that is shorter.
	Heartbeat time.Duration
	// MaxLease is the longest Lease accepted; zero means no limit.
	MaxLease time.Duration
	// Clock is read for every write and every validity check.
	Clock
}

// Check returns s with its defaults filled in, or an error wrapping
// ErrInvalidSettings that names the field.
func (s Settings) Check() (Settings, error) {
	if s.Lease == 0 {
		s.Lease = DefaultLease
	}
	if s.Heartbeat == 0 {
		s.Heartbeat = min(DefaultHeartbeat, s.Lease/3)
	}
	switch {
	case s.MaxLease < 0:
		return s, fmt.Errorf("%w: MaxLease %v is negative", ErrInvalidSettings, s.MaxLease)
	case s.Lease < MinLease || s.MaxLease > 0 && s.Lease > s.MaxLease:
		limit := "no limit"
		if s.MaxLease > 0 {
			limit = s.MaxLease.String()
		}
		return s, fmt.Errorf("%w: Lease %v not in %v..%s", ErrInvalidSettings, s.Lease, MinLease, limit)
	case s.Heartbeat <= 0 || s.Heartbeat >= s.Lease:
		return s, fmt.Errorf("%w: Heartbeat %v not in (0, Lease %v)", ErrInvalidSettings, s.Heartbeat, s.Lease)
	case s.Read != nil && (s.Now == nil || s.Mono == nil):
		return s, fmt.Errorf("%w: Clock.Read without Now and Mono", ErrInvalidSettings)
	}
	if s.Now == nil && s.Mono == nil {
		// The real clocks, from one origin: time.Now's monotonic
		// reading less base's is Mono (time.Since and Time.Sub use the
		// monotonic readings when both times have one, as both have
		// here).
		base := time.Now()
		s.Now = time.Now
		s.Mono = func() time.Duration { return time.Since(base) }
		s.Read = func() (time.Time, time.Duration) { now := time.Now(); return now, now.Sub(base) }
	}
	if s.Now == nil {
		s.Now = time.Now
	}
	if s.Mono == nil {
		base := time.Now()
		s.Mono = func() time.Duration { return time.Since(base) }
	}
	return s, nil
}

// MaxAttempt bounds how long one renewal request waits for its reply
// (Settings.Attempt).
const MaxAttempt = time.Second

// Attempt is how long one request of a renewal round waits for its reply
// before the round gives it up and tries again (Retry): Lease/4, at most
// MaxAttempt. A request can be lost for good without an error: sent into
// a route that is partitioned but not yet closed, or to a stream or meta
// leader that is gone while JetStream elects a new one. Waiting longer for
// it only delays the round; the next attempt reads the clocks again, so a
// retried write never fences on the send time of a failed one.
func (s Settings) Attempt() time.Duration { return min(s.Lease/4, MaxAttempt) }

// Retry is the pause between a failed renewal round and the next one:
// Heartbeat/4, at most MaxAttempt/4. A round that failed is retried this
// soon, not a whole Heartbeat later, so that a holder renews as soon as a
// JetStream leader election is over and rides out elections shorter than
// Lease - Heartbeat - Attempt - Retry.
func (s Settings) Retry() time.Duration { return min(s.Heartbeat/4, MaxAttempt/4) }

// Terms are what a lease record says to a claimant.
type Terms struct {
	// Lease is the holder's lease duration.
	Lease time.Duration
	// Expires is the holder's wall time of its last write plus Lease.
	Expires time.Time
	// Until is the last wall time the holder may act under the lease if
	// it may act past Expires (snowflake's timestamp bound); zero means
	// Expires.
	Until time.Time
	// Released marks a lease its holder gave up: claimable at once.
	Released bool
}

// ClaimableAt is when, by a claimant's wall clock, the lease may be taken
// over: at once (the zero time) if released, else once the clock is past
// Expires and past Until plus one more lease for the clocks' skew.
func (t Terms) ClaimableAt() time.Time {
	if t.Released {
		return time.Time{}
	}
	until := t.Until
	if until.IsZero() {
		until = t.Expires
	}
	if at := until.Add(t.Lease); at.After(t.Expires) {
		return at
	}
	return t.Expires
}

// Claimable reports whether a claimant whose wall clock reads now may take
// the lease over.
func (t Terms) Claimable(now time.Time) bool { return now.After(t.ClaimableAt()) }

// Live reports whether the holder still counts the lease valid at now by
// the record (not released, not expired).
func (t Terms) Live(now time.Time) bool { return !t.Released && now.Before(t.Expires) }

// Deleted returns the terms a claimant gives a key whose delete or purge
// marker it found, written at the server time at: a record of lease that
// expires margin after the marker (DeletedMargin).
func Deleted(at time.Time, margin, lease time.Duration) Terms {
	return Terms{Lease: lease, Expires: at.Add(margin)}
}

// DeletedMargin is how long after a key's delete or purge marker its last
// holder may still act, as a claimant counts it: DeletedKeyMargin or twice
// the longest lease any holder of the bucket may hold, whichever is
// longer. One lease for what remained of the holder's lease, one for its
// clock running ahead of the server's.
func DeletedMargin(longest time.Duration) time.Duration {
	return max(DeletedKeyMargin, 2*longest)
}

// Grant is what a landed write of a holder's record gives it.
type Grant struct {
	// Rev is the key's revision after the write: the next write's
	// compare-and-swap revision.
	Rev uint64
	// Sent is the wall time written in the record (UTC, no monotonic
	// reading), read just before the write was sent.
	Sent time.Time
	// Mono is the monotonic time read before Sent.
	Mono time.Duration
}

// Write writes a holder's record to key by compare-and-swap on rev, the
// revision last read or written (0: the key has no message at all; unlike
// Create, Update on 0 never writes over a delete marker it did not see).
// It reads the monotonic clock, then the wall clock, and encodes the record
// with that wall time (record): the Grant it returns fences on both
// (Fence.Extend). A lost compare-and-swap is an error for which
// kvbucket.Conflict is true; ctx bounds the write.
func (s Settings) Write(ctx context.Context, kv jetstream.KeyValue, key string, rev uint64, record func(now time.Time) ([]byte, error)) (Grant, error) {
	mono := s.Mono()
	now := s.Now().UTC().Round(0)
	data, err := record(now)
	if err != nil {
		return Grant{}, fmt.Errorf("lease: encode %q: %w", key, err)
	}
	newRev, err := kv.Update(ctx, key, data, rev)
	if err != nil {
		return Grant{}, err
	}
	return Grant{Rev: newRev, Sent: now, Mono: mono}, nil
}

// Claim takes key over from the record read at revision rev, whose terms
// are prev (Terms{} for a key without any message, Deleted for a marker),
// by Write: if the claimant's wall clock is not yet past
// prev.ClaimableAt() it writes nothing and returns an error wrapping
// ErrNotClaimable.
func (s Settings) Claim(ctx context.Context, kv jetstream.KeyValue, key string, rev uint64, prev Terms, record func(now time.Time) ([]byte, error)) (Grant, error) {
	if now := s.Now(); !prev.Claimable(now) {
		return Grant{}, fmt.Errorf("%w: key %q is claimable after %s, now %s", ErrNotClaimable, key,
			prev.ClaimableAt().UTC().Format(time.RFC3339Nano), now.UTC().Format(time.RFC3339Nano))
	}
	return s.Write(ctx, kv, key, rev, record)
}

// Fence is a holder's own view of one lease: valid until a monotonic time
// and until a wall time, both extended by each landed write (Extend) and
// cleared when the lease is lost or given up (Revoke). It is safe for
// concurrent use; the zero value is not valid.
type Fence struct {
	validUntil atomic.Int64 // monotonic ns
	expires    atomic.Int64 // wall clock, Unix ns
}

// Extend makes the fence valid until g.Mono plus lease by the monotonic
// clock and g.Sent plus lease by the wall clock, unless it already is
// longer on either.
func (f *Fence) Extend(g Grant, lease time.Duration) {
	until, expires := int64(g.Mono+lease), g.Sent.Add(lease).UnixNano()
	for {
		cur := f.validUntil.Load()
		if cur >= until || f.validUntil.CompareAndSwap(cur, until) {
			break
		}
	}
	for {
		cur := f.expires.Load()
		if cur >= expires || f.expires.CompareAndSwap(cur, expires) {
			break
		}
	}
}

// Revoke makes the fence invalid for good (until the next Extend).
func (f *Fence) Revoke() {
	f.validUntil.Store(0)
	f.expires.Store(0)
}

// Valid reports whether the lease is valid now on both of c's clocks,
// read at once (Clock.Read).
func (f *Fence) Valid(c Clock) bool {
	now, mono := c.read()
	return int64(mono) < f.validUntil.Load() && now.UnixNano() < f.expires.Load()
}

// Stream is the bucket a holder started on: the creation time of its
// stream then.
type Stream struct {
	kv      jetstream.KeyValue
	created time.Time
}

// NewStream reads and remembers the creation time of kv's stream.
func NewStream(ctx context.Context, kv jetstream.KeyValue) (*Stream, error) {
	created, err := kvbucket.StreamCreated(ctx, kv)
	if err != nil {
		return nil, fmt.Errorf("lease: %w", err)
	}
	return &Stream{kv: kv, created: created}, nil
}

// Created returns the stream's creation time at NewStream.
func (s *Stream) Created() time.Time { return s.created }

// Check reads the stream again (one request) and returns nil if it is the
// one NewStream found; an error wrapping ErrRecreated if it was created at
// another time, ErrBucketDeleted if it is gone, both with the times; or
// the error of reading it. Only nil allows a write on a revision read
// before.
func (s *Stream) Check(ctx context.Context) error {
	created, err := kvbucket.StreamCreated(ctx, s.kv)
	switch {
	case errors.Is(err, jetstream.ErrStreamNotFound) || errors.Is(err, jetstream.ErrBucketNotFound):
		return fmt.Errorf("%w: bucket %q no longer exists: %w", ErrBucketDeleted, s.kv.Bucket(), err)
	case err != nil:
		return fmt.Errorf("lease: %w", err)
	case !created.Equal(s.created):
		return fmt.Errorf("%w: bucket %q: stream created at %s, at start-up it was created at %s", ErrRecreated,
			s.kv.Bucket(), created.UTC().Format(time.RFC3339Nano), s.created.UTC().Format(time.RFC3339Nano))
	}
	return nil
}
