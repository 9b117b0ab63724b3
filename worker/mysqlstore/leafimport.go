package mysqlstore

import (
	"context"
	"errors"
	"fmt"
	"math"
	"sort"

	"github.com/dispenser-dev/dispenser/tagmodel"
)

// raiser moves a tag's max_id up to at least a floor (segment/postgres and
// segment/mysql have it).
type raiser interface {
	FetchAbove(ctx context.Context, tag string, floor, step int64) (tagmodel.Allocation, int64, error)
}

// LeafRow is a row of Leaf's leaf_alloc, Leaf's columns only.
type LeafRow struct {
	Name, Description string
	MaxID, Step       int64
}

// ReadLeafRows reads every row of leaf_alloc at dsn, in name order (for
// `dispenser tags import`).
func ReadLeafRows(ctx context.Context, dsn string) ([]LeafRow, error) {
	db, err := Connect(ctx, dsn)
	if err != nil {
		return nil, err
	}
	defer db.Close()
	rs, err := db.QueryContext(ctx, "SELECT biz_tag, max_id, step, COALESCE(description, '') FROM leaf_alloc")
	if err != nil {
		return nil, fmt.Errorf("reading leaf_alloc: %w", err)
	}
	defer rs.Close()
	var rows []LeafRow
	for rs.Next() {
		var r LeafRow
		if err := rs.Scan(&r.Name, &r.MaxID, &r.Step, &r.Description); err != nil {
			return nil, fmt.Errorf("reading leaf_alloc: %w", err)
		}
		rows = append(rows, r)
	}
	if err := rs.Err(); err != nil {
		return nil, fmt.Errorf("reading leaf_alloc: %w", err)
	}
	sort.Slice(rows, func(i, j int) bool { return rows[i].Name < rows[j].Name })
	return rows, nil
}

// ImportLeafRow imports one Leaf row into the store and says what it did:
// a tag missing there is created starting at Leaf's max_id + margin; an
// existing one whose max_id is lower is raised to at least that; one
// already higher is kept. Nothing is ever lowered.
func ImportLeafRow(ctx context.Context, st tagmodel.Store, admin tagmodel.Admin, r LeafRow, margin int64) (string, error) {
	if err := tagmodel.CheckTag(r.Name); err != nil {
		return "", err
	}
	if r.MaxID < 1 || r.MaxID > math.MaxInt64-margin {
		return "", fmt.Errorf("Leaf's max_id %d plus the margin %d is not in 1..2^63-1", r.MaxID, margin)
	}
	start := r.MaxID + margin
	t, err := st.Tag(ctx, r.Name)
	switch {
	case errors.Is(err, tagmodel.ErrUnknownTag):
		err := admin.CreateTag(ctx, tagmodel.Tag{Name: r.Name, Step: r.Step, MaxID: start, Description: r.Description})
		if errors.Is(err, tagmodel.ErrTagExists) {
			return "", fmt.Errorf("created meanwhile by someone else: run the import again")
		}
		if err != nil {
			return "", err
		}
		return fmt.Sprintf("created, first ID %d (Leaf's max_id %d + margin %d), step %d", start, r.MaxID, margin, r.Step), nil
	case err != nil:
		return "", err
	case t.MaxID >= start:
		return fmt.Sprintf("kept: next ID %d is not below %d (Leaf's max_id %d + margin %d)", t.MaxID, start, r.MaxID, margin), nil
	}
	rs, ok := st.(raiser)
	if !ok {
		return "", fmt.Errorf("exists with next ID %d, below %d (Leaf's max_id %d + margin %d), and this store cannot raise it", t.MaxID, start, r.MaxID, margin)
	}
	// max_id becomes greatest(max_id, start) + 1: at least start, never
	// lower than it was (the one ID in between is skipped).
	a, before, err := rs.FetchAbove(ctx, r.Name, start, 1)
	if err != nil {
		return "", err
	}
	return fmt.Sprintf("raised: next ID %d, was %d (Leaf's max_id %d + margin %d)", a.End, before, r.MaxID, margin), nil
}
