package snowflake

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/dispenser-dev/dispenser/internal/kvbucket"
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

// checkSiblings refuses (ErrLayoutMismatch) to create bucket while a
// bucket named prefix+K (K a number: another region's bucket,
// NodeSettings.Siblings) records another layout: with other region bits,
// the regions' worker IDs overlap (region 0 of 1 bit holds 0..511, region
// 1 of 2 bits 256..511), and their buckets know nothing of each other. A
// sibling that records no layout yet has issued nothing.
//
// Safety argument: a region's layout is recorded when its bucket is
// created and never changes (checkEpoch), and every region's bucket is
// created after this check found the others' layouts equal to its own;
// so all regions' buckets record one layout, and their worker IDs are
// apart by their region bits. Two regions' first workers that create
// their buckets at the same moment may both pass before either records
// its layout: the peer check compares the region settings of running
// peers (docs/regions.md).
func checkSiblings(ctx context.Context, js jetstream.JetStream, prefix, bucket string, layout Layout) error {
	siblings, err := regionBuckets(ctx, js, prefix, bucket)
	if err != nil {
		return err
	}
	for _, name := range siblings {
		kv, err := js.KeyValue(ctx, name)
		if err != nil {
			return fmt.Errorf("snowflake: read the lease bucket %q of another region: %w", name, err)
		}
		e, err := kvbucket.Latest(ctx, kv, configKey)
		if err != nil {
			return fmt.Errorf("snowflake: read the lease bucket %q of another region: %w", name, err)
		}
		if e == nil || e.Operation() != jetstream.KeyValuePut {
			continue
		}
		var c configRecord
		if err := json.Unmarshal(e.Value(), &c); err != nil {
			return fmt.Errorf("%w: bucket %q key %q: %v", ErrLayoutMismatch, name, configKey, err)
		}
		if got := c.Layout.layout(); !got.Same(layout) {
			return fmt.Errorf("%w: bucket %q of region %d was created for snowflake layout %s, this region's %q would be %s: "+
				"their worker IDs would overlap; every region must use the same --region-bits (docs/regions.md)",
				ErrLayoutMismatch, name, c.Region, got, bucket, layout.orDefault())
		}
	}
	return nil
}

// checkNoRegionBuckets refuses (ErrRegionBuckets) to lease from bucket, a
// bucket without region bits, while a bucket named prefix and a number
// exists (NodeSettings.RegionBuckets): a region's bucket, whose worker
// IDs bucket holds too. Its workers may hold them now, or have issued
// above bucket's bounds, which bucket does not know: region bits cannot
// be turned off again, and a worker without them is no longer welcome
// once a region's bucket was created (the other way round,
// predecessorFloor).
func checkNoRegionBuckets(ctx context.Context, js jetstream.JetStream, prefix, bucket string) error {
	found, err := regionBuckets(ctx, js, prefix, bucket)
	if err != nil {
		return err
	}
	if len(found) > 0 {
		return fmt.Errorf("%w: %q (and %d more) holds worker IDs of bucket %q: "+
			"configure this worker's --region and --region-bits as its region's (docs/regions.md)",
			ErrRegionBuckets, found[0], len(found)-1, bucket)
	}
	return nil
}

// regionBuckets lists the key-value buckets named prefix followed by a
// region number (the regions' lease buckets), bucket left out.
func regionBuckets(ctx context.Context, js jetstream.JetStream, prefix, bucket string) ([]string, error) {
	names := js.KeyValueStoreNames(ctx)
	var found []string
	for name := range names.Name() {
		k, ok := strings.CutPrefix(name, prefix)
		if _, err := strconv.Atoi(k); ok && err == nil && name != bucket {
			found = append(found, name)
		}
	}
	if err := names.Error(); err != nil {
		return nil, fmt.Errorf("snowflake: list the regions' lease buckets: %w", err)
	}
	return found, nil
}
