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
// A bucket deleted and recreated since Open (lease.Stream) makes the worker
// drop every lease and refuse to claim (ErrBucketRecreated) until
// restarted.
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
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

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

	mu sync.Mutex // protects owned, routes, failed, reread, closed and handingOver
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
	closed bool
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
	})
	if err != nil {
		return nil, fmt.Errorf("ownership: %w", err)
	}
	return start(ctx, kv, s)
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
	s.Lease, s.Heartbeat, s.Now, s.mono = ls.Lease, ls.Heartbeat, ls.Now, ls.Mono
	if s.Logger == nil {
		s.Logger = slog.Default()
	}
	return nil
}

// leaseSettings are s's terms for package lease.
func (s *Settings) leaseSettings() lease.Settings {
	return lease.Settings{Lease: s.Lease, Heartbeat: s.Heartbeat, MaxLease: MaxLease, Clock: lease.Clock{Now: s.Now, Mono: s.mono}}
}

// start returns running Leases with checked settings over a checked
// bucket, recording its stream's creation time.
func start(ctx context.Context, kv jetstream.KeyValue, s Settings) (*Leases, error) {
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
		reread: map[string]time.Duration{},
	}
	l.ctx, l.cancel = context.WithCancel(context.Background())
	l.hbCtx, l.hbCancel = context.WithCancel(l.ctx)
	l.holder = &lease.Holder{
		Settings: terms, KV: kv, Ctx: l.hbCtx, Latest: l.latest, Log: l.log, Warning: "ownership: heartbeat failed", ErrKey: "err",
		Ours: func(e jetstream.KeyValueEntry) bool { s := seenOf(e); return s.put && s.rec.Session == l.session },
	}
	// Watch before serving, so that no change after Open is missed.
	w, err := kv.WatchAll(l.ctx, jetstream.UpdatesOnly())
	if err != nil {
		l.cancel()
		return nil, fmt.Errorf("ownership: bucket %q: watch: %w", kv.Bucket(), err)
	}
	go l.run()
	go l.watch(w)
	return l, nil
}

// checkStream refuses a bucket whose stream is not the one Open found; on
// the first mismatch it drops every lease held.
func (l *Leases) checkStream(ctx context.Context) error {
	if l.recreated.Load() {
		return ErrBucketRecreated
	}
	err := l.stream.Check(ctx)
	switch {
	case err == nil:
		return nil
	case !errors.Is(err, lease.ErrRecreated):
		return fmt.Errorf("ownership: %w", err) // unreadable or gone: nothing is written
	}
	if !l.recreated.Swap(true) {
		l.log.Error("ownership: the bucket's stream was deleted and created again while this worker ran; "+
			"it no longer serves or claims ordered tags: restart it", "err", err)
		l.mu.Lock()
		owned := make(map[string]*held, len(l.owned))
		for tag, h := range l.owned {
			owned[tag] = h
		}
		l.mu.Unlock()
		for tag, h := range owned {
			l.lose(tag, h, "the bucket was deleted and recreated")
		}
	}
	return fmt.Errorf("%w: %w", ErrBucketRecreated, err)
}

// watch keeps the route cache current with every change of the bucket, so
// that a release or a takeover redirects this worker's requests at once,
// and makes a holder whose key changed under it stop at once.
func (l *Leases) watch(w jetstream.KeyWatcher) {
	for {
		for e := range w.Updates() {
			if e != nil {
				l.observe(e)
			}
		}
		w.Stop()
		for {
			if l.ctx.Err() != nil {
				return
			}
			var err error
			if w, err = l.kv.WatchAll(l.ctx, jetstream.UpdatesOnly()); err == nil {
				break
			}
			select {
			case <-l.ctx.Done():
				return
			case <-time.After(time.Second):
			}
		}
	}
}

// observe applies one change of the bucket. An event no newer than what
// this worker already knows of the key (a late delivery) changes nothing.
func (l *Leases) observe(e jetstream.KeyValueEntry) {
	tag := e.Key()
	if strings.Contains(tag, ".") {
		return // LeasesKey
	}
	s := seenOf(e)
	l.mu.Lock()
	l.rememberLocked(tag, s)
	h := l.owned[tag]
	var mine uint64
	if h != nil {
		mine = h.rev
	}
	l.mu.Unlock()
	if h == nil || s.rev <= mine {
		return
	}
	switch {
	case e.Operation() != jetstream.KeyValuePut:
		l.lose(tag, h, "its key was "+kvbucket.MarkerVerb(e.Operation())+" by hand")
	case !s.put || s.rec.Session != l.session:
		l.lose(tag, h, "its key was rewritten by another worker")
	}
}

