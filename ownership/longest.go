package ownership

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/dispenser-dev/dispenser/internal/kvbucket"
	"github.com/dispenser-dev/dispenser/lease"
)

// deletedFloor returns the time after which the holder of a key deleted or
// purged at the server time at has stopped serving, give or take a lease of
// clock skew: at plus lease.DeletedMargin of the longest lease recorded
// (of MaxLease while the record of the longest lease is lost); and at least three MaxLease after the record was written
// anew (a holder that last renewed before then is not in it).
func (l *Leases) deletedFloor(ctx context.Context, at time.Time) (time.Time, error) {
	lr, _, ok, err := l.readLongest(ctx)
	if err != nil {
		return time.Time{}, err
	}
	longest := MaxLease
	if ok {
		longest = max(l.cfg.Lease, time.Duration(lr.LongestMS)*time.Millisecond)
	} else {
		l.log.Warn("ownership: the record of the longest lease is missing; a deleted key waits out the longest lease allowed",
			"key", LeasesKey, "max_lease", MaxLease)
	}
	floor := at.Add(lease.DeletedMargin(longest))
	if ok {
		// A holder not in the record renewed last before it was written
		// (or, once, in the round that raised the lost one), and before
		// at: it stopped within MaxLease of at and two of the record's
		// writing; one more for the clocks.
		unrecorded := at.Add(2 * MaxLease)
		if u := lr.Since.Add(3 * MaxLease); u.Before(unrecorded) {
			unrecorded = u
		}
		if unrecorded.After(floor) {
			floor = unrecorded
		}
	}
	return floor, nil
}

// readLongest reads LeasesKey: ok is false when it is missing, deleted,
// purged or unreadable; rev is the revision to update (0 for none).
func (l *Leases) readLongest(ctx context.Context) (lr leasesRecord, rev uint64, ok bool, err error) {
	e, err := l.latest(ctx, LeasesKey)
	if err != nil {
		return lr, 0, false, fmt.Errorf("ownership: read %q: %w", LeasesKey, err)
	}
	if e == nil {
		return lr, 0, false, nil
	}
	if e.Operation() != jetstream.KeyValuePut || json.Unmarshal(e.Value(), &lr) != nil || lr.Version != 1 {
		return leasesRecord{}, e.Revision(), false, nil
	}
	return lr, e.Revision(), true, nil
}

// raiseLongest makes sure LeasesKey records a lease at least as long as
// ours, by compare-and-swap on the revision read: a success proves that the
// record held it when written. A lost record is written anew, from now.
func (l *Leases) raiseLongest(ctx context.Context) (leasesRecord, error) {
	for attempt := 1; ; attempt++ {
		lr, rev, ok, err := l.readLongest(ctx)
		if err != nil {
			return lr, err
		}
		if ok && lr.LongestMS >= l.cfg.Lease.Milliseconds() {
			return lr, nil // covered: a read is proof enough, and writes nothing
		}
		if !ok {
			lost := false
			if rev != 0 {
				l.log.Error("ownership: the record of the longest lease was deleted, purged or overwritten by hand; writing it anew",
					"key", LeasesKey)
			} else if lost, err = l.purged(ctx); err != nil {
				return lr, err
			} else if lost {
				l.log.Error("ownership: the owners bucket lost its values (nats stream purge, or expired): "+
					"ordered tags without a lease are claimable only a margin from now",
					"bucket", l.kv.Bucket(), "margin", lease.DeletedMargin(MaxLease))
			}
			lr = leasesRecord{Version: 1, Since: l.cfg.Now().UTC().Round(0), Lost: lost}
		}
		lr.LongestMS = max(lr.LongestMS, l.cfg.Lease.Milliseconds())
		data, err := json.Marshal(lr)
		if err != nil {
			return lr, err
		}
		_, err = l.kv.Update(ctx, LeasesKey, data, rev)
		if err == nil {
			return lr, nil
		}
		if !kvbucket.Conflict(err) || attempt == 3 {
			return lr, fmt.Errorf("ownership: record the longest lease: %w", err)
		}
	}
}

// purged reports whether the bucket, in which LeasesKey has no message,
// has held values and holds no tag key: its stream was purged or its values
// expired. A bucket of a version before LeasesKey holds tag keys; a new one
// has held nothing. The stream is read before LeasesKey is read again: a
// record written meanwhile makes raiseLongest read it anew.
func (l *Leases) purged(ctx context.Context) (bool, error) {
	info, err := kvbucket.StreamInfo(ctx, l.kv)
	if err != nil {
		return false, fmt.Errorf("ownership: %w", err)
	}
	if info.State.LastSeq == 0 {
		return false, nil
	}
	if _, rev, _, err := l.readLongest(ctx); err != nil || rev != 0 {
		return false, err // written meanwhile: the caller's update conflicts
	}
	keys, err := l.kv.ListKeys(ctx)
	if err != nil {
		return false, fmt.Errorf("ownership: bucket %q: list keys: %w", l.kv.Bucket(), err)
	}
	defer keys.Stop()
	for k := range keys.Keys() {
		if k != LeasesKey {
			return false, nil
		}
	}
	return true, nil
}
