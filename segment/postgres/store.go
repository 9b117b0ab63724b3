// Package postgres keeps dispenser's tags in PostgreSQL, in the
// leaf_alloc table of Meituan Leaf's segment mode (see package schema).
package postgres

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/dispenser-dev/dispenser/tagmodel"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Store implements tagmodel.Store and tagmodel.Admin over the leaf_alloc
// table. Every operation is a single statement, so a Store is safe for
// concurrent use, and any number of Stores in any number of processes may
// share one database: two fetches never return overlapping allocations.
type Store struct {
	pool  *pgxpool.Pool
	owned bool // Close closes pool

	mu sync.Mutex // protects wrote
	// wrote holds, per tag, the max_id and dispenser_version this Store's
	// last fetch or give-back left: a give-back applies only if the row
	// still has both (migration 004), so that it never matches a max_id
	// that other workers' fetches and give-backs brought back to end.
	wrote map[string]written
}

// written is a tag's max_id and dispenser_version after a write of this
// Store.
type written struct {
	maxID, version int64
}

var (
	_ tagmodel.Store = (*Store)(nil)
	_ tagmodel.Admin = (*Store)(nil)
)

// New returns a Store over pool, whose database must have the schema
// (postgres.Migrate). The caller keeps ownership of pool.
func New(pool *pgxpool.Pool) *Store {
	return &Store{pool: pool, wrote: map[string]written{}}
}

// Open connects to the database at url (a PostgreSQL URL or key=value
// connection string), checks that it answers and returns a Store that owns
// the connection pool. It does not migrate the schema.
func Open(ctx context.Context, url string) (*Store, error) {
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		return nil, fmt.Errorf("postgres: open: %w", err)
	}
	s := &Store{pool: pool, owned: true, wrote: map[string]written{}}
	if err := s.Ping(ctx); err != nil {
		pool.Close()
		return nil, err
	}
	return s, nil
}

// Close closes the connection pool if the Store was made by Open; for a
// Store from New it does nothing.
func (s *Store) Close() {
	if s.owned {
		s.pool.Close()
	}
}

// Pool returns the Store's connection pool.
func (s *Store) Pool() *pgxpool.Pool { return s.pool }

// Ping checks that the database answers.
func (s *Store) Ping(ctx context.Context) error {
	if err := s.pool.Ping(ctx); err != nil {
		return fmt.Errorf("postgres: ping: %w", err)
	}
	return nil
}

// fetchSQL advances max_id by $2 if positive, else by the tag's own step, in
// one statement, so that the row lock orders concurrent fetches. A tag step
// that is not positive (possible in a table inherited from Leaf) makes the
// sum NULL, which the NOT NULL column rejects (23502) before anything
// changes; a sum past 2^63-1 fails with 22003 instead of wrapping. A tag
// with a reset period hands out no IDs from its own row (its periods' rows
// do), so its row is not fetched.
const fetchSQL = `UPDATE leaf_alloc
SET max_id = max_id + CASE WHEN $2::bigint > 0 THEN $2::bigint WHEN step > 0 THEN step END,
    update_time = now(), dispenser_version = dispenser_version + 1
WHERE biz_tag = $1 AND reset_period IS NULL
RETURNING max_id, step, dispenser_version`

