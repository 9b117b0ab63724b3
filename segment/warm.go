package segment

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/dispenser-dev/dispenser/tagmodel"
)

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
