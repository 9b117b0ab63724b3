package segment

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sync/singleflight"

	"github.com/dispenser-dev/dispenser/protocol"
	"github.com/dispenser-dev/dispenser/tagmodel"
)

// Settings configures an Allocator. Zero values mean the documented defaults.
type Settings struct {
	// Store holds the tags' sequences. Required.
	Store tagmodel.Store
	// PrefetchRatio is the fraction of the current segment that may be used
	// before the next segment is fetched in the background. Default 0.1, as
	// in Leaf; it must be in (0, 1].
	PrefetchRatio float64
	// MaxWait bounds how long a request waits for a segment when both
	// buffers are empty before it fails with ErrUnavailable. Default 100 ms.
	MaxWait time.Duration
	// ColdWait bounds how long the requests for a tag that has no segment
	// in memory yet (its first since the worker started, or since it was
	// idle or reset) wait for the tag's lookup and first segment: a store
	// far away (another region, docs/regions.md) must not fail a cold
	// tag's first request. Default 1 s; never below MaxWait.
	ColdWait time.Duration
	// BufferTime, if positive, sizes buffers in time: each fetch takes at
	// least BufferTime's worth of IDs at the tag's recent rate (the last
	// fetch's size over the time since it; within MaxDepth steps), so that
	// a worker whose store is far away, or cut off, keeps serving a tag
	// from memory for about that long (docs/regions.md). A crash then
	// skips up to about twice that many IDs per tag. Default 0: off.
	BufferTime time.Duration
	// FetchTimeout bounds one store call. Default 2 s.
	FetchTimeout time.Duration
	// RetryMin and RetryMax bound the backoff between failed fetches of one
	// tag. Defaults 10 ms and 1 s.
	RetryMin, RetryMax time.Duration
	// RefreshInterval is how often the allocator asks the store what
	// changed (a ChangeLister) or lists all tags (any other Store). Default
	// 60 s.
	RefreshInterval time.Duration
	// IdleTimeout is how long a tag may go without requests before it gives
	// its unused IDs back and drops its buffers; its next request brings it
	// back like a new tag. Default 1 h; negative never drops a tag.
	IdleTimeout time.Duration
	// NegativeTTL is how long an unknown tag is remembered as unknown before
	// the store is asked again. Default 2 s.
	NegativeTTL time.Duration
	// MaxStep caps the dynamic step. Default 1,000,000. The step never goes
	// below a tag's configured step, so a MaxStep below it pins the step.
	MaxStep int64
	// MaxDepth caps how many steps one fetch takes while a tag's requests
	// outrun its fetches (the multi-step fetch: see Allocator). Default
	// 256; 1 turns it off. It bounds what a crash can cost: a worker holds
	// at most two segments of a tag, each at most MaxDepth times the step
	// in force.
	MaxDepth int64
	// AutoCreateStep, when above zero, creates an unknown tag on first use
	// with this step, starting at 1; the Store must then implement Admin.
	// Default 0: unknown tags are errors.
	AutoCreateStep int64
	// AutoCreateMax bounds the tags this allocator creates on first use
	// over its life, so that requests for random tag names cannot fill the
	// store; beyond it an unknown tag is ErrUnknownTag (create it with the
	// admin commands). Default DefaultAutoCreateMax; negative: no bound.
	AutoCreateMax int
	// Now returns the current time; it measures how long segments last for
	// the dynamic step and ages the negative cache. Default time.Now.
	Now func() time.Time
	// Logger receives fetch failures. Default slog.Default().
	Logger *slog.Logger
	// OnFetch, if set, is called after every store fetch with its latency
	// and error, from the loader's goroutine (for metrics).
	OnFetch func(tag string, latency time.Duration, err error)
	// Regions maps the store's values to the IDs of this region
	// (Regions): with more than one region, a value v is handed out as
	// v×Regions.Count + Regions.Region. The store must record the same
	// settings (CheckRegions). Default: one region, IDs are the values.
	Regions tagmodel.Regions
	// Verify, if set, is called before a fetch until it first returns
	// nil; until then every fetch fails with its error, and nothing is
	// fetched. A worker that could not check its store's region settings
	// at start-up (the store was down) checks them here, before the
	// first segment it would serve.
	Verify func(ctx context.Context) error
}

// Dynamic step thresholds, as in Leaf: a segment that lasted less than
// stepGrowBelow doubles the next step; one that lasted longer than
// stepShrinkAbove halves it.
const (
	stepGrowBelow   = 15 * time.Minute
	stepShrinkAbove = 30 * time.Minute
)

// pruneInterval is how often the refresh loop asks the store to delete
// expired periods' rows (PeriodPruner): retentions are days, and a KV
// store reads its whole bucket to find them.
const pruneInterval = time.Hour

// depthDecay is how long a tag's depth stays before it may halve: a
// fetch's latency varies (a disk flush, a busy database), and a depth that
// followed every fast fetch down would meet the next slow one with too
// little. So it halves at most once per depthDecay, and only while fetches
// come well in time.
const depthDecay = time.Second

// negativeCacheMax bounds the negative cache so that requests for random tag
// names cannot grow it without limit; when it is full, a new entry evicts
// an old one (not the whole cache, which would send a burst of lookups of
// known-unknown tags to the store).
const negativeCacheMax = 10000

