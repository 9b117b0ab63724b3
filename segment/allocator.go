package segment

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
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
