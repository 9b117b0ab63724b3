// Package ownership gives each ordered tag one owner at a time among
// dispenser's workers, through leases in a JetStream key-value bucket: one
// key per tag, claimed, renewed and released under the rules of package
// lease, where their safety argument is written (fencing on both clocks,
// claimableAt, deleted keys, recreated buckets).
//
// # What ownership adds to package lease
//
// The record names the owner and the subject it takes forwarded requests
// on (Route). A watcher keeps every worker's routes current, and makes an
// owner whose key changed under it (a watcher event newer than its own
// last write, or a heartbeat that finds another worker's record or a
// marker) stop at once. The heartbeats are package lease's loop
// (lease.Holder, where why they may retry and adopt is written): each
// request of a round waits at most lease.Settings.Attempt, a failed round
// is tried again after lease.Settings.Retry, and a renewal whose answer
// was lost but which landed is recognised by the record's Session and
// adopted. An owner may take its own record back at once.
//
// A key deleted or purged by hand is claimable only the claimant's lease
// after a floor: lease.DeletedMargin of the longest lease recorded under
// LeasesKey (raised by compare-and-swap before a claim and at each
// heartbeat round; a round that cannot renews nothing); while that record
// is missing, or less than three MaxLease old, the floor counts with
// MaxLease. A purged bucket is recorded there (Lost) and a tag key without
// any message counts as deleted when the loss was found.
//
// A bucket deleted and recreated since Open (lease.Stream, checked before
// every claim, renewal round and release) makes the worker drop every
// lease and refuse to claim (ErrBucketRecreated) until restarted.
//
// # Serving
//
// Open takes what serves the owned tags (Serving: the allocator) and wires
// the leases to it itself. The one invariant the serving side relies on:
// Owns(tag) turns true only after Serving.Reset(tag) has returned for the
// acquisition, and Reset(tag) runs again only after Owns turned false on
// a loss or release. So a tag is never served from buffers this worker
// held before it was (re)acquired.
package ownership

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"log/slog"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"golang.org/x/sync/singleflight"

	"github.com/dispenser-dev/dispenser/internal/kvbucket"
	"github.com/dispenser-dev/dispenser/lease"
)

// Defaults and limits.
const (
	DefaultBucket = "dispenser_owners"
	// DefaultLease and DefaultHeartbeat are package lease's, sized from
	// JetStream leader elections; after an owner crashes its tags wait
	// about two leases before another worker takes them over.
	DefaultLease     = lease.DefaultLease
	DefaultHeartbeat = lease.DefaultHeartbeat
	// MaxLease is the longest lease accepted: it bounds how long a worker
	// not recorded under LeasesKey may serve.
	MaxLease = 5 * time.Minute
	// DeletedKeyMargin is the least time between a key's delete or purge
	// marker and the end of its last holder's lease as a claimant counts
	// it (lease.DeletedKeyMargin).
	DeletedKeyMargin = lease.DeletedKeyMargin
	// LeasesKey holds the longest lease used in the bucket (leasesRecord).
	// Tag names have no dots, so it is no tag's key.
	LeasesKey = "config.leases"
)

// Errors of this package; test with errors.Is.
var (
	// ErrInvalidSettings means a Settings field is out of range.
	ErrInvalidSettings = errors.New("ownership: invalid settings")
	// ErrClosed means Close was called.
	ErrClosed = errors.New("ownership: closed")
	// ErrBucketRecreated means the bucket's stream is not the one Open
	// found: it was deleted and created again.
	ErrBucketRecreated = errors.New("ownership: bucket was deleted and recreated")
)

