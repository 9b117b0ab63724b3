package kv

import (
	"context"
	"encoding/json"
	"fmt"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/dispenser-dev/dispenser/internal/kvbucket"
	"github.com/dispenser-dev/dispenser/tagmodel"
)

// regionsKey holds the bucket's region settings (tagmodel.Regions) as
// JSON, {"regions":3,"region":1}; no tag has this name (a dot is not
// allowed in tags).
const regionsKey = "dispenser.regions"

// ReadRegions implements tagmodel.RegionStore. A deleted or purged record
// is an error: the bucket's region is unknown, and guessing could hand out
// another region's IDs.
func (s *Store) ReadRegions(ctx context.Context) (tagmodel.Regions, bool, error) {
	e, err := kvbucket.Latest(ctx, s.kv, regionsKey)
	if err != nil {
		return tagmodel.Regions{}, false, fmt.Errorf("kv: regions: %w", err)
	}
	if e == nil {
		return tagmodel.Regions{}, false, nil
	}
	if e.Operation() != jetstream.KeyValuePut {
		return tagmodel.Regions{}, false, fmt.Errorf("%w: key %q of bucket %q was %s: the bucket's region is unknown; "+
			"put it back (nats kv put %s %s '{\"regions\":R,\"region\":N}')", tagmodel.ErrRegionMismatch, regionsKey, s.kv.Bucket(),
			kvbucket.MarkerVerb(e.Operation()), s.kv.Bucket(), regionsKey)
	}
	var r tagmodel.Regions
	if err := json.Unmarshal(e.Value(), &r); err != nil {
		return tagmodel.Regions{}, false, fmt.Errorf("%w: key %q of bucket %q: %v", tagmodel.ErrRegionMismatch, regionsKey, s.kv.Bucket(), err)
	}
	return r, true, nil
}

// CreateRegions implements tagmodel.RegionStore.
func (s *Store) CreateRegions(ctx context.Context, r tagmodel.Regions) error {
	data, err := json.Marshal(r)
	if err != nil {
		return err
	}
	// Revision 0: fails if the key has any message, a marker included.
	if _, err := s.kv.Update(ctx, regionsKey, data, 0); err != nil {
		if kvbucket.Conflict(err) {
			return fmt.Errorf("kv: regions: %w", tagmodel.ErrTagExists)
		}
		return fmt.Errorf("kv: regions: %w", err)
	}
	return nil
}
