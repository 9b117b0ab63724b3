package segment

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/dispenser-dev/dispenser/tagmodel"
)

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
			if a.ctx.Err() != nil { // closing: not a busy store
				return nil, ErrClosed
			}
			return nil, fmt.Errorf("%w: looking up tag %q: too many lookups at once", ErrUnavailable, tag)
		}
		t, err := a.store.Tag(lctx, tag)
		if errors.Is(err, tagmodel.ErrUnknownTag) && a.autoCreateStep > 0 {
			t, err = a.autoCreate(lctx, tag)
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
// AutoCreateMax tags already (then ErrUnknownTag, logged once), and
// returns it (empty: a tag of the defaults). A tag another worker created
// first is no error: it is read again, with its settings. One the store
// refuses as existing but does not know (a Leaf table whose collation
// ignores case holds the name in another case) is ErrUnknownTag, so that
// it is remembered as unknown rather than tried again on every request.
func (a *Allocator) autoCreate(ctx context.Context, tag string) (tagmodel.Tag, error) {
	bounded := a.autoCreateMax >= 0
	if bounded && a.autoCreated.Add(1) > int64(a.autoCreateMax) {
		a.autoCreated.Add(-1)
		if !a.autoCreateFull.Swap(true) {
			a.log.Warn("segment: not creating tags on first use any more: this worker created the most it may (--auto-create-max); create them with the admin commands",
				"tag", tag, "max", a.autoCreateMax)
		}
		return tagmodel.Tag{}, fmt.Errorf("%w %q", tagmodel.ErrUnknownTag, tag)
	}
	err := a.store.(tagmodel.Admin).CreateTag(ctx, tagmodel.Tag{Name: tag, Step: a.autoCreateStep, MaxID: 1, Description: "created on first use"})
	if err != nil && bounded {
		a.autoCreated.Add(-1) // counts only the tags this allocator created
	}
	switch {
	case err == nil:
		a.log.Info("segment: created tag on first use", "tag", tag, "step", a.autoCreateStep)
	case errors.Is(err, tagmodel.ErrTagExists):
		return a.store.Tag(ctx, tag) // another worker created it first
	}
	return tagmodel.Tag{}, err
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
