package postgres

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/dispenser-dev/dispenser/tagmodel"
	"github.com/jackc/pgx/v5"
)

// A period of a tag with a reset period is a row of its own, named
// tag=KEY (tagmodel.PeriodName), with period_of (its tag) and period_end
// (migration 005). Its step follows the tag's: every fetch takes the tag
// row's step.

// fetchPeriodSQL fetches from an existing period row, from max_id or $3,
// whichever is greater (fetchAboveSQL), at the step of its tag, which must
// still exist and have a reset period. No row: the period's row is missing
// (a new or pruned period), or its tag is gone.
const fetchPeriodSQL = `WITH old AS (SELECT max_id FROM leaf_alloc WHERE biz_tag = $1 FOR UPDATE)
UPDATE leaf_alloc p
SET max_id = greatest(p.max_id, $3::bigint) + CASE WHEN $2::bigint > 0 THEN $2::bigint WHEN t.step > 0 THEN t.step END,
    step = t.step, update_time = now(), dispenser_version = p.dispenser_version + 1
FROM old, leaf_alloc t
WHERE p.biz_tag = $1 AND t.biz_tag = p.period_of AND t.reset_period IS NOT NULL
RETURNING p.max_id, p.step, old.max_id, p.dispenser_version`

// createPeriodSQL creates the period row $1 of tag $3 from the tag row's
// max_id (or $7, whichever is greater) and step, in one statement: a
// concurrent creator's row (the conflict) is fetched from instead, so two
// first fetches never overlap. It creates nothing unless the tag row still
// has the reset period $5 and time zone $6 the period's end $4 was computed
// with, and the period has not expired by the database's clock: its end is
// after now() minus the tag's retention ($8 days if NULL), and it is not
// among the periods pruned: its earliest end in any zone ($9,
// tagmodel.Reset.EarliestEnd) is after the end of every period row pruned
// (periods_pruned_until), so that a period pruned is never created again,
// even after the retention was raised or the time zone moved (see
// tagmodel.PeriodPruned for why the earliest end, not $4). FOR
// SHARE orders the creation with PrunePeriods, which locks the tag row
// before it deletes periods and raises periods_pruned_until: a creation
// waiting for it sees the raised value.
const createPeriodSQL = `INSERT INTO leaf_alloc AS p (biz_tag, max_id, step, update_time, dispenser_version, period_of, period_end)
SELECT $1, greatest(t.max_id, $7::bigint) + CASE WHEN $2::bigint > 0 THEN $2::bigint WHEN t.step > 0 THEN t.step END,
       t.step, now(), 1, t.biz_tag, $4::timestamptz
FROM leaf_alloc t
WHERE t.biz_tag = $3 AND t.reset_period = $5 AND coalesce(t.time_zone, '') = $6
  AND $4::timestamptz > now() - make_interval(hours => 24 * coalesce(t.retention_days, $8::integer))
  AND $9::timestamptz > coalesce(t.periods_pruned_until, '-infinity'::timestamptz)
FOR SHARE OF t
ON CONFLICT (biz_tag) DO UPDATE
SET max_id = greatest(p.max_id, $7::bigint) + CASE WHEN $2::bigint > 0 THEN $2::bigint WHEN excluded.step > 0 THEN excluded.step END,
    step = excluded.step, update_time = now(), dispenser_version = p.dispenser_version + 1
WHERE p.period_of = excluded.period_of
RETURNING p.max_id, p.step, p.dispenser_version`

// fetchPeriod fetches from the period row name (tag's period key) from
// max_id or floor, whichever is greater, creating the row from the tag's
// if missing, and returns the segment and max_id as it was (the tag row's
// max_id, the period's start, for a row created). The period's end is
// computed here, from the key and the tag's reset period and time zone, by
// tagmodel.Reset.PeriodOfKey, the same code that names the periods
// (tagmodel.Reset.PeriodAt), rather than by the database's time zone
// rules, which may differ from Go's; the creation checks that the tag row
// still has the settings it was computed from.
func (s *Store) fetchPeriod(ctx context.Context, name, tag, key string, floor, step int64) (tagmodel.Allocation, int64, error) {
	var end, tagStep, before, version int64
	err := s.pool.QueryRow(ctx, fetchPeriodSQL, name, step, floor).Scan(&end, &tagStep, &before, &version)
	if !errors.Is(err, pgx.ErrNoRows) {
		if err = fetchError(name, err); err != nil {
			return tagmodel.Allocation{}, 0, err
		}
		return s.allocated(name, step, end, tagStep, version), before, nil
	}
	// The row is missing: create it (a concurrent creator may win).
	for range 3 {
		t, err := s.Tag(ctx, tag)
		if err != nil {
			return tagmodel.Allocation{}, 0, fmt.Errorf("postgres: fetch %q: %w", name, unwrapTag(err))
		}
		p, err := t.PeriodOfKey(key)
		if err != nil {
			return tagmodel.Allocation{}, 0, fmt.Errorf("postgres: fetch %q: %w", name, err)
		}
		earliest, err := t.Reset.EarliestEnd(key)
		if err != nil {
			return tagmodel.Allocation{}, 0, fmt.Errorf("postgres: fetch %q: %w", name, err)
		}
		err = s.pool.QueryRow(ctx, createPeriodSQL, name, step, tag, p.End, string(t.Reset), t.TimeZone, floor, tagmodel.DefaultRetentionDays, earliest).
			Scan(&end, &tagStep, &version)
		if err == nil {
			return s.allocated(name, step, end, tagStep, version), t.MaxID, nil
		}
		if !errors.Is(err, pgx.ErrNoRows) {
			return tagmodel.Allocation{}, 0, fetchError(name, err)
		}
		// Nothing created: expired, pruned, or the tag changed.
		now, err := s.Tag(ctx, tag)
		if err != nil {
			return tagmodel.Allocation{}, 0, fmt.Errorf("postgres: fetch %q: %w", name, unwrapTag(err))
		}
		if now.Reset == t.Reset && now.TimeZone == t.TimeZone {
			return tagmodel.Allocation{}, 0, fmt.Errorf("postgres: fetch %q: %w: the period ended %s, more than %d days ago by the database's clock (or its row was pruned); its numbers are not started again",
				name, tagmodel.ErrPeriodExpired, p.End.UTC().Format(time.RFC3339), cmp0(now.RetentionDays))
		}
	}
	return tagmodel.Allocation{}, 0, fmt.Errorf("postgres: fetch %q: the tag's time zone kept changing", name)
}