// Fetch atomically advances the tag's max_id by step (the tag's own step if
// step <= 0) and returns the IDs in between. tag may be a period name
// (tagmodel.PeriodName) of a tag with a reset period: see fetchPeriod.
// Errors: tagmodel.ErrInvalidTag, tagmodel.ErrInvalidStep (step above
// tagmodel.MaxStepLimit, or the stored step is not positive),
// tagmodel.ErrUnknownTag, tagmodel.ErrExhausted, tagmodel.ErrInvalidArgument
// (a tag with a reset period, whose own row hands out nothing; a period
// of a tag without one, or not one of its periods),
// tagmodel.ErrPeriodExpired.
func (s *Store) Fetch(ctx context.Context, tag string, step int64) (tagmodel.Allocation, error) {
	if err := checkFetch(tag, step); err != nil {
		return tagmodel.Allocation{}, err
	}
	step = max(step, 0)
	if t, key, ok := tagmodel.SplitPeriodName(tag); ok {
		a, _, err := s.fetchPeriod(ctx, tag, t, key, 0, step)
		return a, err
	}
	var end, tagStep, version int64
	err := s.pool.QueryRow(ctx, fetchSQL, tag, step).Scan(&end, &tagStep, &version)
	if err = s.fetchError(ctx, tag, err); err != nil {
		return tagmodel.Allocation{}, err
	}
	s.remember(tag, written{end, version})
	if step == 0 {
		step = tagStep
	}
	return tagmodel.Allocation{Start: end - step, End: end, TagStep: tagStep}, nil
}

// fetchAboveSQL is fetchSQL from max_id or floor, whichever is greater, and
// also returns max_id as it was: the CTE locks the row, so the old value and
// the update are one atomic step.
const fetchAboveSQL = `WITH old AS (SELECT max_id FROM leaf_alloc WHERE biz_tag = $1 FOR UPDATE)
UPDATE leaf_alloc
SET max_id = greatest(leaf_alloc.max_id, $3::bigint) + CASE WHEN $2::bigint > 0 THEN $2::bigint WHEN step > 0 THEN step END,
    update_time = now(), dispenser_version = leaf_alloc.dispenser_version + 1
FROM old
WHERE biz_tag = $1 AND reset_period IS NULL
RETURNING leaf_alloc.max_id, leaf_alloc.step, old.max_id, leaf_alloc.dispenser_version`

// FetchAbove is Fetch from greatest(max_id, floor): it moves a tag whose
// max_id fell behind what was served (package witness) above it and fetches
// in one statement. It returns the segment and max_id as it was before.
// Errors as for Fetch; floor must not be negative (ErrInvalidArgument).
func (s *Store) FetchAbove(ctx context.Context, tag string, floor, step int64) (tagmodel.Allocation, int64, error) {
	if err := checkFetch(tag, step); err != nil {
		return tagmodel.Allocation{}, 0, err
	}
	if floor < 0 {
		return tagmodel.Allocation{}, 0, fmt.Errorf("postgres: fetch %q: %w: floor %d", tag, tagmodel.ErrInvalidArgument, floor)
	}
	step = max(step, 0)
	if t, key, ok := tagmodel.SplitPeriodName(tag); ok {
		return s.fetchPeriod(ctx, tag, t, key, floor, step)
	}
	var end, tagStep, before, version int64
	err := s.pool.QueryRow(ctx, fetchAboveSQL, tag, step, floor).Scan(&end, &tagStep, &before, &version)
	if err = s.fetchError(ctx, tag, err); err != nil {
		return tagmodel.Allocation{}, 0, err
	}
	s.remember(tag, written{end, version})
	if step == 0 {
		step = tagStep
	}
	return tagmodel.Allocation{Start: end - step, End: end, TagStep: tagStep}, before, nil
}

// checkFetch checks a fetch's tag (or period name) and step.
func checkFetch(tag string, step int64) error {
	if err := tagmodel.CheckName(tag); err != nil {
		return fmt.Errorf("postgres: fetch: %w", err)
	}
	if step > tagmodel.MaxStepLimit {
		return fmt.Errorf("postgres: fetch %q: %w %d: want at most %d", tag, tagmodel.ErrInvalidStep, step, tagmodel.MaxStepLimit)
	}
	return nil
}

