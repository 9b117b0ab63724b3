package kv

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/dispenser-dev/dispenser/internal/kvbucket"
	"github.com/dispenser-dev/dispenser/tagmodel"
)

// A period of a tag with a reset period is a key of its own, its period
// name (tag=KEY; '=' is a valid key character and no tag's), whose value
// is a tag's with "period_end", the end of its period:
//
//	{"max_id":1011,"step":10,"description":"","period_end":"2026-11-25T00:00:00Z","update_time":"…"}
//
// Unlike a tag's, a missing period key is a new period: its first fetch
// creates it from the tag's max_id and step, by a write on revision 0,
// which fails if the key has any message; a delete marker (a period
// pruned, or deleted by hand) is therefore never written over.

// fetchPeriod fetches a segment of the period name (tag's period key),
// creating its key if missing.
func (s *Store) fetchPeriod(ctx context.Context, name, tag, key string, step int64) (tagmodel.Allocation, error) {
	tv, _, err := s.read(ctx, tag)
	if errors.Is(err, tagmodel.ErrUnknownTag) {
		// A missing tag key means "deleted" only in a bucket that still
		// holds what it held.
		if herr := s.guard.CheckHeld(ctx); herr != nil {
			err = herr
		}
	}
	if err != nil {
		return tagmodel.Allocation{}, err
	}
	p, err := tv.tag(tag).PeriodOfKey(key)
	if err != nil {
		return tagmodel.Allocation{}, err
	}
	for range 3 {
		a, err := s.fetchKey(ctx, name, step, &tv)
		if !errors.Is(err, tagmodel.ErrUnknownTag) {
			return a, err
		}
		// The key is missing, or has a delete marker.
		if tagmodel.PeriodExpired(p.End, s.now(), tv.RetentionDays) {
			return tagmodel.Allocation{}, fmt.Errorf("%w: the period ended %s, more than %d days ago by this worker's clock, and has no key (pruned or never used); its numbers are not started again",
				tagmodel.ErrPeriodExpired, p.End.UTC().Format(time.RFC3339), cmp.Or(tv.RetentionDays, tagmodel.DefaultRetentionDays))
		}
		// A missing key is a new period only in a bucket that still
		// holds what it held.
		if err := s.guard.CheckHeld(ctx); err != nil {
			return tagmodel.Allocation{}, err
		}
		n := step
		if n <= 0 {
			n = tv.Step
		}
		if n <= 0 {
			return tagmodel.Allocation{}, fmt.Errorf("%w: the tag's stored step %d is not positive", tagmodel.ErrInvalidStep, tv.Step)
		}
		if tv.MaxID > math.MaxInt64-n {
			return tagmodel.Allocation{}, fmt.Errorf("%w: max_id would overflow int64", tagmodel.ErrExhausted)
		}
		end := p.End.UTC()
		v := value{MaxID: tv.MaxID + n, Step: tv.Step, PeriodEnd: &end, UpdateTime: time.Now().UTC()}
		b, err := json.Marshal(v)
		if err != nil {
			return tagmodel.Allocation{}, err
		}
		base := s.guard.Seen()
		rev, err := s.kv.Update(ctx, name, b, 0)
		if err == nil {
			if err := s.guard.CheckWrite(ctx, base, rev); err != nil {
				return tagmodel.Allocation{}, err
			}
			s.remember(name, entry{v, rev})
			return tagmodel.Allocation{Start: tv.MaxID, End: v.MaxID, TagStep: tv.Step}, nil
		}
		if !kvbucket.Conflict(err) {
			return tagmodel.Allocation{}, err
		}
		e, err := kvbucket.Latest(ctx, s.kv, name)
		if err != nil {
			return tagmodel.Allocation{}, err
		}
		if e != nil && e.Operation() != jetstream.KeyValuePut {
			return tagmodel.Allocation{}, fmt.Errorf("%w: the period's key in bucket %q was %s at %s (pruned, or nats kv del), and with it the record of the numbers it handed out; "+
				"they are not started again", tagmodel.ErrTagDeleted, s.kv.Bucket(), kvbucket.MarkerVerb(e.Operation()), e.Created().UTC().Format(time.RFC3339Nano))
		}
		// Another worker created it first: fetch from it.
	}
	return tagmodel.Allocation{}, fmt.Errorf("kv: the period's key kept appearing and vanishing")
}

// PrunePeriods deletes the keys of periods that ended more than their
// tag's retention ago by the Store's clock (Settings.Now), and returns how
// many it deleted. It deletes, not purges: each key keeps its delete
// marker, so the period is never created again (a fetch answers
// tagmodel.ErrPeriodExpired, or tagmodel.ErrTagDeleted). The periods of a
// deleted tag are kept tagmodel.DefaultRetentionDays. It reads every key of
// the bucket: call it no more often than periods end (hourly is plenty).
func (s *Store) PrunePeriods(ctx context.Context) (int, error) {
	w, err := s.kv.WatchAll(ctx, jetstream.IgnoreDeletes())
	if err != nil {
		return 0, fmt.Errorf("kv: prune periods: %w", err)
	}
	defer w.Stop()
	retention := map[string]int{} // tag → retention days
	type period struct {
		key, tag string
		end      time.Time
	}
	var periods []period
	for done := false; !done; {
		select {
		case e, ok := <-w.Updates():
			switch {
			case !ok:
				return 0, fmt.Errorf("kv: prune periods: watcher stopped: %w", cmp.Or(ctx.Err(), errors.New("subscription closed")))
			case e == nil:
				done = true
				continue
			}
			var v value
			if json.Unmarshal(e.Value(), &v) != nil {
				continue // not ours
			}
			if tag, _, ok := tagmodel.SplitPeriodName(e.Key()); ok && v.PeriodEnd != nil {
				periods = append(periods, period{e.Key(), tag, *v.PeriodEnd})
			} else if tagmodel.ValidTag(e.Key()) {
				retention[e.Key()] = v.RetentionDays
			}
		case <-ctx.Done():
			return 0, fmt.Errorf("kv: prune periods: %w", ctx.Err())
		}
	}
	now, n := s.now(), 0
	for _, p := range periods {
		if !tagmodel.PeriodExpired(p.end, now, retention[p.tag]) {
			continue
		}
		if err := s.kv.Delete(ctx, p.key); err != nil {
			return n, fmt.Errorf("kv: prune periods: delete %q: %w", p.key, err)
		}
		s.forget(p.key)
		n++
	}
	return n, nil
}