// maxLookups bounds the store lookups of tags not in memory that run at
// once, whatever the number of distinct tags requested: a flood of random
// tag names costs the store at most this many queries at a time; the rest
// wait within their MaxWait (then 503).
const maxLookups = 8

// DefaultMaxDepth is the default of Settings.MaxDepth, and MaxDepthLimit
// its largest value (a step times it stays far below 2^63).
const (
	DefaultMaxDepth = 256
	MaxDepthLimit   = 1 << 20
)

// DefaultAutoCreateMax is the default of Settings.AutoCreateMax.
const DefaultAutoCreateMax = 1000

// Run is a contiguous run of IDs, First through Last inclusive: the run of
// the wire protocol's range format.
type Run = protocol.Run

// Allocator hands out IDs of many tags from double-buffered segments. It is
// safe for concurrent use. Background work (prefetches, tag refreshes) runs
// on a context the Allocator owns and stops on Close.
//
// One fetch per tag is in flight at a time, and each takes the step in force
// (the dynamic step, as in Leaf) times the tag's depth: 1 while the double
// buffer keeps up. When a request has to wait for a segment, the next
// fetch takes at least twice as many steps, and enough to cover twice the
// IDs then waiting, up to MaxDepth, in one store operation; while fetches
// arrive with at least three quarters of the segment in use left, the
// depth halves, at most once a second. So a tag pinned at a small step
// keeps up with a burst within a few fetches, and returns to single steps
// within seconds once the burst is over.
type Allocator struct {
	store           tagmodel.Store
	ratio           float64
	maxWait         time.Duration
	coldWait        time.Duration // Settings.ColdWait, at least maxWait
	bufferTime      time.Duration
	fetchTimeout    time.Duration
	retryMin        time.Duration
	retryMax        time.Duration
	refreshInterval time.Duration
	idleTimeout     time.Duration
	negativeTTL     time.Duration
	maxStep         int64
	maxDepth        int64
	autoCreateStep  int64
	autoCreateMax   int
	autoCreated     atomic.Int64  // tags created on first use
	autoCreateFull  atomic.Bool   // AutoCreateMax reached and logged
	lookups         chan struct{} // a slot per running lookup (maxLookups)
	now             func() time.Time
	log             *slog.Logger
	onFetch         func(tag string, latency time.Duration, err error)

	ctx    context.Context // canceled by Close; parent of all store calls
	cancel context.CancelFunc
	wg     sync.WaitGroup // background goroutines
	lookup singleflight.Group
	ready  atomic.Bool   // the tag list has been loaded once
	loaded chan struct{} // closed when ready turns true
	// regions maps store values to this region's IDs (Settings.Regions).
	regions tagmodel.Regions
	// verify is Settings.Verify; verified is set once it returned nil.
	verify   func(ctx context.Context) error
	verified atomic.Bool
	released atomic.Uint64 // idle tags dropped

	// tags maps tag names to the buffers of the tags in use.
	tags *tagMap

	// Lock order: refreshMu, then tags.mu (a tagMap's), then mu; no other
	// lock is taken while a buffer's mu is held.
	refreshMu sync.Mutex // serializes Refresh; protects cursor
	cursor    int64      // ChangeLister cursor of the last refresh

	mu sync.Mutex // protects the fields below
	// negative holds tags the store did not know, and when that expires.
	negative map[string]time.Time
	// orderedSeen holds, per tag known to be ordered, when this allocator
	// first saw it ordered: the start of its switch window.
	orderedSeen map[string]time.Time
	closed      bool
}

