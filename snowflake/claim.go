package snowflake

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/dispenser-dev/dispenser/internal/kvbucket"
	"github.com/dispenser-dev/dispenser/lease"
)

// Claiming a worker ID: the passes over the lease bucket and the
// compare-and-swap of one candidate (the safety argument is the package
// doc's, and package lease's).

// claim is a won claim.
type claim struct {
	id      int
	rev     uint64
	rec     leaseRecord
	floorMs int64 // highest timestamp a previous holder may have used; -1: none
	mono    time.Duration
}

// candidate is a worker ID worth trying.
type candidate struct {
	id   int
	rev  uint64 // 0: no message under the key
	prev *leaseRecord
	// deleted: the key holds a delete or purge marker; prev is derived
	// from it.
	deleted bool
	// floor is the bucket's floor (configRecord.Floor) for a never used
	// key: its IDs may overlap a predecessor bucket's.
	floor time.Time
}

// claimPasses bounds how often claim reads the bucket again after losing
// races (keys written while it read them may be missing from its snapshot).
const claimPasses = 3

// claim takes a worker ID: first a claimable one last held by our instance
// name, then a never used one, then a released one, then an expired one,
// then a deleted one whose margin has passed. Races are settled by Update
// on the revision read (revision 0 for a key without any message); a lost
// race moves on to the next candidate.
func (w *Node) claim(ctx context.Context) (claim, error) {
	for pass := 1; ; pass++ {
		c, lost, err := w.claimPass(ctx)
		if err == nil || lost == 0 || pass == claimPasses || !errors.Is(err, ErrNoWorkerID) {
			return c, err
		}
	}
}

// claimPass is one pass of claim over a snapshot of the bucket. It reports
// how many races it lost.
func (w *Node) claimPass(ctx context.Context) (_ claim, lost int, _ error) {
	if err := w.checkBucket(ctx); err != nil {
		return claim{}, 0, err
	}
	v, conf, err := w.readBucket(ctx)
	if err != nil {
		return claim{}, 0, err
	}
	slots := v.slots
	// The longest lease known bounds how far ahead of a deleted key's
	// marker its last holder may have issued.
	longest := max(w.cfg.Lease, conf.maxLease())
	for _, s := range slots {
		if !s.bad && !s.deleted {
			longest = max(longest, s.rec.lease())
		}
	}
	now := w.cfg.Now()
	var own, free, released, expired, deleted []candidate
	var live, waiting int
	var soonest time.Time
	// Only the IDs of the layout's worker bits (a higher one would run
	// into the timestamp's bits), and of them only our region's.
	first, last := w.gen.layout.RegionWorkerIDs(w.cfg.Region)
	for id := first; id <= last; id++ {
		s, ok := slots[id]
		switch {
		case !ok:
			free = append(free, candidate{id: id, floor: conf.Floor})
			continue
		case s.bad:
			w.log.Warn("snowflake: skipping worker ID with an unreadable lease value", "worker", id, "bucket", w.cfg.Bucket)
			live++
			continue
		case s.deleted:
			unknown := s.rev <= conf.MaxLeaseSince
			s.rec = deletedRecord(id, s.at, deletedMargin(longest, unknown), longest, w.cfg.Epoch)
		case !s.rec.Epoch.Equal(w.cfg.Epoch):
			w.log.Error("snowflake: skipping worker ID whose lease has another epoch", "worker", id,
				"epoch", s.rec.Epoch, "bucket", w.cfg.Bucket)
			live++
			continue
		}
		if at := s.rec.claimableAt(); !now.After(at) {
			live++
			if s.deleted {
				waiting++
			}
			if soonest.IsZero() || at.Before(soonest) {
				soonest = at
			}
			continue
		}
		c := candidate{id: id, rev: s.rev, prev: &s.rec, deleted: s.deleted}
		switch {
		case s.deleted:
			deleted = append(deleted, c)
		case s.rec.Instance == w.cfg.Instance:
			own = append(own, c)
		case s.rec.Released:
			released = append(released, c)
		default:
			expired = append(expired, c)
		}
	}
	// Spread concurrent claimants over the IDs.
	for _, cs := range [][]candidate{free, released, expired, deleted} {
		w.cfg.shuffle(len(cs), func(i, j int) { cs[i], cs[j] = cs[j], cs[i] })
	}
	for _, c := range slices.Concat(own, free, released, expired, deleted) {
		cl, err := w.try(ctx, c)
		if err == nil {
			return cl, lost, nil
		}
		if kvbucket.Conflict(err) || errors.Is(err, lease.ErrNotClaimable) { // the latter: the wall clock stepped back
			w.log.Debug("snowflake: lost a race for a worker ID", "worker", c.id, "error", err)
			lost++
			continue
		}
		return claim{}, lost, fmt.Errorf("snowflake: claim worker ID %d: %w", c.id, err)
	}
	var ofWhich string
	if waiting > 0 {
		ofWhich = fmt.Sprintf(" (%d of them deleted or purged keys, claimable a margin after their deletion)", waiting)
	}
	return claim{}, lost, fmt.Errorf("%w: %d live leases%s in bucket %q, %d lost races%s", ErrNoWorkerID, live, ofWhich, w.cfg.Bucket, lost, suffix(soonest))
}

func suffix(soonest time.Time) string {
	if soonest.IsZero() {
		return ""
	}
	return "; the first may be taken over after " + soonest.Format(TimeLayout)
}

// try claims one candidate.
func (w *Node) try(ctx context.Context, c candidate) (claim, error) {
	floorMs := int64(-1)
	var prev lease.Terms
	if c.prev != nil {
		floorMs = c.prev.Bound.UnixMilli() - w.gen.epochMs
		prev = c.prev.terms()
	} else if !c.floor.IsZero() {
		floorMs = c.floor.UnixMilli() - w.gen.epochMs
	}
	var rec leaseRecord
	g, err := w.terms.Claim(ctx, w.kv, workerKey(c.id), c.rev, prev, func(now time.Time) ([]byte, error) {
		nowMs := now.UnixMilli() - w.gen.epochMs
		rec = w.newRecord(c.id, now, max(nowMs, floorMs)+w.cfg.Lease.Milliseconds())
		return json.Marshal(rec)
	})
	if err != nil {
		return claim{}, err
	}
	if c.deleted {
		w.log.Warn("snowflake: claimed a worker ID whose key had been deleted or purged; starting above a floor derived from the marker",
			"worker", c.id, "deleted", c.prev.Heartbeat, "floor", c.prev.Bound)
	}
	return claim{id: c.id, rev: g.Rev, rec: rec, floorMs: floorMs, mono: g.Mono}, nil
}

// newRecord returns our lease value written at now with the given bound.
func (w *Node) newRecord(id int, now time.Time, boundMs int64) leaseRecord {
	now = now.UTC().Round(0)
	return leaseRecord{
		Version:   recordVersion,
		Worker:    id,
		Instance:  w.cfg.Instance,
		Session:   w.session,
		Epoch:     w.cfg.Epoch,
		LeaseMS:   w.cfg.Lease.Milliseconds(),
		Heartbeat: now,
		Expires:   now.Add(w.cfg.Lease),
		Bound:     w.gen.msTime(boundMs),
	}
}