// fetchError maps the error of a fetch statement of a tag's row to package
// segment's. No row is an unknown tag, or one with a reset period.
func (s *Store) fetchError(ctx context.Context, tag string, err error) error {
	if errors.Is(err, pgx.ErrNoRows) {
		var reset *string
		switch err := s.pool.QueryRow(ctx, "SELECT reset_period FROM leaf_alloc WHERE biz_tag = $1", tag).Scan(&reset); {
		case errors.Is(err, pgx.ErrNoRows):
		case err != nil:
			return fmt.Errorf("postgres: fetch %q: %w", tag, err)
		case reset != nil:
			return fmt.Errorf("postgres: fetch %q: %w: the tag has a reset period (%s): fetch its periods (%s)", tag, tagmodel.ErrInvalidArgument, *reset, tagmodel.PeriodName(tag, "KEY"))
		}
	}
	return fetchError(tag, err)
}

// fetchError maps the error of a fetch statement to package segment's.
func fetchError(tag string, err error) error {
	var pgErr *pgconn.PgError
	switch {
	case err == nil:
		return nil
	case errors.Is(err, pgx.ErrNoRows):
		return fmt.Errorf("postgres: fetch %q: %w", tag, tagmodel.ErrUnknownTag)
	case errors.As(err, &pgErr) && pgErr.Code == "22003": // numeric_value_out_of_range
		return fmt.Errorf("postgres: fetch %q: %w: max_id would overflow bigint", tag, tagmodel.ErrExhausted)
	case errors.As(err, &pgErr) && pgErr.Code == "23502": // not_null_violation
		return fmt.Errorf("postgres: fetch %q: %w: the tag's stored step is not positive", tag, tagmodel.ErrInvalidStep)
	}
	return fmt.Errorf("postgres: fetch %q: %w", tag, err)
}

// GiveBack sets the tag's max_id back to firstUnissued if this Store's last
// fetch or give-back of the tag left it at end and nobody fetched or gave
// back since (the row's dispenser_version is still the one it left), and
// reports whether it did. A max_id that is end again after other workers
// fetched and gave back is not taken for it. An unknown tag, or one this
// Store has not fetched, reports false. firstUnissued must be in 1..end
// (tagmodel.ErrInvalidArgument).
func (s *Store) GiveBack(ctx context.Context, tag string, end, firstUnissued int64) (bool, error) {
	if err := tagmodel.CheckName(tag); err != nil {
		return false, fmt.Errorf("postgres: give back: %w", err)
	}
	if err := tagmodel.CheckGiveBack(end, firstUnissued); err != nil {
		return false, fmt.Errorf("postgres: give back %q: %w", tag, err)
	}
	s.mu.Lock()
	w, ok := s.wrote[tag]
	s.mu.Unlock()
	if !ok || w.maxID != end {
		return false, nil
	}
	var version int64
	err := s.pool.QueryRow(ctx, `UPDATE leaf_alloc SET max_id = $2, update_time = now(), dispenser_version = dispenser_version + 1
WHERE biz_tag = $1 AND max_id = $3 AND dispenser_version = $4
RETURNING dispenser_version`, tag, firstUnissued, end, w.version).Scan(&version)
	if errors.Is(err, pgx.ErrNoRows) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("postgres: give back %q: %w", tag, err)
	}
	s.remember(tag, written{firstUnissued, version})
	return true, nil
}

// remember records w as this Store's last write of tag, unless a later one
// (a higher version) is recorded.
func (s *Store) remember(tag string, w written) {
	s.mu.Lock()
	if old, ok := s.wrote[tag]; !ok || old.version < w.version {
		s.wrote[tag] = w
	}
	s.mu.Unlock()
}

// Tags lists the names of all tags in byte order. Rows whose biz_tag is not
// a valid tag name (possible in a table inherited from Leaf) are left out,
// since no operation of this Store accepts them, and so are periods' rows.
func (s *Store) Tags(ctx context.Context) ([]string, error) {
	rows, err := s.pool.Query(ctx, `SELECT biz_tag FROM leaf_alloc WHERE period_of IS NULL ORDER BY biz_tag COLLATE "C"`)
	if err != nil {
		return nil, fmt.Errorf("postgres: list tags: %w", err)
	}
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("postgres: list tags: %w", err)
	}
	valid := names[:0]
	for _, n := range names {
		if tagmodel.ValidTag(n) {
			valid = append(valid, n)
		}
	}
	return valid, nil
}