// New validates s and returns a running Allocator. It does no I/O itself:
// the tag list is loaded in the background right away and every
// RefreshInterval after that; until it is, tags are looked up one by one.
func New(s Settings) (*Allocator, error) {
	if s.Store == nil {
		return nil, errors.New("segment: Settings.Store is required")
	}
	if s.PrefetchRatio == 0 {
		s.PrefetchRatio = 0.1
	}
	if !(s.PrefetchRatio > 0 && s.PrefetchRatio <= 1) {
		return nil, fmt.Errorf("segment: PrefetchRatio %v: want (0, 1]", s.PrefetchRatio)
	}
	def := func(d *time.Duration, v time.Duration) {
		if *d == 0 {
			*d = v
		}
	}
	def(&s.MaxWait, 100*time.Millisecond)
	def(&s.ColdWait, time.Second)
	def(&s.FetchTimeout, 2*time.Second)
	def(&s.RetryMin, 10*time.Millisecond)
	def(&s.RetryMax, time.Second)
	def(&s.RefreshInterval, time.Minute)
	def(&s.IdleTimeout, time.Hour)
	def(&s.NegativeTTL, 2*time.Second)
	for name, d := range map[string]time.Duration{
		"MaxWait": s.MaxWait, "ColdWait": s.ColdWait, "BufferTime": s.BufferTime, "FetchTimeout": s.FetchTimeout, "RetryMin": s.RetryMin,
		"RetryMax": s.RetryMax, "RefreshInterval": s.RefreshInterval, "NegativeTTL": s.NegativeTTL,
	} {
		if d < 0 {
			return nil, fmt.Errorf("segment: %s %v: must not be negative", name, d)
		}
	}
	if s.RetryMax < s.RetryMin {
		return nil, fmt.Errorf("segment: RetryMax %v is below RetryMin %v", s.RetryMax, s.RetryMin)
	}
	if s.MaxStep == 0 {
		s.MaxStep = 1_000_000
	}
	if s.MaxStep < 1 || s.MaxStep > tagmodel.MaxStepLimit {
		return nil, fmt.Errorf("%w: MaxStep %d: want 1..%d", tagmodel.ErrInvalidStep, s.MaxStep, tagmodel.MaxStepLimit)
	}
	if s.MaxDepth == 0 {
		s.MaxDepth = DefaultMaxDepth
	}
	if s.MaxDepth < 1 || s.MaxDepth > MaxDepthLimit {
		return nil, fmt.Errorf("segment: MaxDepth %d: want 1..%d", s.MaxDepth, MaxDepthLimit)
	}
	if s.AutoCreateStep < 0 || s.AutoCreateStep > tagmodel.MaxStepLimit {
		return nil, fmt.Errorf("%w: AutoCreateStep %d: want 0..%d", tagmodel.ErrInvalidStep, s.AutoCreateStep, tagmodel.MaxStepLimit)
	}
	if _, ok := s.Store.(tagmodel.Admin); s.AutoCreateStep > 0 && !ok {
		return nil, errors.New("segment: AutoCreateStep needs a Store that implements Admin")
	}
	if err := s.Regions.Check(); err != nil {
		return nil, err
	}
	if s.Now == nil {
		s.Now = time.Now
	}
	if s.Logger == nil {
		s.Logger = slog.Default()
	}
	a := &Allocator{
		store:           s.Store,
		ratio:           s.PrefetchRatio,
		maxWait:         s.MaxWait,
		coldWait:        max(s.ColdWait, s.MaxWait),
		bufferTime:      s.BufferTime,
		fetchTimeout:    s.FetchTimeout,
		retryMin:        s.RetryMin,
		retryMax:        s.RetryMax,
		refreshInterval: s.RefreshInterval,
		idleTimeout:     s.IdleTimeout,
		negativeTTL:     s.NegativeTTL,
		maxStep:         s.MaxStep,
		maxDepth:        s.MaxDepth,
		autoCreateStep:  s.AutoCreateStep,
		autoCreateMax:   cmp.Or(s.AutoCreateMax, DefaultAutoCreateMax),
		now:             s.Now,
		log:             s.Logger,
		onFetch:         s.OnFetch,
		negative:        make(map[string]time.Time),
		lookups:         make(chan struct{}, maxLookups),
		orderedSeen:     make(map[string]time.Time),
		loaded:          make(chan struct{}),
		regions:         s.Regions,
		verify:          s.Verify,
	}
	a.ctx, a.cancel = context.WithCancel(context.Background())
	a.tags = newTagMap()
	a.wg.Add(1)
	go a.refreshLoop()
	if a.idleTimeout > 0 {
		a.wg.Add(1)
		go a.idleLoop()
	}
	return a, nil
}

// Take returns n IDs of tag as one or more runs appended to dst. It returns
// at once when the IDs are in memory; otherwise it waits for a segment at
// most MaxWait (or until ctx ends) and then fails with ErrUnavailable.
// Errors: ErrInvalidCount, ErrInvalidTag, ErrUnknownTag, ErrUnavailable,
// ErrExhausted (final: the tag's IDs would pass 2^63-1), ErrOrdered (an
// ordered tag: see TakeOwned), ErrClosed, or ctx's error.
//
// When Take fails after part of the IDs were taken (the wait for a second
// segment expired), those IDs are skipped: never handed out again, so never
// duplicated.
func (a *Allocator) Take(ctx context.Context, tag string, n int, dst []Run) ([]Run, error) {
	if n < 1 {
		return dst, fmt.Errorf("%w: %d", ErrInvalidCount, n)
	}
	b := a.tags.get(tag)
	if b != nil {
		if b.ordered.Load() {
			return dst, fmt.Errorf("%w %q", ErrOrdered, tag)
		}
		if b.spec.periodic() {
			_, b = a.periodBuffer(b)
		}
		var rest int
		if dst, rest = b.take(n, dst); rest == 0 {
			return dst, nil
		}
		return a.wait(ctx, b, rest, dst, a.deadline(), false)
	}
	return a.takeSlow(ctx, tag, n, dst, a.deadline(), false)
}

// deadline returns when a request that starts waiting now must give up:
// one MaxWait covers the tag lookup and the wait for segments together.
func (a *Allocator) deadline() time.Time { return a.now().Add(a.maxWait) }

// cold returns the deadline of a request for a cold tag (ColdWait) whose
// deadline was MaxWait after its start: one deadline still covers the
// lookup and the wait for the first segment.
func (a *Allocator) cold(deadline time.Time) time.Time { return deadline.Add(a.coldWait - a.maxWait) }

// TakeNow is Take for callers that must never block, such as a NATS
// handler serving every tag from one subscription. When the IDs are in
// memory it appends them to dst and returns them with a nil Pending, without
// allocating. Otherwise it returns a Pending holding what it took so far:
// the caller finishes it with Pending.Wait on a goroutine of its own.
// Errors are those of Take that need no waiting: ErrInvalidCount, and
// ErrOrdered for an ordered tag (from Pending.Wait if the tag was not known
// yet). A known ordered tag gets ErrOrdered itself, unwrapped: nothing is
// allocated on a path every request for an ordered tag takes.
func (a *Allocator) TakeNow(tag string, n int, dst []Run) ([]Run, *Pending, error) {
	return a.takeNow(tag, n, dst, false)
}

