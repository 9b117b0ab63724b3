package kv

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/dispenser-dev/dispenser/internal/kvbucket"
	"github.com/dispenser-dev/dispenser/tagmodel"
)

// Fetch atomically advances the tag's max_id by step (the tag's own step if
// step <= 0) and returns the IDs in between. Errors: tagmodel.ErrInvalidTag,
// tagmodel.ErrInvalidStep (step above tagmodel.MaxStepLimit, or the stored
// step is not positive), tagmodel.ErrUnknownTag, tagmodel.ErrExhausted.
func (s *Store) Fetch(ctx context.Context, tag string, step int64) (tagmodel.Allocation, error) {
	if err := tagmodel.CheckName(tag); err != nil {
		return tagmodel.Allocation{}, fmt.Errorf("kv: fetch: %w", err)
	}
	if step > tagmodel.MaxStepLimit {
		return tagmodel.Allocation{}, fmt.Errorf("kv: fetch %q: %w %d: want at most %d", tag, tagmodel.ErrInvalidStep, step, tagmodel.MaxStepLimit)
	}
	if t, key, ok := tagmodel.SplitPeriodName(tag); ok {
		a, err := s.fetchPeriod(ctx, tag, t, key, step)
		if err != nil {
			return tagmodel.Allocation{}, fmt.Errorf("kv: fetch %q: %w", tag, err)
		}
		return a, nil
	}
	a, err := s.fetchKey(ctx, tag, step, nil)
	if errors.Is(err, tagmodel.ErrUnknownTag) {
		// A tag served until now is gone: a missing key means "deleted"
		// only in a bucket that still holds what it held.
		if herr := s.guard.CheckHeld(ctx); herr != nil {
			err = herr
		}
	}
	if err != nil {
		return tagmodel.Allocation{}, fmt.Errorf("kv: fetch %q: %w", tag, err)
	}
	return a, nil
}

// fetchKey advances the max_id of key, a tag's or (with its tag's value
// of) a period's, by compare-and-swap. A period takes its tag's step
// (as its default and TagStep, and stores it); a tag with a reset period
// hands out nothing from its own key.
func (s *Store) fetchKey(ctx context.Context, tag string, step int64, of *value) (tagmodel.Allocation, error) {
	var a tagmodel.Allocation
	var wrote written
	err := s.modify(ctx, tag, func(v *value, rev uint64) error {
		if of == nil && v.Reset != "" {
			return fmt.Errorf("%w: the tag has a reset period (%s): fetch its periods (%s)", tagmodel.ErrInvalidArgument, v.Reset, tagmodel.PeriodName(tag, "KEY"))
		}
		if of != nil {
			v.Step = of.Step
		}
		s.mu.Lock()
		w, ok := s.wrote[tag]
		s.mu.Unlock()
		// An older revision is a stale read (its swap fails); only a
		// later one below our write was lowered by another hand.
		if ok && rev > w.rev && v.MaxID < w.maxID {
			wrote = w
			return fmt.Errorf("%w: the key holds max_id %d (revision %d), below %d that this worker wrote (revision %d), "+
				"and no worker lowers it: someone put a lower value by hand (nats kv put) or the bucket lost writes; the tag "+
				"is not served here until its value is put back above every ID handed out (nats kv put %s %s "+
				"'{\"max_id\":N,\"step\":%d}')",
				ErrMaxIDLowered, v.MaxID, rev, wrote.maxID, wrote.rev, s.kv.Bucket(), tag, v.Step)
		}
		n := step
		if n <= 0 {
			n = v.Step
		}
		if n <= 0 {
			return fmt.Errorf("%w: the tag's stored step %d is not positive", tagmodel.ErrInvalidStep, v.Step)
		}
		if v.MaxID > math.MaxInt64-n {
			return fmt.Errorf("%w: max_id would overflow int64", tagmodel.ErrExhausted)
		}
		a = tagmodel.Allocation{Start: v.MaxID, End: v.MaxID + n, TagStep: v.Step}
		v.MaxID = a.End
		return nil
	})
	if errors.Is(err, ErrMaxIDLowered) {
		s.logOnce(tag, wrote.rev, "kv: refusing a fetch below what this worker handed out", "tag", tag, "err", err)
	}
	return a, err
}

// GiveBack sets the tag's max_id back to firstUnissued if this Store's last
// write of the tag left it at end and nobody wrote the key since (a
// compare-and-swap on that write's revision), and reports whether it did.
// A max_id that is end again after other workers fetched and gave back is
// not taken for it: the revision tells. An unknown tag, or one this Store
// has not written, reports false. firstUnissued must be in 1..end
// (tagmodel.ErrInvalidArgument).
func (s *Store) GiveBack(ctx context.Context, tag string, end, firstUnissued int64) (bool, error) {
	if err := tagmodel.CheckName(tag); err != nil {
		return false, fmt.Errorf("kv: give back: %w", err)
	}
	if err := tagmodel.CheckGiveBack(end, firstUnissued); err != nil {
		return false, fmt.Errorf("kv: give back %q: %w", tag, err)
	}
	s.mu.Lock()
	r, ok := s.last[tag]
	s.mu.Unlock()
	e := r.entry()
	if !ok || e.v.MaxID != end {
		return false, nil
	}
	// A give-back is the one write that lowers a value: it goes only to
	// the stream this Store opened. A compare-and-swap on e.rev would also
	// land in a bucket deleted and created again whose key stands at that
	// revision, and lower a max_id put back above what was handed out
	// (TestGiveBackIntoRecreatedBucket); the check after the write comes
	// too late for that. A bucket re-created between this check and the
	// write is not seen (one round trip).
	if err := s.guard.Check(ctx); err != nil {
		s.forget(tag)
		return false, fmt.Errorf("kv: give back %q: %w", tag, err)
	}
	v := e.v
	v.MaxID = firstUnissued
	// What this Store vouches for drops to firstUnissued before the write:
	// whether or not the write lands (its reply may be lost), a later read
	// at or above it is no value lowered by hand.
	s.mu.Lock()
	if w := s.wrote[tag]; w.rev <= e.rev { // else the swap below fails
		s.wrote[tag] = written{v.MaxID, e.rev}
	}
	s.mu.Unlock()
	v.UpdateTime = time.Now().UTC()
	b, err := json.Marshal(v)
	if err != nil {
		return false, fmt.Errorf("kv: give back %q: %w", tag, err)
	}
	base := s.guard.Seen()
	rev, err := s.kv.Update(ctx, tag, b, e.rev)
	if err != nil {
		s.forget(tag)
		if kvbucket.Conflict(err) {
			return false, nil // somebody wrote the key after us
		}
		return false, fmt.Errorf("kv: give back %q: %w", tag, err)
	}
	if err := s.guard.CheckWrite(ctx, base, rev); err != nil {
		s.forget(tag)
		return false, fmt.Errorf("kv: give back %q: %w", tag, err)
	}
	s.remember(tag, entry{v, rev})
	return true, nil
}
