// Package ownership gives each ordered tag one owner at a time among
// dispenser's workers, through leases in a JetStream key-value bucket: claim
// and takeover by compare-and-swap, heartbeats, and self-fencing on the
// monotonic clock, with the same safety as the snowflake worker-ID leases.
//
// # Safety
//
// An owner counts its lease valid until the monotonic time at which it sent
// its last successful claim or heartbeat, plus the lease. Its record says
// the lease expires at its wall clock's send time plus the lease. Another
// worker may take the tag over only once its own wall clock is past that
// expiry plus one more lease (or at once after a release). So as long as
// two workers' clocks disagree by less than a lease, the old owner has
// stopped serving before the new one starts. A worker that finds its key
// rewritten stops at once. A key deleted by hand is treated like a lease
// that expired when it was deleted.
package ownership

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/dispenser-dev/dispenser/internal/kvbucket"
)

// Defaults.
const (
	DefaultBucket = "dispenser_owners"
	DefaultLease  = 5 * time.Second
)

// Errors of this package; test with errors.Is.
var (
	// ErrInvalidSettings means a Settings field is out of range.
	ErrInvalidSettings = errors.New("ownership: invalid settings")
	// ErrClosed means Close was called.
	ErrClosed = errors.New("ownership: closed")
)

// Settings configure Leases. Zero values mean the documented defaults.
type Settings struct {
	// Bucket holds one key per ordered tag. Default DefaultBucket.
	Bucket string
	// Replicas of the bucket when it is created; an existing bucket with
	// fewer is refused. Default 1.
	Replicas int
	// Owner names this worker in the leases; unique per process (the
	// micro service ID). Required.
	Owner string
	// Subject is where this worker takes requests forwarded by others; it
	// is recorded in the lease. Required.
	Subject string
	// Lease is how long a lease lives without a heartbeat. Default
	// DefaultLease.
	Lease time.Duration
	// Heartbeat is the interval of renewals, below Lease. Default Lease/3.
	Heartbeat time.Duration
	// OnAcquire is called when this worker becomes a tag's owner, and
	// OnLose when it stops being one (lost, released or fenced for good),
	// from the goroutine that noticed. The allocator drops the tag's
	// buffers in both.
	OnAcquire, OnLose func(tag string)
	// Plain, if set, says at each heartbeat whether a held tag is now
	// known to be plain (made plain by an update); such a tag is released
	// instead of renewed. A tag it knows nothing about is kept.
	Plain func(tag string) bool
	// Now is the wall clock. Default time.Now.
	Now func() time.Time
	// Logger. Default slog.Default().
	Logger *slog.Logger

	mono func() time.Duration // tests
}

// record is the JSON value under a tag's key.
type record struct {
	Version   int       `json:"version"`
	Owner     string    `json:"owner"`
	Subject   string    `json:"subject"`
	Session   string    `json:"session"`
	LeaseMS   int64     `json:"lease_ms"`
	Heartbeat time.Time `json:"heartbeat"`
	Expires   time.Time `json:"expires"`
	Released  bool      `json:"released"`
}

func (r record) lease() time.Duration { return time.Duration(r.LeaseMS) * time.Millisecond }

// claimableAt is when, by a claimant's clock, the lease may be taken over.
func (r record) claimableAt() time.Time {
	if r.Released {
		return time.Time{}
	}
	return r.Expires.Add(r.lease())
}

// held is a lease this worker holds.
type held struct {
	rev uint64
	rec record
	// validUntil is the monotonic time (ns) the lease is trusted until.
	validUntil atomic.Int64
}

// Route says where a tag's requests go.
type Route struct {
	// Self: this worker owns the tag.
	Self bool
	// Owner and Subject name another live owner; empty when the tag has
	// none (then try Claim).
	Owner, Subject string
}

// Leases holds and looks up the ownership of ordered tags. It is safe for
// concurrent use.
type Leases struct {
	kv      jetstream.KeyValue
	cfg     Settings
	log     *slog.Logger
	session string
	base    time.Time

	ctx    context.Context // owned; canceled by Close
	cancel context.CancelFunc
	done   chan struct{} // heartbeat loop exited

	claims     atomic.Uint64
	handovers  atomic.Uint64 // claims that took over from another owner
	losses     atomic.Uint64
	fencedHits atomic.Uint64

	mu sync.Mutex // protects owned, routes and closed
	// owned holds the leases this worker holds, valid or not.
	owned map[string]*held
	// routes caches, per tag, the lease value last read or written.
	routes map[string]record
	closed bool
}