// TakeOwned is TakeNow for a caller that owns tag (package ownership): it
// serves ordered tags too. The caller must own the tag when it calls; Reset
// the tag whenever ownership is gained or lost, before the ownership is
// visible to requests, so that an owner serves only segments fetched while
// it owned the tag.
//
// A tag this allocator saw become ordered less than SwitchWindow ago may
// still be served as plain by workers that have not seen the change, from
// segments above the owner's. So TakeOwned drops (as Reset does) buffers
// made before the window ended, once it has: from then on the owner serves
// only segments fetched after every worker stopped serving the tag as
// plain.
func (a *Allocator) TakeOwned(tag string, n int, dst []Run) ([]Run, *Pending, error) {
	if b := a.tags.get(tag); b != nil {
		if end := b.refetchAt.Load(); end != 0 && a.now().UnixNano() >= end {
			a.reset(tag, b)
		}
	}
	return a.takeNow(tag, n, dst, true)
}

// SwitchWindow is how long after this allocator saw a tag become ordered a
// worker with the same settings may still serve it as plain: a refresh
// interval plus two store calls (the refresh that saw the change may have
// started just before it) plus MaxWait (a plain request admitted before
// the refresh waits that long at most). Every worker has seen the change
// one window after it was made, so an owner's first segment fetched after
// two windows is above every ID served as plain.
func (a *Allocator) SwitchWindow() time.Duration {
	return a.refreshInterval + 2*a.fetchTimeout + a.maxWait
}

// noteOrdered records whether b's tag is ordered, and, for an ordered tag
// still in its switch window, when b must be dropped for fresh segments.
func (a *Allocator) noteOrdered(b *buffer, ordered bool) {
	b.ordered.Store(ordered)
	now := a.now()
	if seen, ok := a.orderedSince(b.tag, ordered, now); ok {
		if end := seen.Add(a.SwitchWindow()); now.Before(end) {
			b.refetchAt.CompareAndSwap(0, end.UnixNano())
		}
	}
}

// orderedSince records whether tag is ordered and returns, for an ordered
// tag, when this allocator first saw it ordered (now, if this is the
// first time): the start of its switch window.
func (a *Allocator) orderedSince(tag string, ordered bool, now time.Time) (time.Time, bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if !ordered {
		delete(a.orderedSeen, tag)
		return time.Time{}, false
	}
	seen, ok := a.orderedSeen[tag]
	if !ok {
		seen = now
		a.orderedSeen[tag] = seen
	}
	return seen, true
}

func (a *Allocator) takeNow(tag string, n int, dst []Run, owned bool) ([]Run, *Pending, error) {
	if n < 1 {
		return dst, nil, fmt.Errorf("%w: %d", ErrInvalidCount, n)
	}
	b := a.tags.get(tag)
	if b == nil {
		return dst, &Pending{a: a, tag: tag, n: n, deadline: a.deadline(), owned: owned}, nil
	}
	if !owned && b.ordered.Load() {
		return dst, nil, ErrOrdered
	}
	if b.spec.periodic() {
		_, b = a.periodBuffer(b)
	}
	var rest int
	if dst, rest = b.take(n, dst); rest == 0 {
		return dst, nil, nil
	}
	return dst, &Pending{a: a, b: b, tag: tag, n: rest, runs: slices.Clone(dst), deadline: a.deadline(), owned: owned}, nil
}

// Reset drops tag's buffers, unissued IDs included, so that its next
// request fetches a new segment; an owner of an ordered tag calls it when
// it gains or loses ownership. Requests holding the old buffers go on with
// the new ones (TakeOwned's fail with ErrOrdered, to be routed again).
//
// Each Reset starts a new generation of the tag's buffers: once it has
// returned, no ID of a segment fetched for an earlier generation is handed
// out, not even one whose fetch was under way (publish discards it).
func (a *Allocator) Reset(tag string) {
	if b := a.tags.get(tag); b != nil {
		a.reset(tag, b)
	}
}

// reset drops b if it is still tag's buffer.
func (a *Allocator) reset(tag string, b *buffer) {
	if !a.tags.drop(tag, b) {
		return
	}
	b.loading.Store(true) // no loader starts for b any more
	// Freeze under b.mu: publish installs under it, and checks dropped.
	b.mu.Lock()
	for _, seg := range []*segment{b.cur.Load(), b.next.Load()} {
		if seg != nil {
			seg.freeze()
		}
	}
	b.wakeAll()
	b.mu.Unlock()
}

// MaxWait returns how long a request waits for a segment at most.
func (a *Allocator) MaxWait() time.Duration { return a.maxWait }

// Ordered reports whether tag is known to be ordered.
func (a *Allocator) Ordered(tag string) bool {
	b := a.tags.get(tag)
	return b != nil && b.ordered.Load()
}

// Plain reports whether tag is known to be plain (not ordered). A tag whose
// buffers are not in memory (never asked for, idle, Reset) is neither known
// to be ordered nor known to be plain.
func (a *Allocator) Plain(tag string) bool {
	b := a.tags.get(tag)
	return b != nil && !b.ordered.Load()
}

