package mysql

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/dispenser-dev/dispenser/tagmodel"
)

// A period of a tag with a reset period is a row of dispenser_period,
// named tag=KEY (tagmodel.PeriodName), with period_of (its tag) and
// period_end. Its step follows the tag's: every fetch takes the tag row's
// step. Locks are taken in one order, tag rows before period rows: a
// fetch of a period reads its tag's rows in share mode (so the tag's
// settings cannot change meanwhile), then locks the period's row;
// PrunePeriods locks the tags' dispenser_tag rows, then deletes periods.

// fetchPeriod fetches from the period row name (tag's period key) from
// max_id or floor, whichever is greater, creating the row from the tag's
// if missing, and returns the segment and max_id as it was (the tag row's
// max_id, the period's start, for a row created). The period's end is
// computed here, from the key and the tag's reset period and time zone, by
// tagmodel.Tag.PeriodOfKey, the code that names the periods; the tag's rows
// are locked in share mode while it is used. A row is not created if the
// period ended more than the tag's retention ago by the database's clock,
// or is among the periods pruned (tagmodel.PeriodPruned: by its key, the
// record compared with the period's earliest end in any zone, so that a
// change of the tag's time zone brings no pruned period back).
//
// It runs at READ COMMITTED: at REPEATABLE READ, the SELECT … FOR UPDATE
// of a missing row takes a gap lock, and concurrent first fetches of a
// period, each holding one, deadlock on their INSERTs. At READ COMMITTED
// the second INSERT waits for the first and fails with a duplicate key;
// the fetch then runs again and finds the row.
func (s *Store) fetchPeriod(ctx context.Context, name, tag, key string, floor, step int64) (tagmodel.Allocation, int64, error) {
	var a tagmodel.Allocation
	var before, version int64
	err := s.inTxOpts(ctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted}, func(tx *sql.Tx) error {
		t, pruned, err := scanTag(tx.QueryRowContext(ctx, tagQuery+"WHERE "+byLTag+" LOCK IN SHARE MODE", tag, tag))
		if errors.Is(err, sql.ErrNoRows) {
			return tagmodel.ErrUnknownTag
		}
		if err != nil {
			return err
		}
		p, err := t.PeriodOfKey(key)
		if err != nil {
			return err
		}
		if t.Step < 1 {
			return fmt.Errorf("%w: the tag's stored step %d is not positive", tagmodel.ErrInvalidStep, t.Step)
		}
		length := step
		if length == 0 {
			length = t.Step
		}
		var cur int64
		err = tx.QueryRowContext(ctx, "SELECT max_id, version FROM dispenser_period WHERE biz_tag = ? FOR UPDATE", name).Scan(&cur, &version)
		switch {
		case err == nil:
			before = cur
			from := max(cur, floor)
			end, ok := add(from, length)
			if !ok {
				return fmt.Errorf("%w: max_id would overflow bigint", tagmodel.ErrExhausted)
			}
			if _, err := tx.ExecContext(ctx, "UPDATE dispenser_period SET max_id = ?, step = ?, version = version + 1 WHERE biz_tag = ?", end, t.Step, name); err != nil {
				return err
			}
			version++
			a = tagmodel.Allocation{Start: from, End: end, TagStep: t.Step}
			return nil
		case !errors.Is(err, sql.ErrNoRows):
			return err
		}
		// The row is missing: a new period, or one pruned.
		var now time.Time
		if err := tx.QueryRowContext(ctx, "SELECT UTC_TIMESTAMP(6)").Scan(&now); err != nil {
			return err
		}
		days := cmp0(t.RetentionDays)
		gone := false
		if pruned.Valid {
			// By the period's earliest end in any zone, not its end in
			// the tag's zone now (tagmodel.PeriodPruned).
			if gone, err = tagmodel.PeriodPruned(t.Reset, key, pruned.Time); err != nil {
				return err
			}
		}
		if gone || !p.End.After(now.Add(-24*time.Hour*time.Duration(days))) {
			return fmt.Errorf("%w: the period ended %s, more than %d days ago by the database's clock (or its row was pruned); its numbers are not started again",
				tagmodel.ErrPeriodExpired, p.End.UTC().Format(time.RFC3339), days)
		}
		before = t.MaxID
		from := max(t.MaxID, floor)
		end, ok := add(from, length)
		if !ok {
			return fmt.Errorf("%w: max_id would overflow bigint", tagmodel.ErrExhausted)
		}
		_, err = tx.ExecContext(ctx, "INSERT INTO dispenser_period (biz_tag, period_of, max_id, step, version, period_end) VALUES (?, ?, ?, ?, 1, ?)",
			name, tag, end, t.Step, p.End.UTC())
		if isErr(err, errDupKey) {
			return errRetry // a concurrent first fetch created it: fetch from it
		}
		if err != nil {
			return err
		}
		version = 1
		a = tagmodel.Allocation{Start: from, End: end, TagStep: t.Step}
		return nil
	})
	if err != nil {
		return tagmodel.Allocation{}, 0, fetchError(name, err)
	}
	s.remember(name, written{a.End, version})
	return a, before, nil
}