// Open opens (or creates) the bucket, refuses one that can drop values, and
// starts the heartbeats; ctx bounds start-up only.
func Open(ctx context.Context, js jetstream.JetStream, s Settings) (*Leases, error) {
	if s.Bucket == "" {
		s.Bucket = DefaultBucket
	}
	if s.Replicas == 0 {
		s.Replicas = 1
	}
	if s.Lease == 0 {
		s.Lease = DefaultLease
	}
	if s.Heartbeat == 0 {
		s.Heartbeat = s.Lease / 3
	}
	switch {
	case s.Owner == "" || s.Subject == "":
		return nil, fmt.Errorf("%w: Owner and Subject are required", ErrInvalidSettings)
	case s.Replicas < 1 || s.Replicas > 5:
		return nil, fmt.Errorf("%w: Replicas %d not in 1..5", ErrInvalidSettings, s.Replicas)
	case s.Lease < 10*time.Millisecond:
		return nil, fmt.Errorf("%w: Lease %v shorter than 10ms", ErrInvalidSettings, s.Lease)
	case s.Heartbeat <= 0 || s.Heartbeat >= s.Lease:
		return nil, fmt.Errorf("%w: Heartbeat %v not in (0, Lease %v)", ErrInvalidSettings, s.Heartbeat, s.Lease)
	}
	if s.Now == nil {
		s.Now = time.Now
	}
	if s.Logger == nil {
		s.Logger = slog.Default()
	}
	kv, err := kvbucket.Open(ctx, js, jetstream.KeyValueConfig{
		Bucket:      s.Bucket,
		Description: "dispenser: owners of ordered tags",
		History:     1,
		Replicas:    s.Replicas,
		Storage:     jetstream.FileStorage,
	})
	if err != nil {
		return nil, fmt.Errorf("ownership: %w", err)
	}
	return start(kv, s), nil
}

// start returns running Leases over a checked bucket.
func start(kv jetstream.KeyValue, s Settings) *Leases {
	l := &Leases{
		kv: kv, cfg: s, log: s.Logger.With("bucket", s.Bucket), session: rand.Text(), base: time.Now(),
		done: make(chan struct{}), owned: map[string]*held{}, routes: map[string]record{},
	}
	l.ctx, l.cancel = context.WithCancel(context.Background())
	go l.run()
	go l.watch()
	return l
}

// watch keeps the route cache current with every change of the bucket, so
// that a release or a takeover redirects this worker's requests at once.
func (l *Leases) watch() {
	for l.ctx.Err() == nil {
		w, err := l.kv.WatchAll(l.ctx, jetstream.UpdatesOnly())
		if err != nil {
			select {
			case <-l.ctx.Done():
				return
			case <-time.After(time.Second):
				continue
			}
		}
		for e := range w.Updates() {
			if e == nil {
				continue
			}
			var r record
			if e.Operation() != jetstream.KeyValuePut || json.Unmarshal(e.Value(), &r) != nil {
				l.Forget(e.Key())
				continue
			}
			l.remember(e.Key(), r)
			l.mu.Lock()
			h := l.owned[e.Key()]
			l.mu.Unlock()
			if h != nil && r.Session != l.session {
				l.lose(e.Key(), h, "its key was rewritten by another worker")
			}
		}
		w.Stop()
	}
}

func (l *Leases) mono() time.Duration {
	if l.cfg.mono != nil {
		return l.cfg.mono()
	}
	return time.Since(l.base)
}

// Owns reports whether this worker holds a valid lease for tag now: the
// only condition under which it may serve the tag.
func (l *Leases) Owns(tag string) bool {
	l.mu.Lock()
	h := l.owned[tag]
	l.mu.Unlock()
	if h == nil {
		return false
	}
	if int64(l.mono()) < h.validUntil.Load() {
		return true
	}
	l.fencedHits.Add(1)
	return false
}

// Route says where tag's requests go now, from what this worker last saw
// of the tag's key (reading it once if never).
func (l *Leases) Route(ctx context.Context, tag string) (Route, error) {
	if l.Owns(tag) {
		return Route{Self: true}, nil
	}
	l.mu.Lock()
	rec, ok := l.routes[tag]
	ok = ok && !l.closed // closed: the watcher no longer keeps the cache
	l.mu.Unlock()
	if !ok {
		e, err := kvbucket.Latest(ctx, l.kv, tag)
		if err != nil {
			return Route{}, fmt.Errorf("ownership: read %q: %w", tag, err)
		}
		if e != nil && e.Operation() == jetstream.KeyValuePut {
			if json.Unmarshal(e.Value(), &rec) == nil {
				l.remember(tag, rec)
			}
		}
	}
	if rec.Owner != "" && rec.Owner != l.cfg.Owner && !rec.Released && l.cfg.Now().Before(rec.Expires) {
		return Route{Owner: rec.Owner, Subject: rec.Subject}, nil
	}
	return Route{}, nil
}