// Pending is a request that TakeNow could not serve from memory.
type Pending struct {
	a    *Allocator
	b    *buffer // nil: the tag is not known yet
	tag  string
	n    int   // IDs still to take
	runs []Run // IDs already taken
	// deadline is MaxWait after TakeNow: the request gives up then.
	deadline time.Time
	owned    bool // from TakeOwned: ordered tags may be served
	// numbered: from TakeNowNumbered; num is the Numbering of the IDs
	// taken, once known.
	numbered bool
	num      Numbering
}

// Wait takes the rest of the request's IDs, waiting for a segment at most
// MaxWait or until ctx ends, and returns all of them. Errors and skipped
// IDs are as for Take. Call it once.
func (p *Pending) Wait(ctx context.Context) ([]Run, error) {
	if p.b == nil {
		return p.a.takeSlowFor(ctx, p.tag, p.n, p.runs, p.deadline, p.owned, p)
	}
	return p.a.wait(ctx, p.b, p.n, p.runs, p.deadline, p.owned)
}

// takeSlow serves a tag that is not in the map: it looks the tag up in the
// store (once for all concurrent callers), remembering unknown tags for
// NegativeTTL. It gives up at deadline.
func (a *Allocator) takeSlow(ctx context.Context, tag string, n int, dst []Run, deadline time.Time, owned bool) ([]Run, error) {
	return a.takeSlowFor(ctx, tag, n, dst, deadline, owned, nil)
}

// takeSlowFor is takeSlow for p (nil: a request without a Pending), which
// learns its Numbering here if it asked for one. A period name is served
// from its own buffer without asking the store about it.
func (a *Allocator) takeSlowFor(ctx context.Context, tag string, n int, dst []Run, deadline time.Time, owned bool, p *Pending) ([]Run, error) {
	if err := tagmodel.CheckName(tag); err != nil {
		return dst, err
	}
	b, err := a.buffer(ctx, tag, deadline)
	if err != nil {
		return dst, err
	}
	if !owned && b.ordered.Load() {
		return dst, fmt.Errorf("%w %q", ErrOrdered, tag)
	}
	if b.spec.periodic() {
		return a.takePeriodSlow(ctx, b, n, dst, deadline, p)
	}
	if p != nil && p.numbered {
		if p.num, err = numbering(b, nil); err != nil {
			return dst, err
		}
	}
	dst, rest := b.take(n, dst)
	if rest == 0 {
		return dst, nil
	}
	return a.wait(ctx, b, rest, dst, deadline, owned)
}

