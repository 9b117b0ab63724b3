package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"

	"github.com/dispenser-dev/dispenser/tagmodel"
	"github.com/dispenser-dev/dispenser/worker/mysqlstore"
)

const importUsage = `dispenser tags import --from-mysql-url DSN --margin N [store flags]
Imports every row of Leaf's leaf_alloc table at DSN into the store (usually
--postgres-url): a tag missing there is created with Leaf's step and
description, starting at Leaf's max_id (or, for a tag with a reset period
served from this table, its periods' greatest) + N; an existing one whose max_id is
lower is raised to at least that; one already higher is kept. Nothing is
ever lowered. N covers what Leaf servers may still take after this reads
the table: 0 only if every Leaf server is stopped; see
docs/migrate-from-leaf.md.
store flags: --postgres-url URL, --mysql-url DSN (another database), or --nats-url URL [--segment-bucket B]`

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
	case sf.MySQLURL != "" && sf.MySQLURL == *from:
		return errors.New("tags import: --from-mysql-url and --mysql-url are the same database")
	}
	rows, err := mysqlstore.ReadLeafRows(ctx, *from)
	if err != nil {
		return fmt.Errorf("--from-mysql-url: %w", err)
	}
	// A margin that passes 2^63-1 for any row is a mistake: refuse it
	// before anything is written.
	for _, r := range rows {
		if m := max(r.MaxID, r.PeriodsMaxID); m > math.MaxInt64-*margin {
			return fmt.Errorf("tags import: --margin %d: Leaf's max_id %d of %q plus the margin is not in 1..2^63-1; nothing imported", *margin, m, r.Name)
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
	// As tags create: the store's region settings are recorded before its
	// first tag, and a store of other settings is refused, before
	// anything is written (tagmodel.CheckRegions).
	if rs, ok := st.Admin.(tagmodel.RegionStore); ok {
		if err := tagmodel.CheckRegions(ctx, rs, sf.Region.Segments()); err != nil {
			return fmt.Errorf("tags import: %w; nothing imported", err)
		}
	}
	var failed int
	for _, r := range rows {
		msg, err := mysqlstore.ImportLeafRow(ctx, st.Store, st.Admin, r, *margin)
		if err != nil {
			failed++
			fmt.Fprintf(stdout, "%s: NOT imported: %v\n", r.Name, err)
			continue
		}
		fmt.Fprintf(stdout, "%s: %s\n", r.Name, msg)
	}
	if failed > 0 {
		return fmt.Errorf("tags import: %d of %d tags not imported (see above); run it again once fixed: tags imported are kept or raised, never lowered", failed, len(rows))
	}
	return nil
}