// rememberLocked caches s for tag unless a newer revision is cached. l.mu
// must be held.
func (l *Leases) rememberLocked(tag string, s seen) {
	if cur, ok := l.routes[tag]; ok && cur.rev > s.rev {
		return
	} else if ok && cur.rev == s.rev && !s.stale && s.claimable.IsZero() {
		s.claimable = cur.claimable
	}
	l.routes[tag] = s
}

func (l *Leases) remember(tag string, s seen) {
	l.mu.Lock()
	l.rememberLocked(tag, s)
	l.mu.Unlock()
}

func (l *Leases) mono() time.Duration { return l.terms.Mono() }

// Owns reports whether this worker holds a valid lease for tag now: the
// only condition under which it may serve the tag. Valid means both before
// the lease's end by the monotonic clock and before the record's expiry by
// the wall clock (the monotonic clock stops while the machine is
// suspended).
func (l *Leases) Owns(tag string) bool {
	l.mu.Lock()
	h := l.owned[tag]
	l.mu.Unlock()
	if h == nil {
		return false
	}
	if h.fence.Valid(l.terms.Clock) {
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
	s, ok := l.cached(tag)
	if !ok {
		var err error
		if s, err = l.read(ctx, tag); err != nil {
			return Route{}, err
		}
	}
	return l.routeOf(s), nil
}

// routeOf is where requests go by s: a live owner other than this worker,
// or none.
func (l *Leases) routeOf(s seen) Route {
	r := s.rec
	if s.put && r.Owner != "" && r.Owner != l.cfg.Owner && !r.Released && l.cfg.Now().Before(r.Expires) {
		return Route{Owner: r.Owner, Subject: r.Subject}
	}
	return Route{}
}

// cached returns what this worker knows of tag's key, if it may be trusted.
func (l *Leases) cached(tag string) (seen, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	s, ok := l.routes[tag]
	return s, ok && !s.stale && !l.closed // closed: the watcher no longer keeps the cache
}

// read reads tag's key, once for all concurrent callers, and caches it.
func (l *Leases) read(ctx context.Context, tag string) (seen, error) {
	ch := l.flights.DoChan("read "+tag, func() (any, error) {
		rctx, cancel := context.WithTimeout(l.ctx, l.cfg.Lease)
		defer cancel()
		var e jetstream.KeyValueEntry
		var err error
		for {
			actx, acancel := l.attempt(rctx)
			e, err = l.latest(actx, tag)
			acancel()
			if err == nil || !kvbucket.NoReply(err) || rctx.Err() != nil {
				break
			}
			select { // no reply (a leader election): read again
			case <-time.After(l.terms.Retry()):
			case <-rctx.Done():
			}
		}
		if err != nil {
			return seen{}, fmt.Errorf("ownership: read %q: %w", tag, err)
		}
		s := seenOf(e)
		l.remember(tag, s)
		return s, nil
	})
	select {
	case r := <-ch:
		if r.Err != nil {
			return seen{}, r.Err
		}
		return r.Val.(seen), nil
	case <-ctx.Done():
		return seen{}, ctx.Err()
	}
}

// latest reads the newest message under key, counting the read.
func (l *Leases) latest(ctx context.Context, key string) (jetstream.KeyValueEntry, error) {
	l.lookups.Add(1)
	return kvbucket.Latest(ctx, l.kv, key)
}

func seenOf(e jetstream.KeyValueEntry) seen {
	if e == nil {
		return seen{}
	}
	s := seen{rev: e.Revision()}
	if e.Operation() == jetstream.KeyValuePut {
		s.put = json.Unmarshal(e.Value(), &s.rec) == nil
		s.stale = !s.put
	}
	return s
}

// Cached says where tag's requests go from what this worker already knows,
// without I/O; ok is false when it knows of no live owner (then use Route).
func (l *Leases) Cached(tag string) (r Route, ok bool) {
	if l.Owns(tag) {
		return Route{Self: true}, true
	}
	s, ok := l.cached(tag)
	if !ok {
		return Route{}, false
	}
	r = l.routeOf(s)
	return r, r.Subject != ""
}

// Forget makes the next Route read tag's key again (for example after a
// forwarded request went unanswered). A read older than what was cached
// does not replace it.
func (l *Leases) Forget(tag string) {
	l.mu.Lock()
	if s, ok := l.routes[tag]; ok {
		s.stale = true
		l.routes[tag] = s
	}
	l.mu.Unlock()
}

// Claim makes this worker the tag's owner if nobody holds a live lease on
// it, and returns where its requests go afterwards. A lease this worker
// knows to have expired but not to be claimable yet answers without I/O,
// and so does a failed claim of the tag for retryAfterError; otherwise one
// claim per tag runs at a time, and concurrent callers share its outcome.
//
// Invariant: when Claim wins, it runs Serving.Reset (the allocator's)
// before the lease becomes visible to Owns, Cached and Route, so no
// request is served from buffers this worker held before the claim.
func (l *Leases) Claim(ctx context.Context, tag string) (Route, error) {
	if l.Owns(tag) {
		return Route{Self: true}, nil
	}
	now, mono := l.cfg.Now(), l.mono()
	l.mu.Lock()
	closed, f := l.closed || l.handingOver, l.failed[tag]
	s, known := l.routes[tag]
	known = known && !s.stale
	l.mu.Unlock()
	switch {
	case closed:
		return Route{}, ErrClosed
	case l.recreated.Load():
		return Route{}, ErrBucketRecreated
	case f.err != nil && mono < f.until:
		return Route{}, f.err
	}
	if known && l.settled(s, now) {
		// The watcher brings every change of the key, but one that
		// the server lost (a restart) comes back only seconds later
		// and misses what happened meanwhile, such as a takeover: read
		// the key again (at most every rereadEvery) rather than wait on
		// a cache that may be stale.
		l.mu.Lock()
		last, read := l.reread[tag]
		due := !read || mono-last >= rereadEvery
		if due {
			l.reread[tag] = mono
		}
		l.mu.Unlock()
		if !due {
			return Route{}, nil
		}
		fresh, err := l.read(ctx, tag)
		if err != nil {
			return Route{}, err
		}
		if rt := l.routeOf(fresh); rt.Subject != "" || l.settled(fresh, now) {
			return rt, nil
		}
	}
	ch := l.flights.DoChan("claim "+tag, func() (any, error) {
		rt, err := l.claim(tag)
		l.mu.Lock()
		if err != nil && !errors.Is(err, ErrClosed) {
			l.failed[tag] = failure{until: l.mono() + retryAfterError, err: err}
		} else {
			delete(l.failed, tag)
		}
		l.mu.Unlock()
		return rt, err
	})
	select {
	case r := <-ch:
		if r.Err != nil {
			return Route{}, r.Err
		}
		return r.Val.(Route), nil
	case <-ctx.Done():
		return Route{}, ctx.Err()
	}
}

// settled reports whether s decides a claim at now without reading the
// key: a lease that expired (or a key deleted) and is not claimable yet,
// so the caller waits. A change of the key since reaches the cache through
// the watcher. A live owner is read again (the caller asked Route first).
func (l *Leases) settled(s seen, now time.Time) bool {
	switch {
	case s.put:
		r := s.rec
		return r.Owner != l.cfg.Owner && !r.Released && !now.Before(r.Expires) && !r.terms().Claimable(now)
	default: // a delete or purge marker, or no message in a purged bucket
		return !s.claimable.IsZero() && !now.After(s.claimable)
	}
}

// claim is one claim of tag (claimOnce), tried again while a request of it
// gets no reply (kvbucket.NoReply: a leader election), for at most a
// lease. A compare-and-swap that landed unanswered left this worker's own
// record under the key, which the next try takes back at once.
func (l *Leases) claim(tag string) (Route, error) {
	ctx, cancel := context.WithTimeout(l.ctx, l.cfg.Lease)
	defer cancel()
	for {
		rt, err := l.claimOnce(ctx, tag)
		if err == nil || !kvbucket.NoReply(err) || ctx.Err() != nil {
			return rt, err
		}
		select {
		case <-time.After(l.terms.Retry()):
		case <-ctx.Done():
			return rt, err
		}
	}
}

// attempt returns a context for one request: it ends after
// lease.Settings.Attempt, or with ctx. A request sent to a stream leader
// that is gone gets no reply at all; waiting longer for it only delays the
// retry.
func (l *Leases) attempt(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, l.terms.Attempt())
}

