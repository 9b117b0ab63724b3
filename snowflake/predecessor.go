package snowflake

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// predecessorFloor returns the highest bound recorded in the predecessor
// bucket (NodeSettings.Predecessor), read by the worker that creates a
// bucket whose worker IDs overlap the predecessor's: zero if there is no
// such bucket. It refuses (ErrPredecessorInUse) a predecessor whose floor
// it cannot know: a lease still held (not released, and not claimable by
// now), a deleted or unreadable key.
//
// Safety argument: every ID a holder of the predecessor issued lies at or
// below the bound recorded there before it was issued (the package doc),
// and a holder that is no longer held issues nothing more; so the highest
// bound read covers every ID the predecessor's workers issued, and a new
// bucket's workers, starting above it (configRecord.Floor), meet none of
// them, whatever their clocks. A worker started on the predecessor after
// the floor was taken is what the peer check refuses (docs/regions.md).
func predecessorFloor(ctx context.Context, js jetstream.JetStream, bucket string, maxID int, now time.Time) (time.Time, error) {
	kv, err := js.KeyValue(ctx, bucket)
	if errors.Is(err, jetstream.ErrBucketNotFound) {
		return time.Time{}, nil
	}
	if err != nil {
		return time.Time{}, fmt.Errorf("snowflake: read the lease bucket %q used before this one: %w", bucket, err)
	}
	v, err := snapshot(ctx, kv, maxID)
	if err != nil {
		return time.Time{}, fmt.Errorf("snowflake: read the lease bucket %q used before this one: %w", bucket, err)
	}
	var floor time.Time
	for id, s := range v.slots {
		var why string
		switch {
		case s.bad:
			why = "holds an unreadable value"
		case s.deleted:
			why = "was deleted or purged, so its last bound is unknown"
		case !s.rec.Released && !now.After(s.rec.claimableAt()):
			why = fmt.Sprintf("is held by %q (claimable after %s)", s.rec.Instance, s.rec.claimableAt().Format(TimeLayout))
		}
		if why != "" {
			return time.Time{}, fmt.Errorf("%w: worker ID %d of bucket %q %s: its IDs overlap this bucket's; "+
				"stop every worker of %q (the workers without region bits) and start again once its leases are released or expired",
				ErrPredecessorInUse, id, bucket, why, bucket)
		}
		if s.rec.Bound.After(floor) {
			floor = s.rec.Bound
		}
	}
	return floor, nil
}
