package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"sort"

	"github.com/dispenser-dev/dispenser/tagmodel"
	"github.com/dispenser-dev/dispenser/worker/mysqlstore"
)

const importUsage = `dispenser tags import --from-mysql-url DSN --margin N [store flags]
Imports every row of Leaf's leaf_alloc table at DSN into the store (usually
--postgres-url): a tag missing there is created with Leaf's step and
description, starting at Leaf's max_id + N; an existing one whose max_id is
lower is raised to at least that; one already higher is kept. Nothing is
ever lowered. N covers what Leaf servers may still take after this reads
the table: 0 only if every Leaf server is stopped; see
docs/migrate-from-leaf.md.
store flags: --postgres-url URL, --mysql-url DSN (another database), or --nats-url URL [--segment-bucket B]`

// raiser moves a tag's max_id up to at least a floor (segment/postgres and
// segment/mysql have it).
type raiser interface {
	FetchAbove(ctx context.Context, tag string, floor, step int64) (tagmodel.Allocation, int64, error)
}

// leafRow is a row of Leaf's leaf_alloc, Leaf's columns only.
type leafRow struct {
	name, description string
	maxID, step       int64
}

// importTags is `dispenser tags import`.
func importTags(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("tags import", importUsage, stderr)
	sf := addStoreFlags(fs)
	from := fs.String("from-mysql-url", "", "DSN of the MySQL database of Leaf's leaf_alloc, whose rows are imported (read only)")
	margin := fs.Int64("margin", -1, "IDs added to each Leaf max_id, above anything a Leaf server may still take (required; 0 only with every Leaf server stopped)")
	pos, err := parse(fs, args)
	if err != nil {
		return err
	}
	switch {
	case len(pos) > 0:
		return fmt.Errorf("tags import: want no arguments, got %q\nusage:\n%s", pos, importUsage)
	case *from == "":
		return errors.New("tags import: --from-mysql-url is required: the DSN of Leaf's database")
	case *margin < 0:
		return errors.New("tags import: --margin is required (at least 0): how far above Leaf's max_id each tag starts; see docs/migrate-from-leaf.md")
	case sf.mysqlURL != "" && sf.mysqlURL == *from:
		return errors.New("tags import: --from-mysql-url and --mysql-url are the same database")
	}
	rows, err := readLeafRows(ctx, *from)
	if err != nil {
		return err
	}
	// A margin that passes 2^63-1 for any row is a mistake: refuse it
	// before anything is written.
	for _, r := range rows {
		if r.maxID > math.MaxInt64-*margin {
			return fmt.Errorf("tags import: --margin %d: Leaf's max_id %d of %q plus the margin is not in 1..2^63-1; nothing imported", *margin, r.maxID, r.name)
		}
	}
	st, _, closeStore, err := sf.open(ctx)
	if err != nil {
		return err
	}
	defer closeStore()
	if st.Admin == nil {
		return errors.New("tags import: the store cannot create tags")
	}
	var failed int
	for _, r := range rows {
		msg, err := importTag(ctx, st.Store, st.Admin, r, *margin)
		if err != nil {
			failed++
			fmt.Fprintf(stdout, "%s: NOT imported: %v\n", r.name, err)
			continue
		}
		fmt.Fprintf(stdout, "%s: %s\n", r.name, msg)
	}
	if failed > 0 {
		return fmt.Errorf("tags import: %d of %d tags not imported (see above); run it again once fixed: tags imported are kept or raised, never lowered", failed, len(rows))
	}
	return nil
}

// readLeafRows reads every row of leaf_alloc at dsn, in name order.
func readLeafRows(ctx context.Context, dsn string) ([]leafRow, error) {
	db, err := mysqlstore.Connect(ctx, dsn)
	if err != nil {
		return nil, fmt.Errorf("--from-mysql-url: %w", err)
	}
	defer db.Close()
	rs, err := db.QueryContext(ctx, "SELECT biz_tag, max_id, step, COALESCE(description, '') FROM leaf_alloc")
	if err != nil {
		return nil, fmt.Errorf("--from-mysql-url: reading leaf_alloc: %w", err)
	}
	defer rs.Close()
	var rows []leafRow
	for rs.Next() {
		var r leafRow
		if err := rs.Scan(&r.name, &r.maxID, &r.step, &r.description); err != nil {
			return nil, fmt.Errorf("--from-mysql-url: reading leaf_alloc: %w", err)
		}
		rows = append(rows, r)
	}
	if err := rs.Err(); err != nil {
		return nil, fmt.Errorf("--from-mysql-url: reading leaf_alloc: %w", err)
	}
	sort.Slice(rows, func(i, j int) bool { return rows[i].name < rows[j].name })
	return rows, nil
}

// importTag imports one Leaf row into the store and says what it did.
func importTag(ctx context.Context, st tagmodel.Store, admin tagmodel.Admin, r leafRow, margin int64) (string, error) {
	if err := tagmodel.CheckTag(r.name); err != nil {
		return "", err
	}
	if r.maxID < 1 || r.maxID > math.MaxInt64-margin {
		return "", fmt.Errorf("Leaf's max_id %d plus the margin %d is not in 1..2^63-1", r.maxID, margin)
	}
	start := r.maxID + margin
	t, err := st.Tag(ctx, r.name)
	switch {
	case errors.Is(err, tagmodel.ErrUnknownTag):
		err := admin.CreateTag(ctx, tagmodel.Tag{Name: r.name, Step: r.step, MaxID: start, Description: r.description})
		if errors.Is(err, tagmodel.ErrTagExists) {
			return "", fmt.Errorf("created meanwhile by someone else: run the import again")
		}
		if err != nil {
			return "", err
		}
		return fmt.Sprintf("created, first ID %d (Leaf's max_id %d + margin %d), step %d", start, r.maxID, margin, r.step), nil
	case err != nil:
		return "", err
	case t.MaxID >= start:
		return fmt.Sprintf("kept: next ID %d is not below %d (Leaf's max_id %d + margin %d)", t.MaxID, start, r.maxID, margin), nil
	}
	rs, ok := st.(raiser)
	if !ok {
		return "", fmt.Errorf("exists with next ID %d, below %d (Leaf's max_id %d + margin %d), and this store cannot raise it", t.MaxID, start, r.maxID, margin)
	}
	// max_id becomes greatest(max_id, start) + 1: at least start, never
	// lower than it was (the one ID in between is skipped).
	a, before, err := rs.FetchAbove(ctx, r.name, start, 1)
	if err != nil {
		return "", err
	}
	return fmt.Sprintf("raised: next ID %d, was %d (Leaf's max_id %d + margin %d)", a.End, before, r.maxID, margin), nil
}
