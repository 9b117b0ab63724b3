// Package mysql keeps dispenser's tags in MySQL or MariaDB, in the
// leaf_alloc table of Meituan Leaf's segment mode exactly as Leaf creates
// it, so that dispenser workers and Leaf servers can share one table at
// the same time. What dispenser keeps beyond Leaf's columns (ordered tags,
// reset periods, the give-back version) and the periods' rows live in
// tables of its own (see Migrate).
//
// A fetch is Leaf's own transaction: UPDATE leaf_alloc SET max_id = max_id
// + step WHERE biz_tag = ?, then SELECT in the same transaction. The
// UPDATE's row lock orders it with every other fetch, Leaf's or
// dispenser's, so two fetches never return overlapping segments.
package mysql

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math"
	"sync"
	"time"

	driver "github.com/go-sql-driver/mysql"

	"github.com/dispenser-dev/dispenser/tagmodel"
)

// Store implements tagmodel.Store, tagmodel.Admin, tagmodel.PeriodPruner and
// tagmodel.ChangeLister over leaf_alloc and dispenser's tables. It is safe
// for concurrent use, and any number of Stores in any number of processes,
// and any number of Leaf servers, may share one database.
type Store struct {
	db    *sql.DB
	owned bool // Close closes db

	mu sync.Mutex // protects wrote
	// wrote holds, per tag (or period), the max_id and version this
	// Store's last fetch or give-back left: a give-back applies only if
	// the rows still have both, so that it never matches a max_id that
	// other workers' fetches and give-backs brought back to end.
	wrote map[string]written
}

// written is a tag's max_id and version after a write of this Store.
type written struct {
	maxID, version int64
}

var (
	_ tagmodel.Store        = (*Store)(nil)
	_ tagmodel.Admin        = (*Store)(nil)
	_ tagmodel.PeriodPruner = (*Store)(nil)
	_ tagmodel.ChangeLister = (*Store)(nil)
)

// OpenDB returns a database handle for dsn, a go-sql-driver DSN such as
// user:password@tcp(host:3306)/dbname, with the session settings the
// Store relies on: times in UTC (time_zone '+00:00', parseTime), strict
// SQL mode (a value a column cannot hold is an error, not a truncation)
// and client-side parameter interpolation (one round trip a statement).
// It does not connect.
func OpenDB(dsn string) (*sql.DB, error) {
	cfg, err := driver.ParseDSN(dsn)
	if err != nil {
		return nil, fmt.Errorf("mysql: DSN: %w (want user:password@tcp(host:port)/dbname)", err)
	}
	if cfg.DBName == "" {
		// Not the DSN itself: it may hold a password.
		return nil, fmt.Errorf("mysql: DSN: names no database (want user:password@tcp(host:port)/dbname)")
	}
	cfg.ParseTime = true
	cfg.Loc = time.UTC
	cfg.InterpolateParams = true
	if cfg.Params == nil {
		cfg.Params = map[string]string{}
	}
	cfg.Params["time_zone"] = "'+00:00'"
	cfg.Params["sql_mode"] = "'STRICT_ALL_TABLES,NO_ENGINE_SUBSTITUTION'"
	conn, err := driver.NewConnector(cfg)
	if err != nil {
		return nil, fmt.Errorf("mysql: %w", err)
	}
	return sql.OpenDB(conn), nil
}

// New returns a Store over db, which must come from OpenDB and have the
// tables (Migrate). The caller keeps ownership of db.
func New(db *sql.DB) *Store {
	return &Store{db: db, wrote: map[string]written{}}
}

// Open opens dsn (OpenDB), checks that the server answers and returns a
// Store that owns the handle. It does not migrate.
func Open(ctx context.Context, dsn string) (*Store, error) {
	db, err := OpenDB(dsn)
	if err != nil {
		return nil, err
	}
	s := &Store{db: db, owned: true, wrote: map[string]written{}}
	if err := s.Ping(ctx); err != nil {
		db.Close()
		return nil, err
	}
	return s, nil
}

// Close closes the database handle if the Store was made by Open; for a
// Store from New it does nothing.
func (s *Store) Close() {
	if s.owned {
		s.db.Close()
	}
}