// tagColumns are the columns of a tag as scanTag reads them. NULLs (a row
// of Leaf, or of a table before migrations 002 and 005) read as the zero
// values: no description, not ordered, no reset period.
const tagColumns = `biz_tag, max_id, step, coalesce(description, ''), coalesce(ordered, false), update_time,
coalesce(reset_period, ''), coalesce(time_zone, ''), coalesce(number_format, ''), coalesce(retention_days, 0)`

// scanTag reads the tagColumns of a row.
func scanTag(row pgx.Row) (tagmodel.Tag, error) {
	var t tagmodel.Tag
	var reset string
	err := row.Scan(&t.Name, &t.MaxID, &t.Step, &t.Description, &t.Ordered, &t.UpdateTime, &reset, &t.TimeZone, &t.Format, &t.RetentionDays)
	t.Reset = tagmodel.Reset(reset)
	return t, err
}

// Tag looks up one tag. A NULL description reads as "", a NULL ordered
// (a row of Leaf, or of a table before migration 002) as false, NULL reset
// settings as none. Errors: tagmodel.ErrInvalidTag, tagmodel.ErrUnknownTag.
func (s *Store) Tag(ctx context.Context, name string) (tagmodel.Tag, error) {
	if err := tagmodel.CheckTag(name); err != nil {
		return tagmodel.Tag{}, fmt.Errorf("postgres: tag: %w", err)
	}
	t, err := scanTag(s.pool.QueryRow(ctx, "SELECT "+tagColumns+" FROM leaf_alloc WHERE biz_tag = $1", name))
	if errors.Is(err, pgx.ErrNoRows) {
		return tagmodel.Tag{}, fmt.Errorf("postgres: tag %q: %w", name, tagmodel.ErrUnknownTag)
	}
	if err != nil {
		return tagmodel.Tag{}, fmt.Errorf("postgres: tag %q: %w", name, err)
	}
	return t, nil
}

// CreateTag adds the tag t with step t.Step, first ID t.MaxID, t.Description,
// t.Ordered and the reset settings (Reset, TimeZone, Format, RetentionDays).
// Errors: tagmodel.ErrInvalidTag, tagmodel.ErrInvalidStep (step not in
// 1..tagmodel.MaxStepLimit), tagmodel.ErrInvalidArgument (first ID < 1,
// description over tagmodel.MaxDescription characters or not UTF-8 without
// NUL, reset settings that Tag.Check refuses),
// tagmodel.ErrTagExists (nothing changes).
func (s *Store) CreateTag(ctx context.Context, t tagmodel.Tag) error {
	p, err := t.Check()
	if err != nil {
		return fmt.Errorf("postgres: create tag: %w", err)
	}
	ct, err := s.pool.Exec(ctx, `INSERT INTO leaf_alloc (biz_tag, max_id, step, description, ordered, reset_period, time_zone, number_format, retention_days)
VALUES ($1, $2, $3, $4, $5, nullif($6, ''), nullif($7, ''), nullif($8, ''), nullif($9::integer, 0))
ON CONFLICT (biz_tag) DO NOTHING`, t.Name, t.MaxID, t.Step, t.Description, t.Ordered, string(p.Reset), t.TimeZone, t.Format, t.RetentionDays)
	if err != nil {
		return fmt.Errorf("postgres: create tag %q: %w", t.Name, err)
	}
	if ct.RowsAffected() == 0 {
		return fmt.Errorf("postgres: create tag %q: %w", t.Name, tagmodel.ErrTagExists)
	}
	return nil
}