// buffer returns the tag's buffer, asking the store about a tag not yet
// known; it waits for the store until deadline.
func (a *Allocator) buffer(ctx context.Context, tag string, deadline time.Time) (*buffer, error) {
	if b := a.tags.get(tag); b != nil {
		return b, nil
	}
	if !tagmodel.ValidTag(tag) {
		// A period name (takeSlowFor checked it): its first fetch creates
		// the period's row or finds it, and fails if the tag is gone.
		return a.addTag(tagmodel.Tag{Name: tag}, nil), nil
	}
	a.mu.Lock()
	closed := a.closed
	exp, neg := a.negative[tag]
	a.mu.Unlock()
	if closed {
		return nil, ErrClosed
	}
	if neg && a.now().Before(exp) {
		return nil, fmt.Errorf("%w %q", tagmodel.ErrUnknownTag, tag)
	}
	ch := a.lookup.DoChan(tag, func() (any, error) {
		lctx, cancel := context.WithTimeout(a.ctx, a.fetchTimeout)
		defer cancel()
		select {
		case a.lookups <- struct{}{}:
			defer func() { <-a.lookups }()
		case <-lctx.Done():
			return nil, fmt.Errorf("%w: looking up tag %q: too many lookups at once", ErrUnavailable, tag)
		}
		t, err := a.store.Tag(lctx, tag)
		if errors.Is(err, tagmodel.ErrUnknownTag) && a.autoCreateStep > 0 {
			err = a.autoCreate(lctx, tag)
		}
		if errors.Is(err, tagmodel.ErrUnknownTag) {
			a.mu.Lock()
			if len(a.negative) >= negativeCacheMax {
				for old := range a.negative { // an arbitrary one
					delete(a.negative, old)
					break
				}
			}
			a.negative[tag] = a.now().Add(a.negativeTTL)
			a.mu.Unlock()
			return nil, fmt.Errorf("%w %q", tagmodel.ErrUnknownTag, tag)
		}
		if err != nil {
			if a.ctx.Err() != nil {
				return nil, ErrClosed
			}
			return nil, fmt.Errorf("%w: looking up tag %q: %w", ErrUnavailable, tag, err)
		}
		t.Name = tag // also for a tag created here (t is then empty)
		spec, err := newSpec(t)
		if err != nil {
			return nil, fmt.Errorf("segment: tag %q has settings this worker cannot serve: %w", tag, err)
		}
		return a.addTag(t, spec), nil
	})
	// A lookup is a cold tag's: it may wait ColdWait.
	timer := time.NewTimer(a.cold(deadline).Sub(a.now()))
	defer timer.Stop()
	select {
	case r := <-ch:
		if r.Err != nil {
			return nil, r.Err
		}
		return r.Val.(*buffer), nil
	case <-timer.C:
		return nil, fmt.Errorf("%w: looking up tag %q took longer than %v", ErrUnavailable, tag, a.coldWait)
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// autoCreate creates tag on first use, unless this allocator has created
// AutoCreateMax tags already (then ErrUnknownTag, logged once). A tag
// another worker created first is no error.
func (a *Allocator) autoCreate(ctx context.Context, tag string) error {
	bounded := a.autoCreateMax >= 0
	if bounded && a.autoCreated.Add(1) > int64(a.autoCreateMax) {
		a.autoCreated.Add(-1)
		if !a.autoCreateFull.Swap(true) {
			a.log.Warn("segment: not creating tags on first use any more: this worker created the most it may (--auto-create-max); create them with the admin commands",
				"tag", tag, "max", a.autoCreateMax)
		}
		return fmt.Errorf("%w %q", tagmodel.ErrUnknownTag, tag)
	}
	err := a.store.(tagmodel.Admin).CreateTag(ctx, tagmodel.Tag{Name: tag, Step: a.autoCreateStep, MaxID: 1, Description: "created on first use"})
	if err != nil && bounded {
		a.autoCreated.Add(-1) // counts only the tags this allocator created
	}
	switch {
	case err == nil:
		a.log.Info("segment: created tag on first use", "tag", tag, "step", a.autoCreateStep)
	case errors.Is(err, tagmodel.ErrTagExists):
		return nil // another worker created it first
	}
	return err
}

// addTag returns the buffer of tag, adding an empty one if there is none,
// and records whether the tag is ordered. A new buffer is marked before it
// is in the map: a request that finds it never takes an ordered tag for a
// plain one.
func (a *Allocator) addTag(t tagmodel.Tag, spec *tagSpec) *buffer {
	tag, ordered := t.Name, t.Ordered
	b, added := a.tags.add(tag, func() *buffer {
		b := newBuffer(a, tag)
		b.spec = spec
		a.noteOrdered(b, ordered)
		return b
	})
	if added {
		a.mu.Lock()
		delete(a.negative, tag)
		a.mu.Unlock()
	} else {
		a.noteOrdered(b, ordered)
	}
	return b
}

// removeTag stops serving tag, if b is still its buffer.
func (a *Allocator) removeTag(tag string, b *buffer) { a.tags.drop(tag, b) }

// wait takes the remaining n IDs of b, waiting for segments until deadline.
func (a *Allocator) wait(ctx context.Context, b *buffer, n int, dst []Run, deadline time.Time, owned bool) ([]Run, error) {
	b.waits.Add(1)
	b.waiting.Add(int64(n))
	defer b.waiting.Add(-int64(n))
	if b.cur.Load() == nil {
		// A cold tag: its first segment may come from far away.
		deadline = a.cold(deadline)
	}
	wait := deadline.Sub(a.now())
	timer := time.NewTimer(wait)
	defer timer.Stop()
	for {
		// Take the channel (if there is one) before trying, so that a
		// load finishing in between is not missed.
		b.mu.Lock()
		wake, removed, exhausted, lastErr := b.wake, b.removed, b.exhausted.Load(), b.lastErr
		b.mu.Unlock()
		if a.ctx.Err() != nil {
			return dst, ErrClosed
		}
		if removed {
			return dst, fmt.Errorf("%w %q", tagmodel.ErrUnknownTag, b.tag)
		}
		if !owned && b.ordered.Load() {
			// Turned ordered while the request waited: its owner
			// serves it (the IDs taken so far are skipped).
			return dst, fmt.Errorf("%w %q", ErrOrdered, b.tag)
		}
		if b.dropped.Load() {
			if owned {
				// Reset (ownership changed) or released while we
				// waited: the caller must check ownership again.
				return dst, fmt.Errorf("%w %q: its buffers were reset", ErrOrdered, b.tag)
			}
			// Released as idle while we held it: serve the rest from
			// the tag's new buffer.
			return a.takeSlow(ctx, b.tag, n, dst, deadline, owned)
		}
		if dst, n = b.take(n, dst); n == 0 {
			return dst, nil
		}
		if exhausted {
			// The buffers are spent and the store has no more: final.
			return dst, fmt.Errorf("%w %q: its next segment would pass 2^63-1", tagmodel.ErrExhausted, b.tag)
		}
		if wake == nil {
			// Make the channel only now, and try again with it taken:
			// a request served without waiting on it leaves no channel
			// behind (96 bytes that every tag whose first request
			// waited for its first segment kept).
			b.mu.Lock()
			if b.wake == nil {
				b.wake = make(chan struct{})
			}
			b.mu.Unlock()
			continue
		}
		select {
		case <-wake:
		case <-timer.C:
			b.timeouts.Add(1)
			if lastErr != nil {
				return dst, fmt.Errorf("%w for tag %q within %v: %w", ErrUnavailable, b.tag, wait, lastErr)
			}
			return dst, fmt.Errorf("%w for tag %q within %v", ErrUnavailable, b.tag, wait)
		case <-ctx.Done():
			return dst, ctx.Err()
		case <-a.ctx.Done():
			return dst, ErrClosed
		}
	}
}

// refreshLoop loads the tag list now and every RefreshInterval, retrying
// failures with backoff, until Close.
func (a *Allocator) refreshLoop() {
	defer a.wg.Done()
	backoff := a.retryMin
	var pruned time.Time
	for {
		next := a.refreshInterval
		if pp, ok := a.store.(tagmodel.PeriodPruner); ok && time.Since(pruned) >= pruneInterval {
			pruned = time.Now()
			ctx, cancel := context.WithTimeout(a.ctx, a.fetchTimeout)
			if n, err := pp.PrunePeriods(ctx); err != nil && a.ctx.Err() == nil {
				a.log.Warn("segment: pruning expired periods failed", "err", err)
			} else if n > 0 {
				a.log.Info("segment: pruned expired periods' rows", "rows", n)
			}
			cancel()
		}
		if err := a.Refresh(a.ctx); err != nil {
			if a.ctx.Err() != nil {
				return
			}
			a.log.Warn("segment: loading tag list failed", "err", err, "retry_in", backoff)
			next = backoff
			backoff = min(backoff*2, a.retryMax, a.refreshInterval)
		} else {
			backoff = a.retryMin
		}
		select {
		case <-a.ctx.Done():
			return
		case <-time.After(next):
		}
	}
}

// Refresh asks the store what changed since the last refresh (a
// ChangeLister; the first call only takes the store's cursor) or lists all
// tags (any other Store), and applies it: a created tag is served at once
// (it leaves the negative cache), a changed step takes effect at the next
// fetch, a removed tag is no longer served. Tags are not loaded ahead of
// their first request, so a refresh costs what changed, not the number of
// tags, with a ChangeLister. It normally runs in the background.
func (a *Allocator) Refresh(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, a.fetchTimeout)
	defer cancel()
	a.refreshMu.Lock()
	defer a.refreshMu.Unlock()
	cl, ok := a.store.(tagmodel.ChangeLister)
	if ok {
		changes, next, err := cl.Changes(ctx, a.cursor)
		switch {
		case errors.Is(err, errors.ErrUnsupported):
			ok = false // a wrapper whose store lists no changes
		case err != nil:
			return fmt.Errorf("segment: listing changed tags: %w", err)
		default:
			a.cursor = next
			for _, c := range changes {
				a.apply(c)
			}
		}
	}
	if !ok {
		listed := monoNow()
		names, err := a.store.Tags(ctx)
		if err != nil {
			return fmt.Errorf("segment: listing tags: %w", err)
		}
		exists := make(map[string]bool, len(names))
		for _, name := range names {
			exists[name] = true
		}
		a.mu.Lock()
		for tag := range a.negative {
			if exists[tag] {
				delete(a.negative, tag)
			}
		}
		a.mu.Unlock()
		for _, b := range a.tags.all() {
			// A period's buffer goes with its tag.
			if !exists[parentTag(b.tag)] && b.born <= listed { // looked up after the listing began: not removed
				b.remove()
				a.removeTag(b.tag, b)
			}
		}
	}
	if !a.ready.Swap(true) {
		close(a.loaded)
	}
	return nil
}

// apply applies one change from a ChangeLister.
func (a *Allocator) apply(c tagmodel.Change) {
	b := a.tags.get(c.Tag.Name)
	if c.Deleted {
		a.orderedSince(c.Tag.Name, false, time.Time{})
		if b != nil {
			b.remove()
			a.removeTag(b.tag, b)
		}
		return
	}
	a.mu.Lock()
	delete(a.negative, c.Tag.Name)
	a.mu.Unlock()
	if b == nil {
		// Not in memory: its window starts now all the same.
		a.orderedSince(c.Tag.Name, c.Tag.Ordered, a.now())
	} else if !b.spec.same(c.Tag) {
		// Its reset period, time zone or format changed: the next request
		// looks it up again.
		a.reset(b.tag, b)
	} else {
		a.noteOrdered(b, c.Tag.Ordered)
		if c.Tag.Step > 0 {
			b.mu.Lock()
			b.minStep = c.Tag.Step
			b.mu.Unlock()
		}
	}
}

// idleLoop drops the buffers of tags without requests for IdleTimeout, until
// Close. It looks every IdleTimeout/2: a tag unused in two looks in a row is
// dropped, so after between one and one and a half IdleTimeouts.
func (a *Allocator) idleLoop() {
	defer a.wg.Done()
	t := time.NewTicker(a.idleTimeout / 2)
	defer t.Stop()
	for {
		select {
		case <-a.ctx.Done():
			return
		case <-t.C:
		}
		for _, b := range a.tags.all() {
			if b.used.Swap(false) {
				b.idleLooks = 0
				continue
			}
			if b.idleLooks++; b.idleLooks >= 2 {
				a.release(b)
			}
		}
	}
}

// release drops an idle tag's buffers and gives their unused IDs back, unless
// a fetch runs for it (then the next look tries again).
func (a *Allocator) release(b *buffer) {
	// Holding loading for good keeps any loader from starting for b.
	if !b.loading.CompareAndSwap(false, true) {
		return
	}
	if !a.tags.drop(b.tag, b) {
		b.loading.Store(false)
		return
	}
	b.mu.Lock()
	b.wakeAll() // requests holding b take the tag's new buffer
	b.mu.Unlock()
	a.released.Add(1)
	ctx, cancel := context.WithTimeout(a.ctx, a.fetchTimeout)
	defer cancel()
	if _, _, err := b.giveBack(ctx); err != nil {
		a.log.Warn("segment: idle tag's IDs not given back; they are skipped", "tag", b.tag, "err", err)
	}
}

// Released returns how many idle tags dropped their buffers.
func (a *Allocator) Released() uint64 { return a.released.Load() }

// Known reports whether tag is served without asking the store.
func (a *Allocator) Known(tag string) bool { return a.tags.get(tag) != nil }

// Ready reports whether the tag list has been loaded at least once.
func (a *Allocator) Ready() bool { return a.ready.Load() }

// Loaded returns a channel that is closed once the tag list has been loaded:
// from then on the allocator knows which tags exist without asking the
// store. Until then, a store that is down makes every request fail.
func (a *Allocator) Loaded() <-chan struct{} { return a.loaded }

// startLoad starts b's loader unless the allocator is closed. The caller has
// set b.loading.
func (a *Allocator) startLoad(b *buffer) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed {
		b.loading.Store(false)
		return
	}
	a.wg.Add(1)
	go b.load()
}

