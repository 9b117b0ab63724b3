package mysql

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sort"
	"time"

	"github.com/dispenser-dev/dispenser/tagmodel"
)

// Tags lists the names of all tags in byte order. Rows whose biz_tag is not
// a valid tag name (possible in a table of Leaf) are left out, since no
// operation of this Store accepts them.
func (s *Store) Tags(ctx context.Context) ([]string, error) {
	rows, err := s.db.QueryContext(ctx, "SELECT biz_tag FROM leaf_alloc")
	if err != nil {
		return nil, fmt.Errorf("mysql: list tags: %w", err)
	}
	defer rows.Close()
	var names []string
	for rows.Next() {
		var n string
		if err := rows.Scan(&n); err != nil {
			return nil, fmt.Errorf("mysql: list tags: %w", err)
		}
		if tagmodel.ValidTag(n) {
			names = append(names, n)
		}
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("mysql: list tags: %w", err)
	}
	sort.Strings(names)
	return names, nil
}

// tagQuery reads a tag as scanTag reads it: Leaf's row and dispenser's,
// if any. Missing or NULL fields (a tag of Leaf) read as the zero values:
// no description, not ordered, no reset period.
const tagQuery = `SELECT l.biz_tag, l.max_id, l.step, COALESCE(l.description, ''), l.update_time,
COALESCE(d.ordered, 0), COALESCE(d.reset_period, ''), COALESCE(d.time_zone, ''), COALESCE(d.number_format, ''),
COALESCE(d.retention_days, 0), d.periods_pruned_until
FROM leaf_alloc l LEFT JOIN dispenser_tag d ON d.biz_tag = l.biz_tag `

// scanTag reads a row of tagQuery, and the end of the latest period
// pruned (NULL if none).
func scanTag(row interface{ Scan(...any) error }) (tagmodel.Tag, sql.NullTime, error) {
	var t tagmodel.Tag
	var reset string
	var pruned sql.NullTime
	err := row.Scan(&t.Name, &t.MaxID, &t.Step, &t.Description, &t.UpdateTime, &t.Ordered, &reset, &t.TimeZone, &t.Format, &t.RetentionDays, &pruned)
	t.Reset = tagmodel.Reset(reset)
	return t, pruned, err
}

// Tag looks up one tag. Errors: tagmodel.ErrInvalidTag,
// tagmodel.ErrUnknownTag.
func (s *Store) Tag(ctx context.Context, name string) (tagmodel.Tag, error) {
	if err := tagmodel.CheckTag(name); err != nil {
		return tagmodel.Tag{}, fmt.Errorf("mysql: tag: %w", err)
	}
	t, _, err := scanTag(s.db.QueryRowContext(ctx, tagQuery+"WHERE "+byLTag, name, name))
	if errors.Is(err, sql.ErrNoRows) {
		return tagmodel.Tag{}, fmt.Errorf("mysql: tag %q: %w", name, tagmodel.ErrUnknownTag)
	}
	if err != nil {
		return tagmodel.Tag{}, fmt.Errorf("mysql: tag %q: %w", name, err)
	}
	return t, nil
}

// writeError maps the error of a write of a tag's fields: a description
// the column cannot hold (a character outside a latin1 table's character
// set) is an invalid argument.
func writeError(err error) error {
	if isErr(err, errBadString) || isErr(err, errDataTooLong) {
		return fmt.Errorf("%w: %w", tagmodel.ErrInvalidArgument, err)
	}
	return err
}

// putDispenserTag writes dispenser's fields of t (a new row at version 0,
// or an existing row's fields, keeping its version and
// periods_pruned_until).
const putDispenserTag = `INSERT INTO dispenser_tag (biz_tag, ordered, reset_period, time_zone, number_format, retention_days)
VALUES (?, ?, NULLIF(?, ''), NULLIF(?, ''), NULLIF(?, ''), NULLIF(?, 0))
ON DUPLICATE KEY UPDATE ordered = ?, reset_period = NULLIF(?, ''), time_zone = NULLIF(?, ''), number_format = NULLIF(?, ''), retention_days = NULLIF(?, 0)`

// putArgs are the arguments of putDispenserTag for t.
func putArgs(t tagmodel.Tag) []any {
	f := []any{t.Ordered, string(t.Reset), t.TimeZone, t.Format, t.RetentionDays}
	return append(append([]any{t.Name}, f...), f...)
}