// Cached says where tag's requests go from what this worker already knows,
// without I/O; ok is false when it knows of no live owner (then use Route).
func (l *Leases) Cached(tag string) (r Route, ok bool) {
	if l.Owns(tag) {
		return Route{Self: true}, true
	}
	l.mu.Lock()
	rec, ok := l.routes[tag]
	ok = ok && !l.closed
	l.mu.Unlock()
	if ok && rec.Owner != "" && rec.Owner != l.cfg.Owner && !rec.Released && l.cfg.Now().Before(rec.Expires) {
		return Route{Owner: rec.Owner, Subject: rec.Subject}, true
	}
	return Route{}, false
}

// Forget drops what this worker saw of tag's owner, so that the next Route
// reads the key again (for example after a forwarded request went
// unanswered).
func (l *Leases) Forget(tag string) {
	l.mu.Lock()
	delete(l.routes, tag)
	l.mu.Unlock()
}

// Claim makes this worker the tag's owner if nobody holds a live lease on
// it, and returns where its requests go afterwards.
func (l *Leases) Claim(ctx context.Context, tag string) (Route, error) {
	if l.Owns(tag) {
		return Route{Self: true}, nil
	}
	l.mu.Lock()
	closed := l.closed
	l.mu.Unlock()
	if closed {
		return Route{}, ErrClosed
	}
	e, err := kvbucket.Latest(ctx, l.kv, tag)
	if err != nil {
		return Route{}, fmt.Errorf("ownership: read %q: %w", tag, err)
	}
	now := l.cfg.Now()
	var rev uint64
	var prev *record
	if e != nil {
		rev = e.Revision()
		if e.Operation() != jetstream.KeyValuePut {
			// Deleted by hand: as if its lease expired then.
			prev = &record{Expires: e.Created(), LeaseMS: max(l.cfg.Lease.Milliseconds(), 1)}
			if !now.After(prev.claimableAt()) {
				return Route{}, nil
			}
		} else {
			var r record
			if err := json.Unmarshal(e.Value(), &r); err != nil {
				return Route{}, fmt.Errorf("ownership: tag %q: unreadable lease %q", tag, e.Value())
			}
			prev = &r
			l.remember(tag, r)
			if r.Owner != l.cfg.Owner && !now.After(r.claimableAt()) {
				if now.Before(r.Expires) && !r.Released {
					return Route{Owner: r.Owner, Subject: r.Subject}, nil
				}
				return Route{}, nil // expired, not yet claimable: wait
			}
		}
	}
	mono := l.mono()
	rec := l.newRecord(now)
	data, err := json.Marshal(rec)
	if err != nil {
		return Route{}, err
	}
	newRev, err := l.kv.Update(ctx, tag, data, rev)
	if conflict(err) {
		l.Forget(tag)
		return l.Route(ctx, tag) // somebody else was quicker
	}
	if err != nil {
		return Route{}, fmt.Errorf("ownership: claim %q: %w", tag, err)
	}
	h := &held{rev: newRev, rec: rec}
	h.validUntil.Store(int64(mono + l.cfg.Lease))
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		l.release(tag, h)
		return Route{}, ErrClosed
	}
	l.owned[tag] = h
	l.routes[tag] = rec
	l.mu.Unlock()
	l.claims.Add(1)
	if prev != nil && prev.Owner != "" && prev.Owner != l.cfg.Owner {
		l.handovers.Add(1)
	}
	l.log.Info("ownership: took tag", "tag", tag, "previous_owner", ownerOf(prev))
	if l.cfg.OnAcquire != nil {
		l.cfg.OnAcquire(tag)
	}
	return Route{Self: true}, nil
}

func ownerOf(r *record) string {
	if r == nil {
		return ""
	}
	return r.Owner
}

func (l *Leases) newRecord(now time.Time) record {
	now = now.UTC().Round(0)
	return record{
		Version: 1, Owner: l.cfg.Owner, Subject: l.cfg.Subject, Session: l.session,
		LeaseMS: l.cfg.Lease.Milliseconds(), Heartbeat: now, Expires: now.Add(l.cfg.Lease),
	}
}

func (l *Leases) remember(tag string, r record) {
	l.mu.Lock()
	l.routes[tag] = r
	l.mu.Unlock()
}

// run renews the held leases every Heartbeat until Close.
func (l *Leases) run() {
	defer close(l.done)
	t := time.NewTicker(l.cfg.Heartbeat)
	defer t.Stop()
	for {
		select {
		case <-l.ctx.Done():
			return
		case <-t.C:
		}
		l.heartbeat()
	}
}

// heartbeat renews every held lease once, or releases it (Plain).
func (l *Leases) heartbeat() {
	l.mu.Lock()
	tags := make([]string, 0, len(l.owned))
	for tag := range l.owned {
		tags = append(tags, tag)
	}
	l.mu.Unlock()
	sort.Strings(tags)
	for _, tag := range tags {
		if l.cfg.Plain != nil && l.cfg.Plain(tag) {
			l.log.Info("ownership: releasing a tag that is no longer ordered", "tag", tag)
			l.Release(tag)
			continue
		}
		l.renew(tag)
	}
}