// claimOnce reads tag's key, and takes it over by compare-and-swap if it
// is free, released, expired a lease ago, or deleted a margin ago. Each
// request waits at most an attempt (attempt) within ctx.
func (l *Leases) claimOnce(ctx context.Context, tag string) (Route, error) {
	actx, cancel := l.attempt(ctx)
	err := l.checkStream(actx)
	cancel()
	if err != nil {
		return Route{}, err
	}
	actx, cancel = l.attempt(ctx)
	e, err := l.latest(actx, tag)
	cancel()
	if err != nil {
		return Route{}, fmt.Errorf("ownership: read %q: %w", tag, err)
	}
	now := l.cfg.Now()
	var rev uint64
	var prev *record
	var terms lease.Terms // of the key as this claimant counts them
	if e != nil {
		rev = e.Revision()
		if e.Operation() != jetstream.KeyValuePut {
			at := e.Created()
			actx, cancel := l.attempt(ctx)
			floor, err := l.deletedFloor(actx, at)
			cancel()
			if err != nil {
				return Route{}, err
			}
			terms = lease.Terms{Lease: l.cfg.Lease, Expires: floor}
			claimable := terms.ClaimableAt()
			l.remember(tag, seen{rev: rev, claimable: claimable})
			if !terms.Claimable(now) {
				return Route{}, nil
			}
			l.log.Warn("ownership: claiming a tag whose key was deleted or purged by hand, a margin after the marker",
				"tag", tag, "marker", kvbucket.MarkerVerb(e.Operation()), "at", at, "claimable_from", claimable)
			prev = &record{}
		} else {
			var r record
			if err := json.Unmarshal(e.Value(), &r); err != nil {
				return Route{}, fmt.Errorf("ownership: tag %q: unreadable lease %q", tag, e.Value())
			}
			prev = &r
			l.remember(tag, seen{rev: rev, rec: r, put: true})
			if r.Owner != l.cfg.Owner { // our own record we may take back at once
				terms = r.terms()
			}
			if !terms.Claimable(now) {
				if terms.Live(now) {
					return Route{Owner: r.Owner, Subject: r.Subject}, nil
				}
				return Route{}, nil // expired, not yet claimable: wait
			}
		}
	}
	// Record our lease as used in the bucket before we hold one.
	actx, cancel = l.attempt(ctx)
	lr, err := l.raiseLongest(actx)
	cancel()
	if err != nil {
		return Route{}, err
	}
	if e == nil && lr.Lost {
		// No message under the key in a bucket whose stream was purged
		// (the record, read after the key, says so): the key may have
		// been held, so it counts as deleted when the loss was found.
		actx, cancel := l.attempt(ctx)
		floor, err := l.deletedFloor(actx, lr.Since)
		cancel()
		if err != nil {
			return Route{}, err
		}
		terms = lease.Terms{Lease: l.cfg.Lease, Expires: floor}
		l.remember(tag, seen{claimable: terms.ClaimableAt()})
		if !terms.Claimable(now) {
			return Route{}, nil
		}
	}
	var rec record
	actx, cancel = l.attempt(ctx)
	defer cancel()
	g, err := l.terms.Claim(actx, l.kv, tag, rev, terms, func(now time.Time) ([]byte, error) {
		rec = l.newRecord(now)
		return json.Marshal(rec)
	})
	if errors.Is(err, lease.ErrNotClaimable) {
		return Route{}, nil // the wall clock stepped back since: wait
	}
	if kvbucket.Conflict(err) {
		// Somebody else was quicker: where did it go?
		s, err := l.read(ctx, tag)
		if err != nil {
			return Route{}, err
		}
		return l.routeOf(s), nil
	}
	if err != nil {
		return Route{}, fmt.Errorf("ownership: claim %q: %w", tag, err)
	}
	newRev := g.Rev
	h := &held{rev: newRev, rec: rec}
	h.fence.Extend(g, l.cfg.Lease)
	l.mu.Lock()
	closed := l.closed || l.handingOver
	l.mu.Unlock()
	if closed {
		l.release(tag, h)
		return Route{}, ErrClosed
	}
	// The invariant: the buffers are dropped before the lease is visible.
	if l.cfg.hooks.acquired != nil {
		l.cfg.hooks.acquired(tag)
	}
	l.mu.Lock()
	if l.closed || l.handingOver {
		l.mu.Unlock()
		l.release(tag, h)
		return Route{}, ErrClosed
	}
	l.owned[tag] = h
	l.rememberLocked(tag, seen{rev: newRev, rec: rec, put: true})
	newer := l.routes[tag].rev > newRev // the watcher saw the key change already
	l.mu.Unlock()
	if newer {
		l.lose(tag, h, "its key changed right after the claim")
		return Route{}, nil
	}
	l.claims.Add(1)
	if prev != nil && prev.Owner != "" && prev.Owner != l.cfg.Owner {
		l.handovers.Add(1)
	}
	l.log.Info("ownership: took tag", "tag", tag, "previous_owner", ownerOf(prev))
	return Route{Self: true}, nil
}