// DB returns the Store's database handle.
func (s *Store) DB() *sql.DB { return s.db }

// Ping checks that the database answers.
func (s *Store) Ping(ctx context.Context) error {
	if err := s.db.PingContext(ctx); err != nil {
		return fmt.Errorf("mysql: ping: %w", err)
	}
	return nil
}

// byTag selects the leaf_alloc row of a tag (two parameters, both the
// name): by the primary key, then byte for byte, so that a case-insensitive
// collation of Leaf's table never makes "Orders" the row of "orders".
const byTag = "biz_tag = ? AND CAST(biz_tag AS BINARY) = ?"

// byLTag is byTag on leaf_alloc as l.
const byLTag = "l.biz_tag = ? AND CAST(l.biz_tag AS BINARY) = ?"

// MySQL and MariaDB error numbers the Store maps.
const (
	errDupKey      = 1062 // ER_DUP_ENTRY
	errOutOfRange  = 1690 // ER_DATA_OUT_OF_RANGE: BIGINT value is out of range
	errDeadlock    = 1213 // ER_LOCK_DEADLOCK: the transaction was rolled back
	errBadString   = 1366 // ER_TRUNCATED_WRONG_VALUE_FOR_FIELD: a character the column cannot hold
	errDataTooLong = 1406 // ER_DATA_TOO_LONG
)

// maxTxAttempts is how often inTx runs a transaction that keeps losing.
const maxTxAttempts = 10

// errRetry makes inTx run the transaction again (a concurrent creator of
// the same row won).
var errRetry = errors.New("mysql: retry")

// isErr reports whether err is the server error number.
func isErr(err error, number uint16) bool {
	var me *driver.MySQLError
	return errors.As(err, &me) && me.Number == number
}

// inTx runs f in a transaction and commits it, again from the start if
// the server rolled it back for a deadlock or f asked for it (errRetry).
func (s *Store) inTx(ctx context.Context, f func(tx *sql.Tx) error) error {
	return s.inTxOpts(ctx, nil, f)
}

// inTxOpts is inTx with transaction options.
func (s *Store) inTxOpts(ctx context.Context, opts *sql.TxOptions, f func(tx *sql.Tx) error) error {
	for attempt := 1; ; attempt++ {
		tx, err := s.db.BeginTx(ctx, opts)
		if err != nil {
			return err
		}
		if err = f(tx); err == nil {
			err = tx.Commit()
		} else {
			tx.Rollback()
		}
		if attempt < maxTxAttempts && (isErr(err, errDeadlock) || errors.Is(err, errRetry)) {
			continue
		}
		if errors.Is(err, errRetry) {
			return errors.New("concurrent writers kept winning")
		}
		return err
	}
}

// fetchSQL is Leaf's fetch statement with dispenser's step: max_id grows
// by the step asked for if positive, else by the tag's own. A stored step
// that is not positive (possible in a table edited by hand) matches no
// row rather than lowering max_id; a sum past 2^63-1 fails with 1690.
const fetchSQL = "UPDATE leaf_alloc SET max_id = max_id + IF(? > 0, ?, step) WHERE " + byTag + " AND (? > 0 OR step > 0)"

// fetchAboveSQL is fetchSQL from max_id or a floor, whichever is greater.
const fetchAboveSQL = "UPDATE leaf_alloc SET max_id = GREATEST(max_id, ?) + IF(? > 0, ?, step) WHERE " + byTag + " AND (? > 0 OR step > 0)"

// Fetch atomically advances the tag's max_id by step (the tag's own step if
// step <= 0) and returns the IDs in between, in Leaf's transaction: UPDATE
// leaf_alloc, then SELECT, and dispenser's version raised, in one
// transaction. tag may be a period name (tagmodel.PeriodName) of a tag
// with a reset period. Errors: tagmodel.ErrInvalidTag,
// tagmodel.ErrInvalidStep (step above tagmodel.MaxStepLimit, or the stored
// step is not positive), tagmodel.ErrUnknownTag, tagmodel.ErrExhausted,
// tagmodel.ErrInvalidArgument (a tag with a reset period, whose own row
// hands out nothing; a period of a tag without one, or not one of its
// periods), tagmodel.ErrPeriodExpired.
func (s *Store) Fetch(ctx context.Context, tag string, step int64) (tagmodel.Allocation, error) {
	if err := checkFetch(tag, step); err != nil {
		return tagmodel.Allocation{}, err
	}
	step = max(step, 0)
	if t, key, ok := tagmodel.SplitPeriodName(tag); ok {
		a, _, err := s.fetchPeriod(ctx, tag, t, key, 0, step)
		return a, err
	}
	a, _, err := s.fetchTag(ctx, tag, -1, step)
	return a, err
}

