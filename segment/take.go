package segment

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/dispenser-dev/dispenser/tagmodel"
)

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
//
// The IDs come with their Source (for a Pending: Pending.Source, after
// Wait): the caller serves them only if, after it checked again that it
// owns the tag, Source.Current still holds. Ownership checked after the
// take may be a later ownership than the one the IDs were taken under (the
// tag lost and claimed again in between); the Resets of that loss and
// claim dropped the buffer the IDs came from, which Current sees.
func (a *Allocator) TakeOwned(tag string, n int, dst []Run) ([]Run, Source, *Pending, error) {
	b := a.tags.get(tag)
	if b != nil {
		if end := b.refetchAt.Load(); end != 0 && a.now().UnixNano() >= end {
			a.reset(tag, b)
			b = a.tags.get(tag)
		}
	}
	runs, p, err := a.takeFrom(b, tag, n, dst, true)
	return runs, Source{b}, p, err
}

// Source is the buffer an owner's IDs were taken from (TakeOwned,
// Pending.Source).
type Source struct{ b *buffer }

// Current reports whether the IDs' buffer is still the tag's: no Reset
// (nor the switch window's end, nor the idle loop) dropped it since it was
// taken from. A buffer once dropped never serves again, so if Current
// holds after a check that found the tag owned, the IDs come from a buffer
// made after the Reset of that ownership's claim: from segments fetched
// after the claim. False for IDs that came from no buffer.
func (s Source) Current() bool { return s.b != nil && !s.b.dropped.Load() }

func (a *Allocator) takeNow(tag string, n int, dst []Run, owned bool) ([]Run, *Pending, error) {
	return a.takeFrom(a.tags.get(tag), tag, n, dst, owned)
}

// takeFrom is takeNow from b, tag's buffer as the tag map gave it (nil if
// it had none).
func (a *Allocator) takeFrom(b *buffer, tag string, n int, dst []Run, owned bool) ([]Run, *Pending, error) {
	if n < 1 {
		return dst, nil, fmt.Errorf("%w: %d", ErrInvalidCount, n)
	}
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

// Pending is a request that TakeNow could not serve from memory.
type Pending struct {
	a    *Allocator
	b    *buffer // nil: the tag is not known yet (an owner's Wait sets it)
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

// Source is the buffer the IDs Wait returned were taken from (see
// TakeOwned); call it after Wait.
func (p *Pending) Source() Source { return Source{p.b} }

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
	if p != nil && owned {
		p.b = b // Pending.Source
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