// cmp0 is days, or tagmodel.DefaultRetentionDays for 0.
func cmp0(days int) int {
	if days == 0 {
		return tagmodel.DefaultRetentionDays
	}
	return days
}

// unwrapTag strips the "postgres: tag %q: " context of Tag's errors, which
// the caller replaces with its own.
func unwrapTag(err error) error {
	if errors.Is(err, tagmodel.ErrUnknownTag) {
		return tagmodel.ErrUnknownTag
	}
	return err
}

// allocated records a fetch of name and returns its segment.
func (s *Store) allocated(name string, step, end, tagStep, version int64) tagmodel.Allocation {
	s.remember(name, written{end, version})
	if step == 0 {
		step = tagStep
	}
	return tagmodel.Allocation{Start: end - step, End: end, TagStep: tagStep}
}

// expiredPeriods is the condition of a period row p of tag t that
// PrunePeriods deletes: its period ended more than the tag's retention ($1
// days if NULL) ago by the database's clock. The first bound, for the
// shortest retention, lets the partial index on period_end find them.
const expiredPeriods = `p.period_end IS NOT NULL AND t.biz_tag = p.period_of
  AND p.period_end < now() - interval '24 hours'
  AND p.period_end < now() - make_interval(hours => 24 * coalesce(t.retention_days, $1::integer))`

// PrunePeriods deletes the rows of periods that ended more than their
// tag's retention ago by the database's clock, and returns how many it
// deleted. It raises each tag's periods_pruned_until to the latest end it
// deleted, so that no period as old is created again, even if the tag's
// retention is raised later; fetches of a pruned period answer
// tagmodel.ErrPeriodExpired. It runs in one transaction (one now()) that
// first locks the tag rows of the periods it prunes, in name order, then
// deletes: the order in which a period's creation locks rows (tag row,
// then period row), so that the two never deadlock.
func (s *Store) PrunePeriods(ctx context.Context) (int, error) {
	tx, err := s.pool.Begin(ctx)
	if err != nil {
		return 0, fmt.Errorf("postgres: prune periods: %w", err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx))
	rows, err := tx.Query(ctx, `SELECT t.biz_tag FROM leaf_alloc t
WHERE t.biz_tag IN (SELECT p.period_of FROM leaf_alloc p JOIN leaf_alloc t ON `+expiredPeriods+`)
ORDER BY t.biz_tag COLLATE "C" FOR UPDATE OF t`, tagmodel.DefaultRetentionDays)
	if err != nil {
		return 0, fmt.Errorf("postgres: prune periods: %w", err)
	}
	tags, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return 0, fmt.Errorf("postgres: prune periods: %w", err)
	}
	if len(tags) == 0 {
		return 0, nil
	}
	var n int
	err = tx.QueryRow(ctx, `WITH gone AS (
  DELETE FROM leaf_alloc p USING leaf_alloc t
  WHERE `+expiredPeriods+` AND p.period_of = ANY($2::text[])
  RETURNING p.period_of, p.period_end
), marked AS (
  UPDATE leaf_alloc t SET periods_pruned_until = greatest(t.periods_pruned_until, g.e)
  FROM (SELECT period_of, max(period_end) AS e FROM gone GROUP BY period_of) g
  WHERE t.biz_tag = g.period_of
  RETURNING 1
)
SELECT count(*) FROM gone`, tagmodel.DefaultRetentionDays, tags).Scan(&n)
	if err != nil {
		return 0, fmt.Errorf("postgres: prune periods: %w", err)
	}
	if err := tx.Commit(ctx); err != nil {
		return 0, fmt.Errorf("postgres: prune periods: %w", err)
	}
	return n, nil
}
