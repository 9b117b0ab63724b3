package schema

import (
	"context"
	"fmt"
	"os"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"

	"github.com/dispenser-dev/dispenser/testenv"
	"github.com/jackc/pgx/v5/pgxpool"
)

func TestMain(m *testing.M) { os.Exit(testenv.Run(m)) }

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
// whether anything changed.
func dump(tb testing.TB, db *pgxpool.Pool) string {
	tb.Helper()
	queries := []string{
		`SELECT table_name || '.' || column_name || ' ' || data_type || ' null=' || is_nullable || ' default=' || coalesce(column_default, '')
		   FROM information_schema.columns WHERE table_schema = 'public' ORDER BY table_name, ordinal_position`,
		`SELECT version || ' ' || applied_at::text FROM ` + VersionTable + ` ORDER BY version`,
		`SELECT concat_ws(' ', biz_tag, max_id, step, description, update_time) FROM leaf_alloc ORDER BY biz_tag`,
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

func TestVersions(t *testing.T) {
	got := Versions()
	if len(got) == 0 || got[0] != "001_leaf_alloc" {
		t.Fatalf("Versions() = %q, want it to start with 001_leaf_alloc", got)
	}
	if !sort.StringsAreSorted(got) {
		t.Errorf("Versions() = %q, not sorted", got)
	}
	for _, v := range got {
		if strings.HasSuffix(v, ".sql") {
			t.Errorf("version %q has the .sql suffix", v)
		}
	}
}

func TestMigrateAppliesAll(t *testing.T) {
	db := newPool(t, testenv.Postgres(t))
	if got, want := migrateOK(t, db), Versions(); !slices.Equal(got, want) {
		t.Fatalf("applied %q, want %q", got, want)
	}
	ctx := context.Background()
	// The Leaf table works with its defaults.
	if _, err := db.Exec(ctx, "INSERT INTO leaf_alloc (biz_tag, step) VALUES ('t', 1000)"); err != nil {
		t.Fatal(err)
	}
	var maxID int64
	var step int32
	if err := db.QueryRow(ctx, "SELECT max_id, step FROM leaf_alloc WHERE biz_tag = 't'").Scan(&maxID, &step); err != nil {
		t.Fatal(err)
	}
	if maxID != 1 || step != 1000 {
		t.Errorf("max_id, step = %d, %d, want 1, 1000", maxID, step)
	}
	d := dump(t, db)
	for _, want := range []string{
		"leaf_alloc.biz_tag character varying null=NO",
		"leaf_alloc.max_id bigint null=NO default=1",
		"leaf_alloc.step integer null=NO",
		"leaf_alloc.description character varying null=YES",
		"leaf_alloc.update_time timestamp with time zone null=NO default=now()",
		"\n001_leaf_alloc ",
	} {
		if !strings.Contains(d, want) {
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
	if want := Versions(); !slices.Equal(applied, want) {
		t.Errorf("applied together %q, want each of %q once", applied, want)
	}
}

func TestMigrateKeepsLeafTable(t *testing.T) {
	db := newPool(t, testenv.Postgres(t))
	ctx := context.Background()
	// A leaf_alloc that a team brings from Leaf, with its data.
	_, err := db.Exec(ctx, `
		CREATE TABLE leaf_alloc (
			biz_tag     varchar(128) NOT NULL DEFAULT '' PRIMARY KEY,
			max_id      bigint       NOT NULL DEFAULT 1,
			step        int          NOT NULL,
			description varchar(256) DEFAULT NULL,
			update_time timestamp    NOT NULL DEFAULT CURRENT_TIMESTAMP
		);
		INSERT INTO leaf_alloc (biz_tag, max_id, step, description) VALUES
			('leaf-segment-test', 1, 2000, 'Test leaf Segment Mode Get Id'),
			('orders', 987654321, 5000, NULL);`)
	if err != nil {
		t.Fatal(err)
	}
	before := dump(t, db)
	if got, want := migrateOK(t, db), Versions(); !slices.Equal(got, want) {
		t.Fatalf("applied %q, want %q", got, want)
	}
	after := dump(t, db)
	// Only the version table is new; the Leaf table and its rows are as they were.
	var kept []string
	for _, line := range strings.Split(after, "\n") {
		if !strings.HasPrefix(line, VersionTable+".") && !strings.HasPrefix(line, "001_") {
			kept = append(kept, line)
		}
	}
	if got := strings.Join(kept, "\n"); got != before {
		t.Errorf("Migrate changed the Leaf table:\nbefore:\n%s\nafter:\n%s", before, after)
	}
	if !strings.Contains(before, "orders 987654321 5000") {
		t.Errorf("test setup: rows missing from dump:\n%s", before)
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
