package segment

import (
	"context"
	"errors"
	"fmt"
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
	// refetchAt is, for a buffer of an ordered tag made during the tag's
	// switch window, the window's end (UnixNano), when TakeOwned drops it;
	// 0: none.
	refetchAt atomic.Int64
	waits     atomic.Int64 // requests that had to wait
	timeouts  atomic.Int64 // waits that expired
	loading   atomic.Bool  // a loader runs; at most one per tag
	dropped   atomic.Bool  // no longer in the tag map (removed or idle)
	used      atomic.Bool  // requested since the idle loop last looked
	ordered   atomic.Bool  // served only by its owner (TakeOwned)
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
	// removed is protected by mu (here, beside the other one-byte fields,
	// it takes no padding of its own).
	removed bool

	mu sync.Mutex // protects removed and the fields below
	// wake, made by the first waiter, is closed and dropped whenever a
	// fetch ends, well or not (most tags never have a waiter: no channel).
	wake      chan struct{}
	step      int64 // step of the last fetch; 0 before the first
	minStep   int64 // the tag's configured step, as of the last fetch
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
					b.prefetch()
					return dst, n
				}
			}
		}
		if first, got := seg.takeUpTo(k); got > 0 {
			dst = append(dst, Run{First: first, Last: first + got - 1})
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
			b.prefetch()
			return dst, n
		}
		if b.cur.CompareAndSwap(seg, nxt) {
			b.next.CompareAndSwap(nxt, nil)
		}
	}
	return dst, 0
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
		step := b.nextStep(a.now())
		b.mu.Unlock()
		ctx, cancel := context.WithTimeout(a.ctx, a.fetchTimeout)
		start := time.Now()
		alloc, err := a.store.Fetch(ctx, b.tag, step)
		latency := time.Since(start)
		cancel()
		if err == nil && (alloc.Start < 1 || alloc.End <= alloc.Start || alloc.TagStep < 1) {
			err = fmt.Errorf("segment: store returned a bad allocation %+v for tag %q", alloc, b.tag)
		}
		if a.onFetch != nil {
			a.onFetch(b.tag, latency, err)
		}
		if err == nil {
			b.publish(alloc, latency)
			return
		}
		exhausted := errors.Is(err, ErrExhausted)
		if exhausted && step > 0 {
			// The dynamic step no longer fits below 2^63-1; the tag's
			// own step may.
			b.mu.Lock()
			b.step = 0
			b.mu.Unlock()
			continue
		}
		gone := errors.Is(err, ErrUnknownTag)
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

// publish makes a fetched allocation the next (or first) segment and wakes
// the waiters.
func (b *buffer) publish(alloc Allocation, latency time.Duration) {
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
	b.step = size
	b.minStep = alloc.TagStep
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
// one to the store. It runs on Close, after all loaders have stopped.
func (b *buffer) giveBack(ctx context.Context) error {
	cur, nxt := b.cur.Load(), b.next.Load()
	if cur == nil {
		return nil
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
		return nil
	}
	ok, err := b.a.store.GiveBack(ctx, b.tag, last.end, first)
	if err != nil {
		return fmt.Errorf("segment: giving back %d..%d of tag %q: %w", first, last.end-1, b.tag, err)
	}
	b.a.log.Debug("segment: give back", "tag", b.tag, "first", first, "end", last.end, "done", ok)
	return nil
}

// wakeAll wakes the requests waiting on b. b.mu must be held.
func (b *buffer) wakeAll() {
	if b.wake != nil {
		close(b.wake)
		b.wake = nil
	}
}