// Close stops handing out IDs, stops background work and gives the unissued
// rest of each tag's last segment back to the store where nobody fetched
// after us, so that a restart wastes fewer IDs. A fetch under way is let
// finish (it is bounded by FetchTimeout) and its segment given back too;
// ctx bounds the give-back.
func (a *Allocator) Close(ctx context.Context) error {
	a.mu.Lock()
	if a.closed {
		a.mu.Unlock()
		return nil
	}
	a.closed = true
	a.mu.Unlock()
	a.cancel()
	a.wg.Wait()

	tags := a.tags.all()
	work := make(chan *buffer)
	errs := make(chan error, len(tags))
	type given struct {
		tag        string
		first, end int64
	}
	gave := make(chan given, len(tags))
	var wg sync.WaitGroup
	for range min(8, len(tags)) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for b := range work {
				first, end, err := b.giveBack(ctx)
				if err != nil {
					errs <- err
				} else if end > first {
					gave <- given{b.tag, first, end}
				}
			}
		}()
	}
	for _, b := range tags {
		work <- b
	}
	close(work)
	wg.Wait()
	close(errs)
	close(gave)
	// One line says what went back to the store: how many tags and IDs,
	// and the ranges of the first few tags by name.
	var list []given
	var ids int64
	for g := range gave {
		list, ids = append(list, g), ids+g.end-g.first
	}
	if len(list) > 0 {
		slices.SortFunc(list, func(x, y given) int { return strings.Compare(x.tag, y.tag) })
		var shown []string
		for _, g := range list[:min(len(list), 10)] {
			shown = append(shown, fmt.Sprintf("%s %d-%d", g.tag, g.first, g.end-1))
		}
		if len(list) > 10 {
			shown = append(shown, fmt.Sprintf("and %d more", len(list)-10))
		}
		a.log.Info("gave unissued segment IDs back to the store", "tags", len(list), "ids", ids, "ranges", strings.Join(shown, ", "))
	}
	var all []error
	for err := range errs {
		all = append(all, err)
	}
	return errors.Join(all...)
}