// UpdateTag sets the tag's fields of u that are not nil, and leaves the
// others and max_id as they are. It reads the tag's row with SELECT … FOR
// UPDATE, checks the tag as updated (tagmodel.Tag.Periodic: the settings
// together, such as a format that a daily tag needs) and writes it, in one
// transaction, so that two updates never combine into settings that
// neither checked. A tag's reset period, once set, cannot be changed or
// removed. Errors: as for CreateTag, and tagmodel.ErrUnknownTag.
func (s *Store) UpdateTag(ctx context.Context, name string, u tagmodel.Update) error {
	if err := u.Check(name); err != nil {
		return fmt.Errorf("postgres: update tag: %w", err)
	}
	tx, err := s.pool.Begin(ctx)
	if err != nil {
		return fmt.Errorf("postgres: update tag %q: %w", name, err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx))
	t, err := scanTag(tx.QueryRow(ctx, "SELECT "+tagColumns+" FROM leaf_alloc WHERE biz_tag = $1 FOR UPDATE", name))
	if errors.Is(err, pgx.ErrNoRows) {
		return fmt.Errorf("postgres: update tag %q: %w", name, tagmodel.ErrUnknownTag)
	}
	if err != nil {
		return fmt.Errorf("postgres: update tag %q: %w", name, err)
	}
	t, err = tagmodel.ApplyUpdate(t, u)
	if err != nil {
		return fmt.Errorf("postgres: update tag: %w", err)
	}
	// Fields u leaves alone are written as they are (a NULL description
	// or ordered of a Leaf row stays NULL); the reset settings as checked.
	_, err = tx.Exec(ctx, `UPDATE leaf_alloc
SET step = coalesce($2::integer, step), description = coalesce($3::text, description),
    ordered = coalesce($4::boolean, ordered), reset_period = nullif($5, ''), time_zone = nullif($6, ''),
    number_format = nullif($7, ''), retention_days = nullif($8::integer, 0), update_time = now()
WHERE biz_tag = $1`, name, u.Step, u.Description, u.Ordered, string(t.Reset), t.TimeZone, t.Format, t.RetentionDays)
	if err != nil {
		return fmt.Errorf("postgres: update tag %q: %w", name, err)
	}
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("postgres: update tag %q: %w", name, err)
	}
	return nil
}

// changesOverlap is how far before the cursor Changes looks again, so that a
// change whose transaction began before the last look but committed after
// it is not missed.
const changesOverlap = 5 * time.Second

// Changes lists the tags whose update_time (set by every fetch, give-back
// and update) is at or after the cursor, minus changesOverlap, and returns
// the database's clock as the next cursor (microseconds since 1970). Cursor
// 0 lists nothing. An index on update_time (migration 003) keeps it cheap
// however many tags the table holds. Deleted rows are not seen: the
// allocator notices them at their next fetch. Periods' rows are not
// listed: they are not tags.
func (s *Store) Changes(ctx context.Context, cursor int64) ([]tagmodel.Change, int64, error) {
	var now int64
	if err := s.pool.QueryRow(ctx, `SELECT (extract(epoch FROM clock_timestamp()) * 1e6)::bigint`).Scan(&now); err != nil {
		return nil, 0, fmt.Errorf("postgres: changes: %w", err)
	}
	if cursor <= 0 {
		return nil, now, nil
	}
	since := time.UnixMicro(cursor).Add(-changesOverlap)
	rows, err := s.pool.Query(ctx, "SELECT "+tagColumns+" FROM leaf_alloc WHERE update_time >= $1 AND period_of IS NULL", since)
	if err != nil {
		return nil, 0, fmt.Errorf("postgres: changes: %w", err)
	}
	var out []tagmodel.Change
	for rows.Next() {
		t, err := scanTag(rows)
		if err != nil {
			rows.Close()
			return nil, 0, fmt.Errorf("postgres: changes: %w", err)
		}
		if tagmodel.ValidTag(t.Name) {
			out = append(out, tagmodel.Change{Tag: t})
		}
	}
	if err := rows.Err(); err != nil {
		return nil, 0, fmt.Errorf("postgres: changes: %w", err)
	}
	return out, now, nil
}
