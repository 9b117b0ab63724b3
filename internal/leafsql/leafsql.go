// Package leafsql runs Meituan Leaf's own segment-mode statements on a
// leaf_alloc table in MySQL, as a Leaf server does, so that tests can put
// a Leaf beside dispenser on one table. The statements are Leaf's
// IDAllocMapper's, and the transaction is its IDAllocDaoImpl's: the UPDATE
// and the SELECT in one transaction, committed after the SELECT.
package leafsql

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
)

// Leaf's statements, word for word.
const (
	updateMaxID             = "UPDATE leaf_alloc SET max_id = max_id + step WHERE biz_tag = ?"
	updateMaxIDByCustomStep = "UPDATE leaf_alloc SET max_id = max_id + ? WHERE biz_tag = ?"
	getLeafAlloc            = "SELECT biz_tag, max_id, step FROM leaf_alloc WHERE biz_tag = ?"
)

// ErrNoTag means the tag has no row (Leaf's selectOne returns null).
var ErrNoTag = errors.New("leafsql: no such tag")

// Fetch takes a segment of tag as Leaf does and returns it as Leaf uses
// it, [max_id - step, max_id): with customStep 0, Leaf's
// updateMaxIdAndGetLeafAlloc (the tag's own step); with customStep > 0,
// updateMaxIdByCustomStepAndGetLeafAlloc (Leaf's dynamic step).
func Fetch(ctx context.Context, db *sql.DB, tag string, customStep int64) (start, end int64, err error) {
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return 0, 0, fmt.Errorf("leafsql: %w", err)
	}
	defer tx.Rollback()
	if customStep > 0 {
		_, err = tx.ExecContext(ctx, updateMaxIDByCustomStep, customStep, tag)
	} else {
		_, err = tx.ExecContext(ctx, updateMaxID, tag)
	}
	if err != nil {
		return 0, 0, fmt.Errorf("leafsql: update %q: %w", tag, err)
	}
	var key string
	var maxID, step int64
	err = tx.QueryRowContext(ctx, getLeafAlloc, tag).Scan(&key, &maxID, &step)
	if errors.Is(err, sql.ErrNoRows) {
		return 0, 0, fmt.Errorf("%w %q", ErrNoTag, tag)
	}
	if err != nil {
		return 0, 0, fmt.Errorf("leafsql: select %q: %w", tag, err)
	}
	if err := tx.Commit(); err != nil {
		return 0, 0, fmt.Errorf("leafsql: commit %q: %w", tag, err)
	}
	if customStep > 0 {
		step = customStep
	}
	return maxID - step, maxID, nil
}