// deletedFloor returns the time after which the holder of a key deleted or
// purged at the server time at has stopped serving, give or take a lease of
// clock skew: at plus lease.DeletedMargin of the longest lease recorded
// (of MaxLease while the record of the longest lease is lost); and at least three MaxLease after the record was written
// anew (a holder that last renewed before then is not in it).
func (l *Leases) deletedFloor(ctx context.Context, at time.Time) (time.Time, error) {
	lr, _, ok, err := l.readLongest(ctx)
	if err != nil {
		return time.Time{}, err
	}
	longest := MaxLease
	if ok {
		longest = max(l.cfg.Lease, time.Duration(lr.LongestMS)*time.Millisecond)
	} else {
		l.log.Warn("ownership: the record of the longest lease is missing; a deleted key waits out the longest lease allowed",
			"key", LeasesKey, "max_lease", MaxLease)
	}
	floor := at.Add(lease.DeletedMargin(longest))
	if ok {
		// A holder not in the record renewed last before it was written
		// (or, once, in the round that raised the lost one), and before
		// at: it stopped within MaxLease of at and two of the record's
		// writing; one more for the clocks.
		unrecorded := at.Add(2 * MaxLease)
		if u := lr.Since.Add(3 * MaxLease); u.Before(unrecorded) {
			unrecorded = u
		}
		if unrecorded.After(floor) {
			floor = unrecorded
		}
	}
	return floor, nil
}

