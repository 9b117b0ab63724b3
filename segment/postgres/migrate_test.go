package postgres

import (
	"context"
	"fmt"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/dispenser-dev/dispenser/schema"
	"github.com/dispenser-dev/dispenser/testenv"
)

// newPool opens a pool on url and closes it in Cleanup.
func newPool(tb testing.TB, url string) *pgxpool.Pool {
	tb.Helper()
	pool, err := pgxpool.New(context.Background(), url)
	if err != nil {
		tb.Fatalf("pgxpool.New: %v", err)
	}
	tb.Cleanup(pool.Close)
	return pool
}

// migrateOK runs Migrate and fails the test on error.
func migrateOK(tb testing.TB, db *pgxpool.Pool) []string {
	tb.Helper()
	applied, err := Migrate(context.Background(), db)
	if err != nil {
		tb.Fatalf("Migrate: %v", err)
	}
	return applied
}

// dump describes the tables of the public schema, their columns, the
// recorded versions and the rows of leaf_alloc, so that tests can see
// whether anything changed. A row's ordered flag (migration 002) shows only
// when it is not NULL, so that the rows of a Leaf table read the same
// before and after the migration, unless something set the flag. A row's ordered flag (migration 002) is shown
// only when it is set (not NULL), so that the rows of a Leaf table read the
// same before and after the migration as long as nothing sets the flag.
func dump(tb testing.TB, db *pgxpool.Pool) string {
	tb.Helper()
	queries := []string{
		`SELECT table_name || '.' || column_name || ' ' || data_type || ' null=' || is_nullable || ' default=' || coalesce(column_default, '')
		   FROM information_schema.columns WHERE table_schema = 'public' ORDER BY table_name, ordinal_position`,
		`SELECT version || ' ' || applied_at::text FROM ` + VersionTable + ` ORDER BY version`,
		`SELECT concat_ws(' ', biz_tag, max_id, step, description, update_time, 'ordered=' || (to_jsonb(l) ->> 'ordered')) FROM leaf_alloc l ORDER BY biz_tag`,
	}
	var exists bool
	if err := db.QueryRow(context.Background(), "SELECT to_regclass($1) IS NOT NULL", VersionTable).Scan(&exists); err != nil {
		tb.Fatal(err)
	}
	if !exists {
		queries = slices.Delete(queries, 1, 2)
	}
	var b strings.Builder
	for _, q := range queries {
		rows, err := db.Query(context.Background(), q)
		if err != nil {
			tb.Fatalf("%s: %v", q, err)
		}
		for rows.Next() {
			var s string
			if err := rows.Scan(&s); err != nil {
				tb.Fatal(err)
			}
			fmt.Fprintln(&b, s)
		}
		if err := rows.Err(); err != nil {
			tb.Fatalf("%s: %v", q, err)
		}
	}
	return b.String()
}

// periodicColumns are the columns of migration 005 as dump shows them:
// nullable, without a default, so that Leaf's statements never see them
// and adding them rewrites no rows.
var periodicColumns = []string{
	"leaf_alloc.reset_period text null=YES default=",
	"leaf_alloc.time_zone text null=YES default=",
	"leaf_alloc.number_format text null=YES default=",
	"leaf_alloc.retention_days integer null=YES default=",
	"leaf_alloc.periods_pruned_until timestamp with time zone null=YES default=",
	"leaf_alloc.period_of character varying null=YES default=",
	"leaf_alloc.period_end timestamp with time zone null=YES default=",
}

