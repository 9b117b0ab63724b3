package segment

import (
	"context"
	"errors"
	"fmt"
	"github.com/dispenser-dev/dispenser/tagmodel"
	"math"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// segment is one range of IDs, start through end-1, taken from the store.
//
// Its cursor only moves by compare-and-swap, from c to at most end, and only
// while c < end: a spent segment's cursor stays at end, whatever is asked of
// it, so no sum can overflow even when end is 2^63-1, and freezing it on
// Close (moving it to end) can never produce an ID.
//
// It is 32 bytes (a size class of its own), two per warm tag: its step is
// end-start, and when it was fetched is its buffer's lastFetch.
type segment struct {
	cursor    atomic.Int64 // next ID to hand out; end when spent
	start     int64
	end       int64
	threshold int64 // when cursor passes it, the next segment is fetched
}

// takeUpTo takes min(k, what is left) IDs, k >= 1, and returns the first
// and how many it took; 0 when the segment is spent.
func (s *segment) takeUpTo(k int64) (first, got int64) {
	for {
		c := s.cursor.Load()
		if c >= s.end {
			return 0, 0
		}
		got = min(k, s.end-c)
		if s.cursor.CompareAndSwap(c, c+got) {
			return c, got
		}
	}
}

// freeze marks the segment spent and returns its first unissued ID (end if
// none was left). No take succeeds after it.
func (s *segment) freeze() int64 {
	for {
		c := s.cursor.Load()
		if c >= s.end {
			return s.end
		}
		if s.cursor.CompareAndSwap(c, s.end) {
			return c
		}
	}
}

// buffer is the double buffer of one tag. cur is taken from without locks;
// next holds the segment that takes over when cur is spent.
//
// There is one per warm tag, so its fields are laid out to waste no
// padding (the one-byte fields together) and times are int64s, not
// time.Time (24 bytes): TestMemoryPerTag bounds a warm tag's memory.
type buffer struct {
	a   *Allocator
	tag string // its own copy, also the tag map's key (newBuffer)
	// born is when the allocator learned of the tag, on monoNow's clock.
	born int64

	cur  atomic.Pointer[segment] // nil until the first fetch
	next atomic.Pointer[segment] // a ready, untouched segment, or nil
	// spec is the tag's reset period and format (nil: none); set before
	// b is in the tag map, never changed.
	spec *tagSpec
	// refetchAt is, for a buffer of an ordered tag made during the tag's
	// switch window, the window's end (UnixNano), when TakeOwned drops it;
	// 0: none.
	refetchAt atomic.Int64
	waits     atomic.Int64 // requests that had to wait
	timeouts  atomic.Int64 // waits that expired
	// waiting counts the IDs that waiting requests still lack.
	waiting atomic.Int64
	loading atomic.Bool // a loader runs; at most one per tag
	dropped atomic.Bool // no longer in the tag map (removed or idle)
	used    atomic.Bool // requested since the idle loop last looked
	ordered atomic.Bool // served only by its owner (TakeOwned)
	// starved is set when a request finds no ID in memory and must wait
	// for a fetch; the next fetch deepens.
	starved atomic.Bool
	// exhausted: the store has no segment left for the tag (ErrExhausted
	// at the tag's own step). Requests fail with ErrExhausted once the
	// buffers are spent; this allocator never fetches the tag again. It is
	// set with mu held, before wake is closed.
	exhausted atomic.Bool
	// idleLooks counts the idle loop's looks in a row that found b
	// unused; only the idle loop touches it. (It may wrap after 255 looks
	// whose release found a fetch running: the tag is then dropped two
	// looks later.)
	idleLooks uint8
	// removed and calm are protected by mu (here, beside the other
	// one-byte fields, they take no padding of their own). calm: the last
	// fetch arrived while at least three quarters of the segment in use
	// were left, so the next one may take fewer steps.
	removed bool
	calm    bool

	// mu is a leaf of the lock order (Allocator): no lock is taken while
	// it is held.
	mu sync.Mutex // protects removed, calm and the fields below
	// wake, made by the first waiter, is closed and dropped whenever a
	// fetch ends, well or not (most tags never have a waiter: no channel).
	wake      chan struct{}
	step      int64 // step in force at the last fetch; 0 before the first
	minStep   int64 // the tag's configured step, as of the last fetch
	depth     int64 // steps taken by the last fetch; 0 before the first
	depthAt   int64 // when the depth last grew or shrank (UnixNano of Now)
	lastFetch int64 // when the last fetch ended (a.now(), UnixNano); 0 before the first
	fetches   int64
	// lastLatency is the last fetch's latency.
	lastLatency time.Duration
	lastErr     error
}

func newBuffer(a *Allocator, tag string) *buffer {
	// A copy of the name: tag is often a slice of a request's subject,
	// which would stay in memory as long as the buffer.
	return &buffer{a: a, tag: strings.Clone(tag), born: monoNow()}
}

// take takes up to n IDs without waiting, appending them to dst, and returns
// how many are still missing. It switches to the next segment when the
// current one is spent and starts fetches as needed.
func (b *buffer) take(n int, dst []Run) ([]Run, int) {
	if !b.used.Load() {
		b.used.Store(true)
	}
	for n > 0 {
		seg := b.cur.Load()
		if seg == nil {
			// The first fetch: every request waits for it, which says
			// nothing yet about the tag's rate.
			b.prefetch()
			return dst, n
		}
		k := int64(n)
		if k > 1 {
			// A batch that would cross into a next segment that is not
			// ready waits before taking anything, so that a request that
			// times out (store down) does not drain the buffer that keeps
			// serving smaller requests. Concurrent takers can still make a
			// batch straddle; then the part taken is skipped if it fails.
			if c := seg.cursor.Load(); c < seg.end && k > seg.end-c {
				if nxt := b.next.Load(); nxt == nil || nxt == seg {
					b.starve()
					return dst, n
				}
			}
		}
		if first, got := seg.takeUpTo(k); got > 0 {
			dst = appendRegionRuns(b.a.regions, dst, first, got)
			if first+got > seg.threshold {
				b.prefetch()
			}
			if n -= int(got); n == 0 {
				return dst, 0
			}
		}
		// seg is spent: switch to the next segment if it is ready.
		nxt := b.next.Load()
		if nxt == nil || nxt == seg {
			b.starve()
			return dst, n
		}
		if b.cur.CompareAndSwap(seg, nxt) {
			b.next.CompareAndSwap(nxt, nil)
		}
	}
	return dst, 0
}

// starve notes that a request found no ID in memory (it will wait), so
// that the next fetch takes more steps, and starts a fetch.
func (b *buffer) starve() {
	if !b.starved.Load() {
		b.starved.Store(true)
	}
	b.prefetch()
}

// prefetch starts a background fetch unless one runs or the next segment is
// ready. At most one loader runs per tag.
func (b *buffer) prefetch() {
	if b.loading.Load() || !b.wantsLoad() || b.exhausted.Load() || !b.loading.CompareAndSwap(false, true) {
		return
	}
	// A loader may have published between the check and the swap.
	if !b.wantsLoad() {
		b.loading.Store(false)
		return
	}
	b.a.startLoad(b)
}

// wantsLoad reports whether there is no current segment or no ready next one.
// (next may briefly equal cur while a switch completes.)
func (b *buffer) wantsLoad() bool {
	cur := b.cur.Load()
	if cur == nil {
		return true
	}
	nxt := b.next.Load()
	return nxt == nil || nxt == cur
}

// load fetches one segment, retrying with backoff until it succeeds, the tag
// turns out to be gone, or the allocator closes. Only a fetched segment is
// ever published.
func (b *buffer) load() {
	a := b.a
	defer a.wg.Done()
	backoff := a.retryMin
	for {
		b.mu.Lock()
		now := a.now()
		step := b.nextStep(now)
		size := step * b.nextDepth(step, now)
		b.mu.Unlock()
		// Close does not cancel a fetch under way: a segment the store
		// has handed out is installed, so that Close gives back its rest
		// instead of skipping all of it (at most FetchTimeout).
		ctx, cancel := context.WithTimeout(context.WithoutCancel(a.ctx), a.fetchTimeout)
		start := time.Now()
		alloc, err := a.fetch(ctx, b.tag, size)
		latency := time.Since(start)
		cancel()
		if err == nil && (alloc.Start < 1 || alloc.End <= alloc.Start || alloc.TagStep < 1) {
			err = fmt.Errorf("segment: store returned a bad allocation %+v for tag %q", alloc, b.tag)
		}
		if err == nil && alloc.End-1 > a.regions.MaxValue() {
			// Its IDs (value × regions + region) would pass 2^63-1; the
			// segment is skipped.
			err = fmt.Errorf("%w: segment %d..%d of tag %q, as IDs of %s", tagmodel.ErrExhausted, alloc.Start, alloc.End-1, b.tag, a.regions)
		}
		if a.onFetch != nil {
			a.onFetch(b.tag, latency, err)
		}
		if err == nil {
			b.publish(alloc, step, latency)
			return
		}
		exhausted := errors.Is(err, tagmodel.ErrExhausted)
		if exhausted && size > 0 {
			// The dynamic step (or several steps) no longer fits below
			// 2^63-1; the tag's own step may.
			b.mu.Lock()
			b.step, b.depth = 0, 1
			b.mu.Unlock()
			continue
		}
		gone := errors.Is(err, tagmodel.ErrUnknownTag)
		b.mu.Lock()
		b.lastErr = err
		b.lastLatency = latency
		if gone {
			b.removed = true
		}
		if exhausted {
			b.exhausted.Store(true)
		}
		b.wakeAll()
		b.mu.Unlock()
		if gone {
			a.removeTag(b.tag, b)
			b.loading.Store(false)
			return
		}
		if exhausted {
			a.log.Error("segment: tag exhausted: its IDs would pass 2^63-1; requests for it fail once its buffers are spent",
				"tag", b.tag, "err", err)
			b.loading.Store(false)
			return
		}
		if a.ctx.Err() != nil {
			b.loading.Store(false)
			return
		}
		a.log.Warn("segment: fetch failed", "tag", b.tag, "err", err, "retry_in", backoff)
		select {
		case <-a.ctx.Done():
			b.loading.Store(false)
			return
		case <-time.After(backoff):
		}
		backoff = min(backoff*2, a.retryMax)
	}
}

// nextStep returns the step of the next fetch (0: the tag's own step), as
// Leaf does: double it when the last segment lasted under 15 minutes, halve
// it when over 30, within [the tag's step, MaxStep]. b.mu must be held.
func (b *buffer) nextStep(now time.Time) int64 {
	if b.step == 0 {
		return 0
	}
	step := b.step
	switch d := time.Duration(now.UnixNano() - b.lastFetch); {
	case d < stepGrowBelow:
		if step*2 <= b.a.maxStep {
			step *= 2
		}
	case d < stepShrinkAbove:
	default:
		step /= 2
	}
	return max(step, b.minStep)
}

// nextDepth returns how many steps of step the next fetch takes (see
// Allocator) and records it; 1 when step is 0 (the tag's own step, before
// the first fetch or at the end of the tag's range). b.mu must be held.
func (b *buffer) nextDepth(step int64, now time.Time) int64 {
	d := max(b.depth, 1)
	switch t := now.UnixNano(); {
	case b.starved.Swap(false):
		d *= 2
		if step > 0 {
			// Enough for twice what the waiting requests lack.
			d = max(d, 2*b.waiting.Load()/step+1)
		}
		b.depthAt = t
	case b.calm && d > 1 && time.Duration(t-b.depthAt) >= depthDecay:
		d /= 2
		b.depthAt = t
	}
	b.calm = false
	if bt := b.a.bufferTime; bt > 0 && step > 0 && b.lastFetch != 0 {
		// Enough for BufferTime at the rate the last fetch lasted.
		if lasted := now.UnixNano() - b.lastFetch; lasted > 0 {
			want := float64(b.step*max(b.depth, 1)) * float64(bt) / float64(lasted)
			d = max(d, int64(min(math.Ceil(want/float64(step)), float64(MaxDepthLimit))))
		}
	}
	if step <= 0 {
		d = 1
	}
	d = max(min(d, b.a.maxDepth, tagmodel.MaxStepLimit/max(step, 1)), 1)
	b.depth = d
	return d
}

// publish makes a fetched allocation the next (or first) segment and wakes
// the waiters. step is the step in force that the fetch asked for (0: the
// tag's own step).
func (b *buffer) publish(alloc tagmodel.Allocation, step int64, latency time.Duration) {
	size := alloc.End - alloc.Start
	seg := &segment{
		start:     alloc.Start,
		end:       alloc.End,
		threshold: alloc.Start + int64(math.Ceil(float64(size)*b.a.ratio)),
	}
	seg.cursor.Store(alloc.Start)
	b.mu.Lock()
	if b.dropped.Load() {
		// Reset (or removed, or released) while it was fetched: a
		// segment of an older generation is never installed. loading
		// stays set: nothing more is fetched for b.
		b.wakeAll()
		b.mu.Unlock()
		return
	}
	b.step = step
	if step <= 0 {
		b.step = alloc.TagStep
	}
	b.minStep = alloc.TagStep
	if cur := b.cur.Load(); cur != nil {
		// The fetch came well in time if at least three quarters of the
		// segment in use are left (it was fetched after a tenth was
		// used): then the next fetch may take half as many steps and
		// still come in time, with room for a fetch several times as
		// slow as this one.
		left := cur.end - min(cur.cursor.Load(), cur.end)
		b.calm = 4*left >= 3*(cur.end-cur.start)
	}
	b.lastFetch = b.a.now().UnixNano()
	b.fetches++
	b.lastLatency = latency
	b.lastErr = nil
	if !b.cur.CompareAndSwap(nil, seg) {
		b.next.Store(seg)
	}
	b.loading.Store(false)
	b.wakeAll()
	b.mu.Unlock()
}

// remove marks the tag as no longer served and wakes its waiters.
func (b *buffer) remove() {
	b.mu.Lock()
	b.removed = true
	b.wakeAll()
	b.mu.Unlock()
}

// giveBack freezes b's segments and returns the unissued rest of the last
// one to the store. It runs on Close, after all loaders have stopped. It
// returns the IDs given back (first..end-1), none if the store kept them
// (another worker fetched meanwhile: they are skipped).
func (b *buffer) giveBack(ctx context.Context) (first, end int64, err error) {
	cur, nxt := b.cur.Load(), b.next.Load()
	if cur == nil {
		return 0, 0, nil
	}
	if nxt == cur {
		nxt = nil
	}
	curCursor := cur.freeze()
	last, first := cur, curCursor
	if nxt != nil {
		last = nxt
		first = nxt.freeze()
		if first == nxt.start && cur.end == nxt.start {
			first = curCursor // contiguous: give back the rest of both
		}
	}
	if first >= last.end {
		return 0, 0, nil
	}
	ok, err := b.a.store.GiveBack(ctx, b.tag, last.end, first)
	if err != nil {
		return 0, 0, fmt.Errorf("segment: giving back %d..%d of tag %q: %w", first, last.end-1, b.tag, err)
	}
	b.a.log.Debug("segment: give back", "tag", b.tag, "first", first, "end", last.end, "done", ok)
	if !ok {
		return 0, 0, nil
	}
	return first, last.end, nil
}

// wakeAll wakes the requests waiting on b. b.mu must be held.
func (b *buffer) wakeAll() {
	if b.wake != nil {
		close(b.wake)
		b.wake = nil
	}
}

// appendRegionRuns appends the IDs of the store values first..first+n-1 to dst:
// one run without regions, a run of one ID per value with them (the IDs of
// a region are Count apart).
func appendRegionRuns(r tagmodel.Regions, dst []Run, first, n int64) []Run {
	if !r.Split() {
		return append(dst, Run{First: first, Last: first + n - 1})
	}
	for v := first; v < first+n; v++ {
		id := r.ID(v)
		dst = append(dst, Run{First: id, Last: id})
	}
	return dst
}