// CreateTag adds the tag t with step t.Step, first ID t.MaxID, t.Description
// (a row of leaf_alloc as Leaf would have it) and t.Ordered and the reset
// settings (a row of dispenser_tag), in one transaction. Errors:
// tagmodel.ErrInvalidTag, tagmodel.ErrInvalidStep (step not in
// 1..tagmodel.MaxStepLimit), tagmodel.ErrInvalidArgument (first ID < 1,
// description over tagmodel.MaxDescription characters, not UTF-8 without
// NUL or not in the column's character set, reset settings that
// Tag.Check refuses), tagmodel.ErrTagExists (also for a tag
// differing only in case in a table with a case-insensitive collation;
// nothing changes).
func (s *Store) CreateTag(ctx context.Context, t tagmodel.Tag) error {
	p, err := t.Check()
	if err != nil {
		return fmt.Errorf("mysql: create tag: %w", err)
	}
	t.Reset = p.Reset
	err = s.inTx(ctx, func(tx *sql.Tx) error {
		_, err := tx.ExecContext(ctx, "INSERT INTO leaf_alloc (biz_tag, max_id, step, description) VALUES (?, ?, ?, ?)", t.Name, t.MaxID, t.Step, t.Description)
		if isErr(err, errDupKey) {
			return tagmodel.ErrTagExists
		}
		if err != nil {
			return writeError(err)
		}
		_, err = tx.ExecContext(ctx, putDispenserTag, putArgs(t)...)
		return writeError(err)
	})
	if err != nil {
		return fmt.Errorf("mysql: create tag %q: %w", t.Name, err)
	}
	return nil
}

// UpdateTag sets the tag's fields of u that are not nil, and leaves the
// others and max_id as they are. It reads the tag's rows with SELECT … FOR
// UPDATE, checks the tag as updated (tagmodel.Tag.Periodic) and writes
// it, in one transaction, so that two updates never combine into settings
// that neither checked, and no fetch runs in between. A tag's reset
// period, once set, cannot be changed or removed. It sets the row's
// update_time, so that Changes lists it. Errors: as for CreateTag, and
// tagmodel.ErrUnknownTag.
func (s *Store) UpdateTag(ctx context.Context, name string, u tagmodel.Update) error {
	if err := u.Check(name); err != nil {
		return fmt.Errorf("mysql: update tag: %w", err)
	}
	err := s.inTx(ctx, func(tx *sql.Tx) error {
		t, _, err := scanTag(tx.QueryRowContext(ctx, tagQuery+"WHERE "+byLTag+" FOR UPDATE", name, name))
		if errors.Is(err, sql.ErrNoRows) {
			return tagmodel.ErrUnknownTag
		}
		if err != nil {
			return err
		}
		if t, err = tagmodel.ApplyUpdate(t, u); err != nil {
			return err
		}
		// A field u leaves alone is not written (a NULL description of a
		// Leaf row stays NULL). Not COALESCE(?, description): in a latin1
		// table that mixes collations, which MySQL refuses.
		set, args := "update_time = CURRENT_TIMESTAMP", []any{}
		if u.Step != nil {
			set, args = set+", step = ?", append(args, *u.Step)
		}
		if u.Description != nil {
			set, args = set+", description = ?", append(args, *u.Description)
		}
		_, err = tx.ExecContext(ctx, "UPDATE leaf_alloc SET "+set+" WHERE "+byTag, append(args, name, name)...)
		if err != nil {
			return writeError(err)
		}
		_, err = tx.ExecContext(ctx, putDispenserTag, putArgs(t)...)
		return writeError(err)
	})
	if err != nil {
		return fmt.Errorf("mysql: update tag %q: %w", name, err)
	}
	return nil
}

// changesOverlap is how far before the cursor Changes looks again, so that a
// change whose transaction began before the last look but committed after
// it is not missed (and leaf_alloc.update_time has whole seconds only).
const changesOverlap = 5 * time.Second

// Changes lists the tags whose leaf_alloc.update_time (set by every fetch,
// Leaf's too, and by every give-back and update) is at or after the
// cursor, minus changesOverlap, and returns the database's clock as the
// next cursor (microseconds since 1970). Cursor 0 lists nothing. Leaf's
// table has no index on update_time, so each call reads the whole table:
// cheap for thousands of tags, not for millions. Deleted rows are not
// seen: the allocator notices them at their next fetch.
func (s *Store) Changes(ctx context.Context, cursor int64) ([]tagmodel.Change, int64, error) {
	var now int64
	if err := s.db.QueryRowContext(ctx, "SELECT CAST(UNIX_TIMESTAMP(NOW(6)) * 1000000 AS SIGNED)").Scan(&now); err != nil {
		return nil, 0, fmt.Errorf("mysql: changes: %w", err)
	}
	if cursor <= 0 {
		return nil, now, nil
	}
	since := time.UnixMicro(cursor).Add(-changesOverlap).UTC()
	rows, err := s.db.QueryContext(ctx, tagQuery+"WHERE l.update_time >= ?", since)
	if err != nil {
		return nil, 0, fmt.Errorf("mysql: changes: %w", err)
	}
	defer rows.Close()
	var out []tagmodel.Change
	for rows.Next() {
		t, _, err := scanTag(rows)
		if err != nil {
			return nil, 0, fmt.Errorf("mysql: changes: %w", err)
		}
		if tagmodel.ValidTag(t.Name) {
			out = append(out, tagmodel.Change{Tag: t})
		}
	}
	if err := rows.Err(); err != nil {
		return nil, 0, fmt.Errorf("mysql: changes: %w", err)
	}
	return out, now, nil
}
