package postgres

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/dispenser-dev/dispenser/tagmodel"
)

// regionsRow is the biz_tag of the row of leaf_alloc that records the
// table's region settings (tagmodel.Regions): max_id is the region, step
// the number of regions. No tag has this name (a dot is not allowed in
// tags), so no listing or fetch sees it.
const regionsRow = "dispenser.regions"

// ReadRegions implements tagmodel.RegionStore.
func (s *Store) ReadRegions(ctx context.Context) (tagmodel.Regions, bool, error) {
	var r tagmodel.Regions
	var region int64
	err := s.pool.QueryRow(ctx, `SELECT max_id, step FROM leaf_alloc WHERE biz_tag = $1`, regionsRow).Scan(&region, &r.Count)
	if errors.Is(err, pgx.ErrNoRows) {
		return tagmodel.Regions{}, false, nil
	}
	if err != nil {
		return tagmodel.Regions{}, false, fmt.Errorf("postgres: regions: %w", err)
	}
	r.Region = int(region)
	return r, true, nil
}

// CreateRegions implements tagmodel.RegionStore.
func (s *Store) CreateRegions(ctx context.Context, r tagmodel.Regions) error {
	tag, err := s.pool.Exec(ctx, `INSERT INTO leaf_alloc (biz_tag, max_id, step, description)
VALUES ($1, $2, $3, 'dispenser: the region settings of this table, not a tag (docs/regions.md)')
ON CONFLICT (biz_tag) DO NOTHING`, regionsRow, r.Region, r.Count)
	if err != nil {
		return fmt.Errorf("postgres: regions: %w", err)
	}
	if tag.RowsAffected() == 0 {
		return fmt.Errorf("postgres: regions: %w", tagmodel.ErrTagExists)
	}
	return nil
}