// Settings configure Leases. Zero values mean the documented defaults.
type Settings struct {
	// Bucket holds one key per ordered tag. Default DefaultBucket.
	Bucket string
	// Replicas of the bucket when it is created; an existing bucket with
	// fewer is refused. Default 1.
	Replicas int
	// Cluster, if not empty, is the NATS cluster a new bucket is created
	// in (JetStream placement): the region's own in per-region mode
	// (docs/regions.md).
	Cluster string
	// Owner names this worker in the leases; unique per process (the
	// micro service ID). Required.
	Owner string
	// Subject is where this worker takes requests forwarded by others; it
	// is recorded in the lease. Required.
	Subject string
	// Lease is how long a lease lives without a heartbeat, 10ms to
	// MaxLease. Default DefaultLease.
	Lease time.Duration
	// Heartbeat is the interval of renewals, below Lease. Default
	// DefaultHeartbeat, or Lease/3 if that is shorter. A failed round is
	// tried again after lease.Settings.Retry, each request waiting at most
	// lease.Settings.Attempt.
	Heartbeat time.Duration
	// Now is the wall clock. Default time.Now.
	Now func() time.Time
	// Logger. Default slog.Default().
	Logger *slog.Logger

	mono func() time.Duration // tests
	// read reads Now and mono at once (lease.Clock.Read); set by check
	// with the real clocks.
	read func() (time.Time, time.Duration)
	// hooks are set by Open from its Serving; tests set their own.
	hooks hooks
}

// Serving is what serves the tags this worker owns: the allocator
// (*segment.Allocator implements it). Open wires the leases to it.
type Serving interface {
	// Reset drops a tag's buffers. The leases call it when this worker
	// becomes the tag's owner, before Owns reports it (it must not call
	// Claim), and when it stops being one (lost, released or fenced for
	// good), after Owns stopped reporting it; both from the goroutine
	// that noticed.
	Reset(tag string)
	// Plain says at each heartbeat whether a held tag is now known to be
	// plain (made plain by an update); such a tag is released instead of
	// renewed. A tag it knows nothing about is kept.
	Plain(tag string) bool
}

