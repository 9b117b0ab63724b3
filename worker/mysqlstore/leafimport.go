package mysqlstore

import (
	"context"
	"errors"
	"fmt"
	"math"
	"sort"

	driver "github.com/go-sql-driver/mysql"

	"github.com/dispenser-dev/dispenser/tagmodel"
)

// raiser moves a tag's max_id up to at least a floor (segment/postgres and
// segment/mysql have it).
type raiser interface {
	FetchAbove(ctx context.Context, tag string, floor, step int64) (tagmodel.Allocation, int64, error)
}

// LeafRow is a row of Leaf's leaf_alloc, Leaf's columns only, and the
// greatest max_id of its periods' rows (dispenser_period), if the tag has
// a reset period and dispenser served it from this table.
type LeafRow struct {
	Name, Description string
	MaxID, Step       int64
	// PeriodsMaxID is the greatest max_id of the tag's periods (0: none).
	// A tag with a reset period hands out its numbers from its periods'
	// rows, each starting at the tag's max_id, which stays where it was:
	// the numbers handed out lie below PeriodsMaxID, not below MaxID.
	PeriodsMaxID int64
}

// leafRowsSQL reads leaf_alloc's rows with the greatest max_id of their
// periods; leafRowsNoPeriods is for a table of Leaf without dispenser's
// tables (no periods).
const (
	leafRowsSQL = `SELECT l.biz_tag, l.max_id, l.step, COALESCE(l.description, ''),
COALESCE((SELECT MAX(p.max_id) FROM dispenser_period p WHERE p.period_of = CAST(l.biz_tag AS BINARY)), 0)
FROM leaf_alloc l`
	leafRowsNoPeriods = "SELECT biz_tag, max_id, step, COALESCE(description, ''), 0 FROM leaf_alloc"
)

// errNoTable is MySQL's ER_NO_SUCH_TABLE.
const errNoTable = 1146

// ReadLeafRows reads every row of leaf_alloc at dsn, in name order (for
// `dispenser tags import`).
func ReadLeafRows(ctx context.Context, dsn string) ([]LeafRow, error) {
	db, err := Connect(ctx, dsn)
	if err != nil {
		return nil, err
	}
	defer db.Close()
	rs, err := db.QueryContext(ctx, leafRowsSQL)
	if me := (*driver.MySQLError)(nil); errors.As(err, &me) && me.Number == errNoTable {
		rs, err = db.QueryContext(ctx, leafRowsNoPeriods)
	}
	if err != nil {
		return nil, fmt.Errorf("reading leaf_alloc: %w", err)
	}
	defer rs.Close()
	var rows []LeafRow
	for rs.Next() {
		var r LeafRow
		if err := rs.Scan(&r.Name, &r.MaxID, &r.Step, &r.Description, &r.PeriodsMaxID); err != nil {
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
// already higher is kept. Nothing is ever lowered. Leaf's max_id is the
// greater of the row's and its periods' (r.PeriodsMaxID): a tag with a
// reset period set again on the target starts its periods at the tag's
// max_id, which must lie above every number its periods handed out.
func ImportLeafRow(ctx context.Context, st tagmodel.Store, admin tagmodel.Admin, r LeafRow, margin int64) (string, error) {
	if err := tagmodel.CheckTag(r.Name); err != nil {
		return "", err
	}
	r.MaxID = max(r.MaxID, r.PeriodsMaxID)
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
