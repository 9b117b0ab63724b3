package mysql

import (
	"context"
	"database/sql"
	"errors"
	"fmt"

	"github.com/dispenser-dev/dispenser/tagmodel"
)

// Per-region mode is refused on this store. Its tags are rows of Leaf's
// leaf_alloc, and dispenser cannot know whether a Leaf serves the table:
// Leaf hands out a row's values v as they are, a region N of R as v×R+N,
// so the two would hand out the same IDs (TestPerRegionRefusedBesideLeaf:
// ID 31 to both). So the store records one region only (CreateRegions),
// and a record of per-region mode written by an earlier version refuses
// every worker (ReadRegions): its tags' IDs are residues that the values
// Leaf or a worker of one region hands out would meet. Per-region stores
// are PostgreSQL databases or KV buckets (docs/migrate-from-leaf.md).

// ReadRegions implements tagmodel.RegionStore: the row of dispenser_region.
// A record of per-region mode is an error (tagmodel.ErrInvalidArgument).
func (s *Store) ReadRegions(ctx context.Context) (tagmodel.Regions, bool, error) {
	var r tagmodel.Regions
	err := s.db.QueryRowContext(ctx, "SELECT regions, region FROM dispenser_region WHERE id = 1").Scan(&r.Count, &r.Region)
	if errors.Is(err, sql.ErrNoRows) {
		return tagmodel.Regions{}, false, nil
	}
	if err != nil {
		return tagmodel.Regions{}, false, fmt.Errorf("mysql: regions: %w", err)
	}
	if r.Count > 1 {
		return tagmodel.Regions{}, false, fmt.Errorf("%w: mysql: dispenser_region records %s, per-region mode, on leaf_alloc, "+
			"which a Leaf may serve: its values would meet the region's IDs; serve per-region mode from a PostgreSQL "+
			"database or a KV bucket per region (move the tags with dispenser tags import --from-mysql-url), "+
			"and this table as one region only after Leaf and every ID handed out here are past the region's (docs/migrate-from-leaf.md)",
			tagmodel.ErrInvalidArgument, r)
	}
	return r, true, nil
}

// CreateRegions implements tagmodel.RegionStore. Per-region settings are
// refused (tagmodel.ErrInvalidArgument).
func (s *Store) CreateRegions(ctx context.Context, r tagmodel.Regions) error {
	if r.Count > 1 {
		return fmt.Errorf("%w: mysql: per-region mode (%s) on leaf_alloc: a Leaf serving this table hands out a row's values v "+
			"as IDs, the region v×%d+%d: the same IDs; dispenser cannot know whether a Leaf serves it, so per-region mode "+
			"needs a store of its own per region: --postgres-url or the KV store (docs/migrate-from-leaf.md)",
			tagmodel.ErrInvalidArgument, r, r.Count, r.Region)
	}
	res, err := s.db.ExecContext(ctx, "INSERT IGNORE INTO dispenser_region (id, regions, region) VALUES (1, ?, ?)", r.Count, r.Region)
	if err != nil {
		return fmt.Errorf("mysql: regions: %w", err)
	}
	if n, err := res.RowsAffected(); err != nil {
		return fmt.Errorf("mysql: regions: %w", err)
	} else if n == 0 {
		return fmt.Errorf("mysql: regions: %w", tagmodel.ErrTagExists)
	}
	return nil
}
