package mysql

import (
	"context"
	"database/sql"
	"errors"
	"fmt"

	"github.com/dispenser-dev/dispenser/segment"
)

// ReadRegions implements segment.RegionStore: the row of dispenser_region.
func (s *Store) ReadRegions(ctx context.Context) (segment.Regions, bool, error) {
	var r segment.Regions
	err := s.db.QueryRowContext(ctx, "SELECT regions, region FROM dispenser_region WHERE id = 1").Scan(&r.Count, &r.Region)
	if errors.Is(err, sql.ErrNoRows) {
		return segment.Regions{}, false, nil
	}
	if err != nil {
		return segment.Regions{}, false, fmt.Errorf("mysql: regions: %w", err)
	}
	return r, true, nil
}

// CreateRegions implements segment.RegionStore.
func (s *Store) CreateRegions(ctx context.Context, r segment.Regions) error {
	res, err := s.db.ExecContext(ctx, "INSERT IGNORE INTO dispenser_region (id, regions, region) VALUES (1, ?, ?)", r.Count, r.Region)
	if err != nil {
		return fmt.Errorf("mysql: regions: %w", err)
	}
	if n, err := res.RowsAffected(); err != nil {
		return fmt.Errorf("mysql: regions: %w", err)
	} else if n == 0 {
		return fmt.Errorf("mysql: regions: %w", segment.ErrTagExists)
	}
	return nil
}
