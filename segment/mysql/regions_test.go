package mysql_test

import (
	"database/sql"
	"errors"
	"testing"
	"time"

	"github.com/dispenser-dev/dispenser/internal/leafsql"
	"github.com/dispenser-dev/dispenser/segment"
	"github.com/dispenser-dev/dispenser/segment/mysql"
	"github.com/dispenser-dev/dispenser/tagmodel"
)

// TestPerRegionRefusedBesideLeaf: per-region mode is refused on the MySQL
// store, whose leaf_alloc a live Leaf may serve: a region hands out a row's
// values v as v×2+1, Leaf as v, so the two would hand out the same IDs.
// On the code before, the store recorded region 1 of 2 on a table without
// tags, a tag created later was served by both, and ID 11 went to both
// (dispenser's first segment [1,11) as 3, 5, …, 21; Leaf's next [11,21)).
// A table recorded for per-region mode by such a version is refused too,
// for every setting.
func TestPerRegionRefusedBesideLeaf(t *testing.T) {
	dsn := newDB(t)
	db := openDB(t, dsn)
	store := mysql.New(db)
	r := tagmodel.Regions{Count: 2, Region: 1}
	err := tagmodel.CheckRegions(ctx, store, r)
	if err == nil {
		servedTwice(t, dsn, store, r)
		t.Fatalf("CheckRegions(%s) on leaf_alloc = nil, want refused with %v", r, tagmodel.ErrInvalidArgument)
	}
	if !errors.Is(err, tagmodel.ErrInvalidArgument) {
		t.Fatalf("CheckRegions(%s) on leaf_alloc = %v, want %v", r, err, tagmodel.ErrInvalidArgument)
	}
	if _, found, err := store.ReadRegions(ctx); err != nil || found {
		t.Fatalf("after the refusal ReadRegions = found %v, %v; want nothing recorded", found, err)
	}

	// A table an earlier version recorded for per-region mode.
	old := openDB(t, newDB(t))
	if _, err := old.ExecContext(ctx, "INSERT INTO dispenser_region (id, regions, region) VALUES (1, 2, 1)"); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		r    tagmodel.Regions
	}{
		{"its own settings", r},
		{"one region", tagmodel.Regions{}},
	} {
		if err := tagmodel.CheckRegions(ctx, mysql.New(old), tc.r); !errors.Is(err, tagmodel.ErrInvalidArgument) {
			t.Errorf("%s: CheckRegions(%s) on a table recorded for per-region mode = %v, want %v", tc.name, tc.r, err, tagmodel.ErrInvalidArgument)
		}
	}
}

// servedTwice serves a tag created now from dispenser as region r and from
// Leaf's own statements, and fails the test on an ID handed out by both.
func servedTwice(t *testing.T, dsn string, store *mysql.Store, r tagmodel.Regions) {
	t.Helper()
	if err := store.CreateTag(ctx, tagmodel.Tag{Name: "orders", Step: 10, MaxID: 1}); err != nil {
		t.Fatal(err)
	}
	a, err := segment.New(segment.Settings{Store: store, Regions: r, MaxWait: 30 * time.Second, IdleTimeout: -1})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close(ctx)
	leafDB, err := sql.Open("mysql", dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer leafDB.Close()
	// dispenser's IDs run at twice the row's values: Leaf's raw values
	// meet them as dispenser hands out its segments.
	ids := newIDSet()
	start, end, err := int64(0), int64(0), error(nil)
	var runs []segment.Run
	for i := range 4 {
		if runs, err = a.Take(ctx, "orders", 10, runs[:0]); err != nil {
			t.Fatal(err)
		}
		for _, run := range runs {
			ids.add("orders", run.First, run.Last+1, "dispenser as "+r.String())
		}
		if i == 0 {
			if start, end, err = leafsql.Fetch(ctx, leafDB, "orders", 0); err != nil {
				t.Fatal(err)
			}
			ids.add("orders", start, end, "Leaf")
		}
	}
	t.Logf("Leaf's segment: [%d,%d)", start, end)
	ids.check(t)
}