// FetchAbove is Fetch from greatest(max_id, floor): it moves a tag whose
// max_id fell behind what was served (package witness) above it and
// fetches, in one transaction that first locks the row (SELECT … FOR
// UPDATE) to read max_id as it was, which it returns with the segment.
// Errors as for Fetch; floor must not be negative (ErrInvalidArgument).
func (s *Store) FetchAbove(ctx context.Context, tag string, floor, step int64) (tagmodel.Allocation, int64, error) {
	if err := checkFetch(tag, step); err != nil {
		return tagmodel.Allocation{}, 0, err
	}
	if floor < 0 {
		return tagmodel.Allocation{}, 0, fmt.Errorf("mysql: fetch %q: %w: floor %d", tag, tagmodel.ErrInvalidArgument, floor)
	}
	step = max(step, 0)
	if t, key, ok := tagmodel.SplitPeriodName(tag); ok {
		return s.fetchPeriod(ctx, tag, t, key, floor, step)
	}
	return s.fetchTag(ctx, tag, floor, step)
}

// checkFetch checks a fetch's tag (or period name) and step.
func checkFetch(tag string, step int64) error {
	if err := tagmodel.CheckName(tag); err != nil {
		return fmt.Errorf("mysql: fetch: %w", err)
	}
	if step > tagmodel.MaxStepLimit {
		return fmt.Errorf("mysql: fetch %q: %w %d: want at most %d", tag, tagmodel.ErrInvalidStep, step, tagmodel.MaxStepLimit)
	}
	return nil
}

// fetchTag fetches from a tag's own row; floor < 0: Leaf's statements as
// they are, else from greatest(max_id, floor). It returns max_id as it was
// if floor >= 0.
func (s *Store) fetchTag(ctx context.Context, tag string, floor, step int64) (a tagmodel.Allocation, before int64, err error) {
	var end, tagStep, version int64
	err = s.inTx(ctx, func(tx *sql.Tx) error {
		var res sql.Result
		var err error
		if floor < 0 {
			res, err = tx.ExecContext(ctx, fetchSQL, step, step, tag, tag, step)
		} else {
			err = tx.QueryRowContext(ctx, "SELECT max_id FROM leaf_alloc WHERE "+byTag+" FOR UPDATE", tag, tag).Scan(&before)
			if errors.Is(err, sql.ErrNoRows) {
				return tagmodel.ErrUnknownTag
			}
			if err != nil {
				return err
			}
			res, err = tx.ExecContext(ctx, fetchAboveSQL, floor, step, step, tag, tag, step)
		}
		if err != nil {
			return err
		}
		if n, err := res.RowsAffected(); err != nil {
			return err
		} else if n == 0 {
			// No row, or one whose stored step is not positive.
			var stored int64
			err := tx.QueryRowContext(ctx, "SELECT step FROM leaf_alloc WHERE "+byTag, tag, tag).Scan(&stored)
			switch {
			case errors.Is(err, sql.ErrNoRows):
				return tagmodel.ErrUnknownTag
			case err != nil:
				return err
			}
			return fmt.Errorf("%w: the tag's stored step %d is not positive", tagmodel.ErrInvalidStep, stored)
		}
		if _, err := tx.ExecContext(ctx, "INSERT INTO dispenser_tag (biz_tag, version) VALUES (?, 1) ON DUPLICATE KEY UPDATE version = version + 1", tag); err != nil {
			return err
		}
		var reset sql.NullString
		err = tx.QueryRowContext(ctx, `SELECT l.max_id, l.step, d.version, d.reset_period
FROM leaf_alloc l JOIN dispenser_tag d ON d.biz_tag = ?
WHERE l.biz_tag = ? AND CAST(l.biz_tag AS BINARY) = ?`, tag, tag, tag).Scan(&end, &tagStep, &version, &reset)
		if err != nil {
			return err
		}
		if reset.Valid {
			// Rolled back: the row of a tag with a reset period hands out
			// nothing.
			return fmt.Errorf("%w: the tag has a reset period (%s): fetch its periods (%s)", tagmodel.ErrInvalidArgument, reset.String, tagmodel.PeriodName(tag, "KEY"))
		}
		return nil
	})
	if err != nil {
		return tagmodel.Allocation{}, 0, fetchError(tag, err)
	}
	s.remember(tag, written{end, version})
	if step == 0 {
		step = tagStep
	}
	return tagmodel.Allocation{Start: end - step, End: end, TagStep: tagStep}, before, nil
}