// hooks are what the leases call on the serving side: acquired before a
// won lease is visible, lost after a lease stopped being visible, plain
// at each heartbeat (Serving); nil ones are not called.
type hooks struct {
	acquired, lost func(tag string)
	plain          func(tag string) bool
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

// terms are what the record says to a claimant.
func (r record) terms() lease.Terms {
	return lease.Terms{Lease: r.lease(), Expires: r.Expires, Released: r.Released}
}

// leasesRecord is the JSON value under LeasesKey.
type leasesRecord struct {
	Version int `json:"version"`
	// LongestMS is the longest lease, in milliseconds, any worker used
	// since Since.
	LongestMS int64 `json:"longest_lease_ms"`
	// Since is when the record was created (by its writer's clock): a
	// worker that last renewed before then may hold a longer lease.
	Since time.Time `json:"since"`
	// Lost marks a record written anew into a bucket that had held values
	// but had no message left under LeasesKey: its stream was purged (or
	// its values expired), which leaves no marker under the tags' keys. A
	// tag key without any message then counts as deleted at Since.
	Lost bool `json:"lost,omitempty"`
}

// seen is what this worker last saw under a tag's key.
type seen struct {
	rev uint64 // 0: no message
	rec record // put only
	put bool   // false: a delete or purge marker, or no message
	// claimable, if set, is when a marker's key may be claimed.
	claimable time.Time
	// stale: read the key again before trusting this (Forget, an
	// unreadable value).
	stale bool
}

// held is a lease this worker holds.
type held struct {
	rev uint64 // under Leases.mu
	rec record // under Leases.mu
	// fence is the lease's validity on both clocks.
	fence lease.Fence
	// expired is set when a check found the fence run out (or revoked),
	// and cleared when a renewal extends it: while it is set, Cached reads
	// the clocks rather than trust the holding. A hint only: what is
	// served rests on Owns.
	expired atomic.Bool
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
	terms   lease.Settings // cfg's lease, heartbeat and clocks
	log     *slog.Logger
	session string
	// stream is the bucket's stream at Open.
	stream *lease.Stream

	ctx    context.Context // owned; canceled by Close
	cancel context.CancelFunc
	// hbCtx is the heartbeat loop's, a child of ctx, canceled by
	// HandOver too: the watcher outlives the heartbeats.
	hbCtx    context.Context
	hbCancel context.CancelFunc
	done     chan struct{} // heartbeat loop exited
	// flights runs one claim or read per tag at a time.
	flights singleflight.Group

	claims     atomic.Uint64
	handovers  atomic.Uint64 // claims that took over from another owner
	losses     atomic.Uint64
	fencedHits atomic.Uint64
	lookups    atomic.Uint64 // reads of the bucket
	recreated  atomic.Bool   // the stream is not the one Open found
	// holder runs the heartbeats (on hbCtx) and logs their failures.
	holder *lease.Holder

	// mu protects owned, routes, failed, reread, claiming, closed and
	// handingOver.
	// Lock order: it is the only mutex of Leases (the counters are
	// atomic), and it is never held across a request to the bucket or a
	// call into the Serving (whose Reset takes the allocator's locks).
	mu sync.Mutex
	// owned holds the leases this worker holds, valid or not.
	owned map[string]*held
	// routes caches, per tag, the newest key value read or written.
	routes map[string]seen
	// failed holds, per tag, the error of its last claim and until when
	// (monotonic) Claim returns it again without I/O.
	failed map[string]failure
	// reread holds, per tag, when (monotonic) Claim last read a key that
	// the cache said was settled (rereadEvery).
	reread map[string]time.Duration
	// claiming holds, per tag whose claim is under way (Claim's flight),
	// a channel closed when it ends: after its lease is in owned, if won.
	claiming map[string]chan struct{}
	closed   bool
	// handingOver is set by HandOver: no claim succeeds from then on,
	// and no lease is held; the watcher keeps the routes current.
	handingOver bool
}

// rereadEvery spaces Claim's reads of a key the cache says is settled: the
// cache may be stale after a watcher was lost, and a storm of claims must
// not read the key once each.
const rereadEvery = 250 * time.Millisecond

type failure struct {
	until time.Duration
	err   error
}

// retryAfterError is how long a tag's failed claim is not tried again.
const retryAfterError = 50 * time.Millisecond

// Open opens (or creates) the bucket, refuses one that can drop values, and
// starts the heartbeats, wired to serving (Serving); ctx bounds start-up
// only.
func Open(ctx context.Context, js jetstream.JetStream, serving Serving, s Settings) (*Leases, error) {
	if serving == nil {
		return nil, fmt.Errorf("%w: no Serving to reset the tags' buffers", ErrInvalidSettings)
	}
	s.hooks = hooks{acquired: serving.Reset, lost: serving.Reset, plain: serving.Plain}
	if s.Bucket == "" {
		s.Bucket = DefaultBucket
	}
	if s.Replicas == 0 {
		s.Replicas = 1
	}
	if s.Replicas < 1 || s.Replicas > 5 {
		return nil, fmt.Errorf("%w: Replicas %d not in 1..5", ErrInvalidSettings, s.Replicas)
	}
	if err := s.check(); err != nil {
		return nil, err
	}
	kv, err := kvbucket.Open(ctx, js, jetstream.KeyValueConfig{
		Bucket:      s.Bucket,
		Description: "dispenser: owners of ordered tags",
		History:     1,
		Replicas:    s.Replicas,
		Storage:     jetstream.FileStorage,
		Placement:   kvbucket.Placement(s.Cluster),
	}, s.Logger)
	if err != nil {
		return nil, fmt.Errorf("ownership: %w", err)
	}
	return start(ctx, js.Conn(), kv, s)
}

// check fills in defaults and validates s.
func (s *Settings) check() error {
	if s.Owner == "" || s.Subject == "" {
		return fmt.Errorf("%w: Owner and Subject are required", ErrInvalidSettings)
	}
	ls, err := s.leaseSettings().Check() // fills in the defaults
	if err != nil {
		return fmt.Errorf("%w: %w", ErrInvalidSettings, err)
	}
	s.Lease, s.Heartbeat, s.Now, s.mono, s.read = ls.Lease, ls.Heartbeat, ls.Now, ls.Mono, ls.Read
	if s.Logger == nil {
		s.Logger = slog.Default()
	}
	return nil
}

// leaseSettings are s's terms for package lease.
func (s *Settings) leaseSettings() lease.Settings {
	return lease.Settings{Lease: s.Lease, Heartbeat: s.Heartbeat, MaxLease: MaxLease, Clock: lease.Clock{Now: s.Now, Mono: s.mono, Read: s.read}}
}

// start returns running Leases with checked settings over a checked
// bucket, recording its stream's creation time. Its watch waits out a
// JetStream that is not ready yet (kvbucket.WaitReady): it needs a
// consumer, so a meta leader, which reading the bucket does not; nc is
// kv's connection (nil: not known, see kvbucket.Transient).
func start(ctx context.Context, nc *nats.Conn, kv jetstream.KeyValue, s Settings) (*Leases, error) {
	stream, err := lease.NewStream(ctx, kv)
	if err != nil {
		return nil, fmt.Errorf("ownership: %w", err)
	}
	terms := s.leaseSettings()
	if terms.Mono == nil {
		base := time.Now()
		terms.Mono = func() time.Duration { return time.Since(base) }
	}
	l := &Leases{
		kv: kv, cfg: s, terms: terms, log: s.Logger.With("bucket", kv.Bucket()), session: rand.Text(), stream: stream,
		done: make(chan struct{}), owned: map[string]*held{}, routes: map[string]seen{}, failed: map[string]failure{},
		reread: map[string]time.Duration{}, claiming: map[string]chan struct{}{},
	}
	l.ctx, l.cancel = context.WithCancel(context.Background())
	l.hbCtx, l.hbCancel = context.WithCancel(l.ctx)
	l.holder = &lease.Holder{
		Settings: terms, KV: kv, Ctx: l.hbCtx, Latest: l.latest, Log: l.log, Warning: "ownership: heartbeat failed", ErrKey: "err",
		Ours: func(e jetstream.KeyValueEntry) bool { s := seenOf(e); return s.put && s.rec.Session == l.session },
	}
	// Watch before serving, so that no change after Open is missed.
	var w jetstream.KeyWatcher
	err = kvbucket.WaitReady(ctx, nc, s.Logger, fmt.Sprintf("bucket %q: watch", kv.Bucket()), func() (err error) {
		w, err = kv.WatchAll(l.ctx, jetstream.UpdatesOnly())
		return err
	})
	if err != nil {
		l.cancel()
		return nil, fmt.Errorf("ownership: bucket %q: watch: %w", kv.Bucket(), err)
	}
	go l.run()
	go l.watch(w)
	return l, nil
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
	// Lookups counts reads of the bucket (claims, route look-ups, the
	// longest-lease record).
	Lookups uint64 `json:"lookups"`
}

// Stats returns the ownership state.
func (l *Leases) Stats() Stats {
	return Stats{
		Owner: l.cfg.Owner, Owned: l.Owned(), Claims: l.claims.Load(), Handovers: l.handovers.Load(),
		Losses: l.losses.Load(), FencedRefusals: l.fencedHits.Load(), Lookups: l.lookups.Load(),
	}
}

// HandOver hands every tag this worker holds over at once, as Close does,
// and claims none from then on (Claim returns ErrClosed), but keeps
// watching the bucket: Route and Cached stay current, so that a worker
// shutting down forwards the ordered requests it still receives to the
// new owners instead of failing them. Close follows it.
//
// Safety: as Close: the heartbeats stop before the releases (no renewal
// writes behind a release), every lease is revoked before it is released,
// and a claim that was under way sees handingOver, under l.mu, either
// before it records its lease (it releases it itself) or after (the
// release here finds it).
func (l *Leases) HandOver() {
	l.mu.Lock()
	if l.closed || l.handingOver {
		l.mu.Unlock()
		return
	}
	l.handingOver = true
	l.mu.Unlock()
	l.hbCancel()
	<-l.done
	l.releaseAll()
}

// HandingOver reports whether HandOver ran and Close has not: this worker
// holds no lease and claims none, and its routes are current.
func (l *Leases) HandingOver() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.handingOver && !l.closed
}

// Close stops the heartbeats and the watcher and releases every lease
// held, so that other workers take the tags over at once. The caller has
// stopped serving.
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
	l.releaseAll()
}

// releaseAll releases every lease held, valid or fenced; the heartbeat
// loop has stopped.
func (l *Leases) releaseAll() {
	for _, tag := range l.Owned() {
		l.Release(tag)
	}
	l.mu.Lock()
	rest := l.owned
	l.owned = map[string]*held{}
	l.mu.Unlock()
	for tag, h := range rest { // fenced ones: release them too
		h.fence.Revoke()
		l.release(tag, h)
	}
}