func TestMigrateAppliesAll(t *testing.T) {
	db := newPool(t, testenv.Postgres(t))
	if got, want := migrateOK(t, db), schema.Versions(); !slices.Equal(got, want) {
		t.Fatalf("applied %q, want %q", got, want)
	}
	ctx := context.Background()
	// The Leaf table works with its defaults.
	if _, err := db.Exec(ctx, "INSERT INTO leaf_alloc (biz_tag, step) VALUES ('t', 1000)"); err != nil {
		t.Fatal(err)
	}
	var maxID int64
	var step int32
	var ordered *bool
	if err := db.QueryRow(ctx, "SELECT max_id, step, ordered FROM leaf_alloc WHERE biz_tag = 't'").Scan(&maxID, &step, &ordered); err != nil {
		t.Fatal(err)
	}
	if maxID != 1 || step != 1000 || ordered != nil {
		t.Errorf("max_id, step, ordered = %d, %d, %v, want 1, 1000, NULL", maxID, step, ordered)
	}
	d := dump(t, db)
	for _, want := range []string{
		"leaf_alloc.biz_tag character varying null=NO",
		"leaf_alloc.max_id bigint null=NO default=1",
		"leaf_alloc.step integer null=NO",
		"leaf_alloc.description character varying null=YES",
		"leaf_alloc.update_time timestamp with time zone null=NO default=now()",
		"leaf_alloc.ordered boolean null=YES default=\n",
		"leaf_alloc.dispenser_version bigint null=NO default=0\n",
		"\n005_periodic_tags ",
		"\n001_leaf_alloc ",
		"\n002_ordered_tags ",
		"\n004_give_back_version ",
	} {
		if !strings.Contains(d, want) {
			t.Errorf("schema lacks %q; have:\n%s", want, d)
		}
	}
	for _, want := range periodicColumns {
		if !strings.Contains(d, want+"\n") {
			t.Errorf("schema lacks %q; have:\n%s", want, d)
		}
	}
}

func TestMigrateTwiceChangesNothing(t *testing.T) {
	db := newPool(t, testenv.Postgres(t))
	migrateOK(t, db)
	before := dump(t, db)
	if got := migrateOK(t, db); len(got) != 0 {
		t.Errorf("second Migrate applied %q, want nothing", got)
	}
	if after := dump(t, db); after != before {
		t.Errorf("second Migrate changed the database:\nbefore:\n%s\nafter:\n%s", before, after)
	}
}

func TestMigrateConcurrently(t *testing.T) {
	url := testenv.Postgres(t)
	const n = 8
	pools := make([]*pgxpool.Pool, n) // one per "process"
	for i := range pools {
		pools[i] = newPool(t, url)
	}
	var (
		wg      sync.WaitGroup
		mu      sync.Mutex
		applied []string
		errs    []error
	)
	for _, db := range pools {
		wg.Go(func() {
			got, err := Migrate(context.Background(), db)
			mu.Lock()
			defer mu.Unlock()
			applied = append(applied, got...)
			if err != nil {
				errs = append(errs, err)
			}
		})
	}
	wg.Wait()
	for _, err := range errs {
		t.Errorf("Migrate: %v", err)
	}
	// Every migration was applied exactly once, by one of them.
	sort.Strings(applied)
	if want := schema.Versions(); !slices.Equal(applied, want) {
		t.Errorf("applied together %q, want each of %q once", applied, want)
	}
}

// leafDDL is the leaf_alloc table of Leaf's own scripts, with its example
// row and one more.
const leafDDL = `
	CREATE TABLE leaf_alloc (
		biz_tag     varchar(128) NOT NULL DEFAULT '' PRIMARY KEY,
		max_id      bigint       NOT NULL DEFAULT 1,
		step        int          NOT NULL,
		description varchar(256) DEFAULT NULL,
		update_time timestamp    NOT NULL DEFAULT CURRENT_TIMESTAMP
	);
	INSERT INTO leaf_alloc (biz_tag, max_id, step, description) VALUES
		('leaf-segment-test', 1, 2000, 'Test leaf Segment Mode Get Id'),
		('orders', 987654321, 5000, NULL);`

// leafStatements are the statements Leaf's segment mode runs on the table
// (IDAllocMapper, and the README's INSERT), which must keep working after
// every migration.
var leafStatements = []string{
	`INSERT INTO leaf_alloc (biz_tag, max_id, step, description) VALUES ('leaf-new', 1, 100, 'added by Leaf')`,
	`SELECT biz_tag, max_id, step, update_time FROM leaf_alloc`,
	`SELECT biz_tag FROM leaf_alloc`,
	`UPDATE leaf_alloc SET max_id = max_id + step WHERE biz_tag = 'leaf-new'`,
	`UPDATE leaf_alloc SET max_id = max_id + 50 WHERE biz_tag = 'leaf-new'`,
	`SELECT biz_tag, max_id, step FROM leaf_alloc WHERE biz_tag = 'leaf-new'`,
}