// renew renews one lease: a compare-and-swap on the revision last written.
func (l *Leases) renew(tag string) {
	l.mu.Lock()
	h := l.owned[tag]
	l.mu.Unlock()
	if h == nil {
		return
	}
	mono := l.mono()
	rec := l.newRecord(l.cfg.Now())
	data, err := json.Marshal(rec)
	if err != nil {
		return
	}
	ctx, cancel := context.WithTimeout(l.ctx, l.cfg.Lease)
	defer cancel()
	rev, err := l.kv.Update(ctx, tag, data, h.rev)
	switch {
	case err == nil:
		l.mu.Lock()
		h.rev, h.rec = rev, rec
		l.routes[tag] = rec
		l.mu.Unlock()
		h.validUntil.Store(max(h.validUntil.Load(), int64(mono+l.cfg.Lease)))
	case conflict(err):
		l.lose(tag, h, "its key was rewritten by another worker")
	default:
		if l.ctx.Err() == nil {
			l.log.Warn("ownership: heartbeat failed", "tag", tag, "err", err)
		}
	}
}

// lose drops a lease this worker no longer holds.
func (l *Leases) lose(tag string, h *held, why string) {
	h.validUntil.Store(0)
	l.mu.Lock()
	if l.owned[tag] != h {
		l.mu.Unlock()
		return
	}
	delete(l.owned, tag)
	delete(l.routes, tag)
	l.mu.Unlock()
	l.losses.Add(1)
	l.log.Warn("ownership: lost tag", "tag", tag, "reason", why)
	if l.cfg.OnLose != nil {
		l.cfg.OnLose(tag)
	}
}

// Release hands tag over at once: this worker stops serving it and marks
// its lease released. The caller has stopped serving the tag.
func (l *Leases) Release(tag string) {
	l.mu.Lock()
	h := l.owned[tag]
	delete(l.owned, tag)
	delete(l.routes, tag)
	l.mu.Unlock()
	if h != nil {
		h.validUntil.Store(0)
		l.release(tag, h)
		if l.cfg.OnLose != nil {
			l.cfg.OnLose(tag)
		}
	}
}

func (l *Leases) release(tag string, h *held) {
	rec := h.rec
	now := l.cfg.Now().UTC().Round(0)
	rec.Heartbeat, rec.Expires, rec.Released = now, now, true
	data, err := json.Marshal(rec)
	if err != nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), l.cfg.Lease)
	defer cancel()
	if _, err := l.kv.Update(ctx, tag, data, h.rev); err != nil {
		l.log.Warn("ownership: release failed; the tag moves once the lease expires", "tag", tag, "err", err)
	}
}

// Owned returns the tags this worker holds valid leases for, sorted.
func (l *Leases) Owned() []string {
	l.mu.Lock()
	tags := make([]string, 0, len(l.owned))
	for tag := range l.owned {
		tags = append(tags, tag)
	}
	l.mu.Unlock()
	out := tags[:0]
	for _, tag := range tags {
		if l.Owns(tag) {
			out = append(out, tag)
		}
	}
	sort.Strings(out)
	return out
}

// Stats is the ownership state for micro stats.
type Stats struct {
	Owner     string   `json:"owner"`
	Owned     []string `json:"owned"`
	Claims    uint64   `json:"claims"`
	Handovers uint64   `json:"handovers"`
	Losses    uint64   `json:"losses"`
	// FencedRefusals counts requests refused because a lease this worker
	// held was no longer valid.
	FencedRefusals uint64 `json:"fenced_refusals"`
}

// Stats returns the ownership state.
func (l *Leases) Stats() Stats {
	return Stats{
		Owner: l.cfg.Owner, Owned: l.Owned(), Claims: l.claims.Load(), Handovers: l.handovers.Load(),
		Losses: l.losses.Load(), FencedRefusals: l.fencedHits.Load(),
	}
}

// Close stops the heartbeats and releases every lease held, so that other
// workers take the tags over at once. The caller has stopped serving.
func (l *Leases) Close() {
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		return
	}
	l.closed = true
	l.mu.Unlock()
	l.cancel()
	<-l.done
	for _, tag := range l.Owned() {
		l.Release(tag)
	}
	l.mu.Lock()
	rest := l.owned
	l.owned = map[string]*held{}
	l.mu.Unlock()
	for tag, h := range rest { // fenced ones: release them too
		h.validUntil.Store(0)
		l.release(tag, h)
	}
}

func conflict(err error) bool {
	return errors.Is(err, jetstream.ErrKeyExists) || errors.Is(err, jetstream.ErrKeyRevisionMismatch)
}