// cmp0 is days, or tagmodel.DefaultRetentionDays for 0.
func cmp0(days int) int {
	if days == 0 {
		return tagmodel.DefaultRetentionDays
	}
	return days
}

// PrunePeriods deletes the rows of periods that ended more than their
// tag's retention ago by the database's clock, and returns how many it
// deleted. It raises each tag's periods_pruned_until to the latest end it
// deleted, so that no period as old is created again, even if the tag's
// retention is raised later; fetches of a pruned period answer
// tagmodel.ErrPeriodExpired. It runs in one transaction that locks the
// tags' dispenser_tag rows in name order before it deletes, the order in
// which a period's creation locks rows (tag rows, then the period row).
func (s *Store) PrunePeriods(ctx context.Context) (int, error) {
	n := 0
	err := s.inTx(ctx, func(tx *sql.Tx) error {
		n = 0
		rows, err := tx.QueryContext(ctx, `SELECT DISTINCT p.period_of FROM dispenser_period p JOIN dispenser_tag t ON t.biz_tag = p.period_of
WHERE p.period_end < UTC_TIMESTAMP(6) - INTERVAL COALESCE(t.retention_days, ?) DAY ORDER BY p.period_of`, tagmodel.DefaultRetentionDays)
		if err != nil {
			return err
		}
		var tags []string
		for rows.Next() {
			var tag string
			if err := rows.Scan(&tag); err != nil {
				rows.Close()
				return err
			}
			tags = append(tags, tag)
		}
		rows.Close()
		if err := rows.Err(); err != nil {
			return err
		}
		for _, tag := range tags {
			var days int
			if err := tx.QueryRowContext(ctx, "SELECT COALESCE(retention_days, ?) FROM dispenser_tag WHERE biz_tag = ? FOR UPDATE", tagmodel.DefaultRetentionDays, tag).Scan(&days); err != nil {
				return err
			}
			var last sql.NullTime
			if err := tx.QueryRowContext(ctx, "SELECT MAX(period_end) FROM dispenser_period WHERE period_of = ? AND period_end < UTC_TIMESTAMP(6) - INTERVAL ? DAY FOR UPDATE", tag, days).Scan(&last); err != nil {
				return err
			}
			if !last.Valid {
				continue
			}
			if _, err := tx.ExecContext(ctx, "UPDATE dispenser_tag SET periods_pruned_until = GREATEST(COALESCE(periods_pruned_until, ?), ?) WHERE biz_tag = ?", last.Time, last.Time, tag); err != nil {
				return err
			}
			res, err := tx.ExecContext(ctx, "DELETE FROM dispenser_period WHERE period_of = ? AND period_end <= ?", tag, last.Time)
			if err != nil {
				return err
			}
			d, err := res.RowsAffected()
			if err != nil {
				return err
			}
			n += int(d)
		}
		return nil
	})
	if err != nil {
		return 0, fmt.Errorf("mysql: prune periods: %w", err)
	}
	return n, nil
}