// notOrdered fails the test unless every row of leaf_alloc has a NULL
// ordered flag (a plain tag, for dispenser).
func notOrdered(tb testing.TB, db *pgxpool.Pool) {
	tb.Helper()
	var n int
	if err := db.QueryRow(context.Background(), "SELECT count(*) FROM leaf_alloc WHERE ordered IS NOT NULL").Scan(&n); err != nil {
		tb.Fatal(err)
	}
	if n != 0 {
		tb.Errorf("%d rows have a non-NULL ordered flag, want none", n)
	}
}

func TestMigrateKeepsLeafTable(t *testing.T) {
	db := newPool(t, testenv.Postgres(t))
	ctx := context.Background()
	// A leaf_alloc that a team brings from Leaf, with its data.
	if _, err := db.Exec(ctx, leafDDL); err != nil {
		t.Fatal(err)
	}
	before := dump(t, db)
	if got, want := migrateOK(t, db), schema.Versions(); !slices.Equal(got, want) {
		t.Fatalf("applied %q, want %q", got, want)
	}
	after := dump(t, db)
	// The version table, the nullable column ordered, the column
	// dispenser_version (with a default) and the nullable columns of
	// periodic tags (migration 005) are new; the rest of the Leaf table
	// and its rows are as they were.
	const orderedColumn = "leaf_alloc.ordered boolean null=YES default="
	const versionColumn = "leaf_alloc.dispenser_version bigint null=NO default=0"
	periodic := map[string]int{}
	for _, c := range periodicColumns {
		periodic[c] = 0
	}
	var kept []string
	added, addedVersion := 0, 0
	for _, line := range strings.Split(after, "\n") {
		_, isPeriodic := periodic[line]
		switch {
		case line == orderedColumn:
			added++
		case line == versionColumn:
			addedVersion++
		case isPeriodic:
			periodic[line]++
		case strings.HasPrefix(line, VersionTable+"."):
		case slices.ContainsFunc(schema.Versions(), func(v string) bool { return strings.HasPrefix(line, v+" ") }):
		default:
			kept = append(kept, line)
		}
	}
	if added != 1 || addedVersion != 1 {
		t.Errorf("Migrate added the columns %q %d times and %q %d times, want once each:\n%s", orderedColumn, added, versionColumn, addedVersion, after)
	}
	for c, n := range periodic {
		if n != 1 {
			t.Errorf("Migrate added the column %q %d times, want once:\n%s", c, n, after)
		}
	}
	if got := strings.Join(kept, "\n"); got != before {
		t.Errorf("Migrate changed the Leaf table:\nbefore:\n%s\nafter:\n%s", before, after)
	}
	if !strings.Contains(before, "orders 987654321 5000") {
		t.Errorf("test setup: rows missing from dump:\n%s", before)
	}
	notOrdered(t, db)

	// Leaf itself keeps working on the migrated table, and its rows are
	// plain tags.
	for _, sql := range leafStatements {
		if _, err := db.Exec(ctx, sql); err != nil {
			t.Errorf("Leaf's %s: %v", sql, err)
		}
	}
	var maxID int64
	if err := db.QueryRow(ctx, "SELECT max_id FROM leaf_alloc WHERE biz_tag = 'leaf-new'").Scan(&maxID); err != nil || maxID != 151 {
		t.Errorf("max_id of Leaf's new row = %d, %v, want 151", maxID, err)
	}
	notOrdered(t, db)

	// Migrating again changes nothing.
	again := dump(t, db)
	if got := migrateOK(t, db); len(got) != 0 {
		t.Errorf("second Migrate applied %q, want nothing", got)
	}
	if d := dump(t, db); d != again {
		t.Errorf("second Migrate changed the database:\nbefore:\n%s\nafter:\n%s", again, d)
	}
}