// readLongest reads LeasesKey: ok is false when it is missing, deleted,
// purged or unreadable; rev is the revision to update (0 for none).
func (l *Leases) readLongest(ctx context.Context) (lr leasesRecord, rev uint64, ok bool, err error) {
	e, err := l.latest(ctx, LeasesKey)
	if err != nil {
		return lr, 0, false, fmt.Errorf("ownership: read %q: %w", LeasesKey, err)
	}
	if e == nil {
		return lr, 0, false, nil
	}
	if e.Operation() != jetstream.KeyValuePut || json.Unmarshal(e.Value(), &lr) != nil || lr.Version != 1 {
		return leasesRecord{}, e.Revision(), false, nil
	}
	return lr, e.Revision(), true, nil
}

// raiseLongest makes sure LeasesKey records a lease at least as long as
// ours, by compare-and-swap on the revision read: a success proves that the
// record held it when written. A lost record is written anew, from now.
func (l *Leases) raiseLongest(ctx context.Context) (leasesRecord, error) {
	for attempt := 1; ; attempt++ {
		lr, rev, ok, err := l.readLongest(ctx)
		if err != nil {
			return lr, err
		}
		if ok && lr.LongestMS >= l.cfg.Lease.Milliseconds() {
			return lr, nil // covered: a read is proof enough, and writes nothing
		}
		if !ok {
			lost := false
			if rev != 0 {
				l.log.Error("ownership: the record of the longest lease was deleted, purged or overwritten by hand; writing it anew",
					"key", LeasesKey)
			} else if lost, err = l.purged(ctx); err != nil {
				return lr, err
			} else if lost {
				l.log.Error("ownership: the owners bucket lost its values (nats stream purge, or expired): "+
					"ordered tags without a lease are claimable only a margin from now",
					"bucket", l.kv.Bucket(), "margin", lease.DeletedMargin(MaxLease))
			}
			lr = leasesRecord{Version: 1, Since: l.cfg.Now().UTC().Round(0), Lost: lost}
		}
		lr.LongestMS = max(lr.LongestMS, l.cfg.Lease.Milliseconds())
		data, err := json.Marshal(lr)
		if err != nil {
			return lr, err
		}
		_, err = l.kv.Update(ctx, LeasesKey, data, rev)
		if err == nil {
			return lr, nil
		}
		if !kvbucket.Conflict(err) || attempt == 3 {
			return lr, fmt.Errorf("ownership: record the longest lease: %w", err)
		}
	}
}