// fetchError maps the error of a fetch to package segment's.
func fetchError(tag string, err error) error {
	switch {
	case err == nil:
		return nil
	case isErr(err, errOutOfRange):
		return fmt.Errorf("mysql: fetch %q: %w: max_id would overflow bigint", tag, tagmodel.ErrExhausted)
	}
	return fmt.Errorf("mysql: fetch %q: %w", tag, err)
}

// GiveBack sets the tag's max_id back to firstUnissued if this Store's last
// fetch or give-back of the tag left it at end and nobody fetched or gave
// back since (dispenser's version of the tag is still the one it left;
// Leaf's fetches only raise max_id, so a max_id still at end after one is
// impossible), and reports whether it did. It locks the leaf_alloc row
// first, as a fetch does. An unknown tag, or one this Store has not
// fetched, reports false. firstUnissued must be in 1..end
// (tagmodel.ErrInvalidArgument).
func (s *Store) GiveBack(ctx context.Context, tag string, end, firstUnissued int64) (bool, error) {
	if err := tagmodel.CheckName(tag); err != nil {
		return false, fmt.Errorf("mysql: give back: %w", err)
	}
	if err := tagmodel.CheckGiveBack(end, firstUnissued); err != nil {
		return false, fmt.Errorf("mysql: give back %q: %w", tag, err)
	}
	s.mu.Lock()
	w, ok := s.wrote[tag]
	s.mu.Unlock()
	if !ok || w.maxID != end {
		return false, nil
	}
	given := false
	err := s.inTx(ctx, func(tx *sql.Tx) error {
		given = false
		if _, _, ok := tagmodel.SplitPeriodName(tag); ok {
			res, err := tx.ExecContext(ctx, "UPDATE dispenser_period SET max_id = ?, version = version + 1 WHERE biz_tag = ? AND max_id = ? AND version = ?",
				firstUnissued, tag, end, w.version)
			if err != nil {
				return err
			}
			n, err := res.RowsAffected()
			given = n > 0
			return err
		}
		var maxID int64
		err := tx.QueryRowContext(ctx, "SELECT max_id FROM leaf_alloc WHERE "+byTag+" FOR UPDATE", tag, tag).Scan(&maxID)
		if errors.Is(err, sql.ErrNoRows) || err == nil && maxID != end {
			return nil
		}
		if err != nil {
			return err
		}
		res, err := tx.ExecContext(ctx, "UPDATE dispenser_tag SET version = version + 1 WHERE biz_tag = ? AND version = ?", tag, w.version)
		if err != nil {
			return err
		}
		if n, err := res.RowsAffected(); err != nil || n == 0 {
			return err
		}
		if _, err := tx.ExecContext(ctx, "UPDATE leaf_alloc SET max_id = ? WHERE "+byTag, firstUnissued, tag, tag); err != nil {
			return err
		}
		given = true
		return nil
	})
	if err != nil {
		return false, fmt.Errorf("mysql: give back %q: %w", tag, err)
	}
	if given {
		s.remember(tag, written{firstUnissued, w.version + 1})
	}
	return given, nil
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

// add returns a+b, or false if the sum passes 2^63-1 (a, b >= 0).
func add(a, b int64) (int64, bool) {
	if a > math.MaxInt64-b {
		return 0, false
	}
	return a + b, true
}