// A database that dispenser migrated before ordered tags existed gets the
// column once, its rows untouched and plain; once more changes nothing.
func TestMigrateOrderedTagsOnExistingDatabase(t *testing.T) {
	db := newPool(t, testenv.Postgres(t))
	ctx := context.Background()
	migrateOK(t, db)
	// Back to the schema of 001, as an older dispenser left it, with rows.
	_, err := db.Exec(ctx, `
		ALTER TABLE leaf_alloc DROP COLUMN ordered;
		DELETE FROM `+VersionTable+` WHERE version = '002_ordered_tags';
		INSERT INTO leaf_alloc (biz_tag, max_id, step, description) VALUES ('orders', 1001, 1000, 'order numbers'), ('users', 42, 10, NULL);`)
	if err != nil {
		t.Fatal(err)
	}
	before := dump(t, db)
	if strings.Contains(before, "ordered") || !strings.Contains(before, "orders 1001 1000 order numbers") {
		t.Fatalf("test setup: want the schema of 001 with rows:\n%s", before)
	}
	if got, want := migrateOK(t, db), []string{"002_ordered_tags"}; !slices.Equal(got, want) {
		t.Fatalf("applied %q, want %q", got, want)
	}
	after := dump(t, db)
	for _, want := range []string{"leaf_alloc.ordered boolean null=YES default=\n", "orders 1001 1000 order numbers ", "users 42 10 ", "\n002_ordered_tags "} {
		if !strings.Contains(after, want) {
			t.Errorf("after Migrate: lacks %q:\n%s", want, after)
		}
	}
	notOrdered(t, db)
	if got := migrateOK(t, db); len(got) != 0 {
		t.Errorf("second Migrate applied %q, want nothing", got)
	}
	if d := dump(t, db); d != after {
		t.Errorf("second Migrate changed the database:\nbefore:\n%s\nafter:\n%s", after, d)
	}
	// The flag holds true, false and NULL, and dump shows a set one.
	if _, err := db.Exec(ctx, "UPDATE leaf_alloc SET ordered = true WHERE biz_tag = 'orders'"); err != nil {
		t.Fatal(err)
	}
	if d := dump(t, db); !strings.Contains(d, "ordered=true") {
		t.Errorf("dump does not show a set ordered flag:\n%s", d)
	}
}

func TestFailedMigrationLeavesNoTrace(t *testing.T) {
	db := newPool(t, testenv.Postgres(t))
	migrateOK(t, db)
	before := dump(t, db)
	err := migrate(context.Background(), db, "999_bad", "CREATE TABLE half (x int); SELECT no_such_function()")
	if err == nil || !strings.Contains(err.Error(), "schema: apply 999_bad") {
		t.Fatalf("migrate of bad SQL: got error %v, want one about 999_bad", err)
	}
	if after := dump(t, db); after != before {
		t.Errorf("failed migration changed the database:\nbefore:\n%s\nafter:\n%s", before, after)
	}
}

// TestMissing: a fresh database lacks every migration, a migrated one none,
// and one whose last migration was not applied lacks exactly that one.
func TestMissing(t *testing.T) {
	ctx := context.Background()
	pool := newPool(t, testenv.Postgres(t))
	missing, err := Missing(ctx, pool)
	if err != nil || !slices.Equal(missing, schema.Versions()) {
		t.Fatalf("fresh database: missing %v, %v; want %v", missing, err, schema.Versions())
	}
	if _, err := Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	if missing, err := Missing(ctx, pool); err != nil || len(missing) != 0 {
		t.Fatalf("migrated database: missing %v, %v; want none", missing, err)
	}
	last := schema.Versions()[len(schema.Versions())-1]
	if _, err := pool.Exec(ctx, "DELETE FROM "+VersionTable+" WHERE version = $1", last); err != nil {
		t.Fatal(err)
	}
	if missing, err := Missing(ctx, pool); err != nil || !slices.Equal(missing, []string{last}) {
		t.Fatalf("without %s: missing %v, %v", last, missing, err)
	}
}