// purged reports whether the bucket, in which LeasesKey has no message,
// has held values and holds no tag key: its stream was purged or its values
// expired. A bucket of a version before LeasesKey holds tag keys; a new one
// has held nothing. The stream is read before LeasesKey is read again: a
// record written meanwhile makes raiseLongest read it anew.
func (l *Leases) purged(ctx context.Context) (bool, error) {
	info, err := kvbucket.StreamInfo(ctx, l.kv)
	if err != nil {
		return false, fmt.Errorf("ownership: %w", err)
	}
	if info.State.LastSeq == 0 {
		return false, nil
	}
	if _, rev, _, err := l.readLongest(ctx); err != nil || rev != 0 {
		return false, err // written meanwhile: the caller's update conflicts
	}
	keys, err := l.kv.ListKeys(ctx)
	if err != nil {
		return false, fmt.Errorf("ownership: bucket %q: list keys: %w", l.kv.Bucket(), err)
	}
	defer keys.Stop()
	for k := range keys.Keys() {
		if k != LeasesKey {
			return false, nil
		}
	}
	return true, nil
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

// run renews the held leases every Heartbeat until Close, and a round that
// failed for want of an answer again after lease.Settings.Retry
// (lease.Holder.Run).
func (l *Leases) run() {
	defer close(l.done)
	l.holder.Run(nil, l.heartbeat)
}

// heartbeat renews every held lease once, or releases it (Plain). It first
// checks that the bucket is the one Open found and that the longest lease
// recorded covers ours; if either fails, no lease is renewed this round.
// It reports whether the round failed for want of an answer, and should
// be tried again soon. Each of its requests waits at most
// lease.Settings.Attempt (why: lease.Holder).
func (l *Leases) heartbeat() (retry bool) {
	l.mu.Lock()
	tags := make([]string, 0, len(l.owned))
	for tag := range l.owned {
		tags = append(tags, tag)
	}
	l.mu.Unlock()
	if len(tags) == 0 {
		return false
	}
	sort.Strings(tags)
	ctx, cancel := context.WithTimeout(l.hbCtx, l.terms.Attempt())
	err := l.checkStream(ctx)
	cancel()
	if err != nil {
		if errors.Is(err, ErrBucketRecreated) || l.hbCtx.Err() != nil {
			return false
		}
		l.holder.Failed(err)
		return true
	}
	ctx, cancel = context.WithTimeout(l.hbCtx, l.terms.Attempt())
	_, err = l.raiseLongest(ctx)
	cancel()
	if err != nil {
		if l.hbCtx.Err() != nil {
			return false
		}
		l.holder.Failed(err)
		return true
	}
	for _, tag := range tags {
		if l.cfg.hooks.plain != nil && l.cfg.hooks.plain(tag) {
			l.log.Info("ownership: releasing a tag that is no longer ordered", "tag", tag)
			l.Release(tag)
			continue
		}
		if l.renew(tag) {
			retry = true
		}
	}
	if !retry {
		l.holder.Succeeded()
	}
	return retry
}

// renew renews one lease (lease.Holder.Renew): a compare-and-swap on the
// revision last written, the fence extended from the send time of the
// write. It reports whether it should be tried again soon: it got no
// answer, or it found that a write of its own whose answer was lost had
// landed after all, which it adopts without extending the fence.
func (l *Leases) renew(tag string) (retry bool) {
	l.mu.Lock()
	h := l.owned[tag]
	var rev uint64
	if h != nil {
		rev = h.rev
	}
	l.mu.Unlock()
	if h == nil || l.recreated.Load() {
		return false
	}
	var rec record
	r := l.holder.Renew(l.hbCtx, tag, rev, func(now time.Time) ([]byte, error) {
		rec = l.newRecord(now)
		return json.Marshal(rec)
	}, "tag", tag)
	switch r.Outcome {
	case lease.Renewed:
		newRev := r.Grant.Rev
		l.mu.Lock()
		h.rev, h.rec = newRev, rec
		l.rememberLocked(tag, seen{rev: newRev, rec: rec, put: true})
		newer := l.routes[tag].rev > newRev
		l.mu.Unlock()
		if newer {
			l.lose(tag, h, "its key changed right after the heartbeat")
			return false
		}
		h.fence.Extend(r.Grant, l.cfg.Lease)
		return false
	case lease.Closing:
		return false
	case lease.Gone:
		l.lose(tag, h, "its key was deleted or purged")
		return false
	case lease.Failed, lease.Behind:
		return true
	case lease.Adopted:
		s := seenOf(r.Entry)
		l.mu.Lock()
		if s.rev > h.rev {
			h.rev, h.rec = s.rev, s.rec
		}
		l.rememberLocked(tag, s)
		l.mu.Unlock()
		return true
	}
	l.lose(tag, h, "its key was rewritten, deleted or purged")
	return false
}

// lose drops a lease this worker no longer holds: Owns turns false before
// the Serving's Reset runs.
func (l *Leases) lose(tag string, h *held, why string) {
	h.fence.Revoke()
	l.mu.Lock()
	if l.owned[tag] != h {
		l.mu.Unlock()
		return
	}
	delete(l.owned, tag)
	if s, ok := l.routes[tag]; ok {
		s.stale = true
		l.routes[tag] = s
	}
	l.mu.Unlock()
	l.losses.Add(1)
	l.log.Warn("ownership: lost tag", "tag", tag, "reason", why)
	if l.cfg.hooks.lost != nil {
		l.cfg.hooks.lost(tag)
	}
}

// Release hands tag over at once: this worker stops serving it and marks
// its lease released. The caller has stopped serving the tag.
func (l *Leases) Release(tag string) {
	l.mu.Lock()
	h := l.owned[tag]
	delete(l.owned, tag)
	l.mu.Unlock()
	if h != nil {
		h.fence.Revoke()
		l.release(tag, h)
		if l.cfg.hooks.lost != nil {
			l.cfg.hooks.lost(tag)
		}
	}
}

func (l *Leases) release(tag string, h *held) {
	l.mu.Lock()
	rec, rev := h.rec, h.rev
	l.mu.Unlock()
	if l.recreated.Load() {
		return // never write to a stranger's stream
	}
	ctx, cancel := context.WithTimeout(context.Background(), l.cfg.Lease)
	defer cancel()
	for adopted := 0; ; adopted++ {
		g, err := l.terms.Write(ctx, l.kv, tag, rev, func(now time.Time) ([]byte, error) {
			rec.Heartbeat, rec.Expires, rec.Released = now, now, true
			return json.Marshal(rec)
		})
		if err == nil {
			l.remember(tag, seen{rev: g.Rev, rec: rec, put: true})
			return
		}
		if kvbucket.Conflict(err) && adopted < maxReleaseAdopts {
			// A renewal of this session that landed after its answer
			// was given up (Close and HandOver cancel a heartbeat round
			// under way) moved the key on: release at its revision.
			// Only this session's own record is adopted, by a
			// compare-and-swap on its revision, so nobody else's
			// lease is ever overwritten. Without this, the tag stayed
			// without an owner until the lease ran out and one more
			// (TestReleaseAfterALandedRenewal).
			e, rerr := l.latest(ctx, tag)
			if rerr == nil && e != nil && e.Operation() == jetstream.KeyValuePut {
				if s := seenOf(e); s.put && s.rec.Session == l.session && !s.rec.Released && s.rev > rev {
					rev, rec = s.rev, s.rec
					continue
				}
			}
		}
		l.log.Warn("ownership: release failed; the tag moves once the lease expires", "tag", tag, "err", err)
		return
	}
}

// maxReleaseAdopts bounds how many newer revisions of its own record a
// release adopts (one is what a cancelled renewal leaves).
const maxReleaseAdopts = 3

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
