package segment

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/dispenser-dev/dispenser/tagmodel"
)

// pruneInterval is how often the refresh loop asks the store to delete
// expired periods' rows (PeriodPruner): retentions are days, and a KV
// store reads its whole bucket to find them.
const pruneInterval = time.Hour

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