// Warm loads tags ahead of their first request, as a starting worker does
// before it joins the queue group, so that it answers them from memory at
// once: it looks each tag up and waits for its first segment, until ctx
// ends. Unknown tags, and ordered ones (their owner serves them), are
// skipped; at most WarmMax tags are loaded. It returns how many tags hold
// a segment.
func (a *Allocator) Warm(ctx context.Context, tags []string) int {
	if len(tags) > WarmMax {
		tags = tags[:WarmMax]
	}
	var wg sync.WaitGroup
	var warm atomic.Int64
	for _, tag := range tags {
		wg.Go(func() {
			if a.warm(ctx, tag) {
				warm.Add(1)
			}
		})
	}
	wg.Wait()
	return int(warm.Load())
}

// WarmMax is the most tags Warm loads.
const WarmMax = 256

// warm loads tag's buffer and waits for its first segment; it reports
// whether the tag has one.
func (a *Allocator) warm(ctx context.Context, tag string) bool {
	if !tagmodel.ValidTag(tag) {
		return false
	}
	deadline := a.now().Add(a.fetchTimeout)
	if d, ok := ctx.Deadline(); ok {
		deadline = a.now().Add(time.Until(d))
	}
	b, err := a.buffer(ctx, tag, deadline)
	if err != nil || b.ordered.Load() {
		return false
	}
	if b.spec.periodic() {
		// Its own row hands out nothing: warm the period of now.
		_, b = a.periodBuffer(b)
	}
	for {
		// Take the channel before looking, so that a load finishing in
		// between is not missed.
		b.mu.Lock()
		if b.wake == nil {
			b.wake = make(chan struct{})
		}
		wake, removed := b.wake, b.removed
		b.mu.Unlock()
		switch {
		case b.cur.Load() != nil:
			return true
		case removed, b.dropped.Load(), b.exhausted.Load(), b.ordered.Load():
			return false
		}
		b.prefetch()
		select {
		case <-wake:
		case <-ctx.Done():
			return false
		case <-a.ctx.Done():
			return false
		}
	}
}

// fetch fetches from the store once Settings.Verify has passed.
func (a *Allocator) fetch(ctx context.Context, tag string, size int64) (tagmodel.Allocation, error) {
	if a.verify != nil && !a.verified.Load() {
		if err := a.verify(ctx); err != nil {
			return tagmodel.Allocation{}, err
		}
		a.verified.Store(true)
	}
	return a.store.Fetch(ctx, tag, size)
}
