package main

import (
	"context"
	"database/sql"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/dispenser-dev/dispenser/internal/leafsql"
	"github.com/dispenser-dev/dispenser/segment/mysql"
	"github.com/dispenser-dev/dispenser/segment/postgres"
	"github.com/dispenser-dev/dispenser/tagmodel"
	"github.com/dispenser-dev/dispenser/testenv"
)

// TestMySQLCommands: migrate, tags and serve take --mysql-url; serve hands
// out the IDs of a tag created with tags create, above what a Leaf server
// took from the same table meanwhile; --mysql-url and --postgres-url
// together are refused.
func TestMySQLCommands(t *testing.T) {
	dsn := testenv.MySQL(t)
	steps := []struct {
		name    string
		args    []string
		wantErr bool
		want    string
	}{
		{"migrate", []string{"migrate", "--mysql-url", dsn}, false, "created table leaf_alloc\ncreated table dispenser_tag\ncreated table dispenser_period\n"},
		{"migrate again", []string{"migrate", "--mysql-url", dsn}, false, "tables are up to date\n"},
		{"migrate with both stores", []string{"migrate", "--mysql-url", dsn, "--postgres-url", "postgres://x@127.0.0.1:1/db"}, true, "give one segment store"},
		{"migrate a bad DSN", []string{"migrate", "--mysql-url", "not a dsn"}, true, "mysql: DSN"},
		{"create", []string{"tags", "create", "orders", "--step", "100", "--description", "order numbers", "--mysql-url", dsn}, false, "created tag orders"},
		{"create ordered", []string{"tags", "create", "invoices", "--step", "10", "--ordered", "--mysql-url", dsn}, false, "ordered yes"},
		{"create existing", []string{"tags", "create", "orders", "--step", "5", "--mysql-url", dsn}, true, "already exists"},
		{"update", []string{"tags", "update", "orders", "--step", "50", "--mysql-url", dsn}, false, "step 50"},
		{"list", []string{"tags", "list", "--mysql-url", dsn}, false, "orders    1        50"},
		{"list with both stores", []string{"tags", "list", "--mysql-url", dsn, "--postgres-url", "postgres://x@127.0.0.1:1/db"}, true, "give one segment store"},
	}
	for _, st := range steps {
		out, err := runCmd(t, st.args...)
		if (err != nil) != st.wantErr || !strings.Contains(out+errString(err), st.want) {
			t.Fatalf("%s: %v: err %v, output:\n%s\nwant error %v and %q", st.name, st.args, err, out, st.wantErr, st.want)
		}
	}

	leafDB, err := sql.Open("mysql", dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer leafDB.Close()
	ctx := context.Background()
	_, leafEnd, err := leafsql.Fetch(ctx, leafDB, "orders", 0) // Leaf takes [1, 51)
	if err != nil {
		t.Fatal(err)
	}
	ns := testenv.NATS(t)
	logs := startServe(t, "serve", "--nats-url", ns.ClientURL(), "--mysql-url", dsn, "--snowflake=false")
	nc := testenv.Connect(t, ns)
	got := waitForID(t, nc, "id.segment.orders", logs)
	if id, err := strconv.ParseInt(got, 10, 64); err != nil || id < leafEnd {
		t.Errorf("first ID served = %q, want one at or above %d, Leaf's segment's end", got, leafEnd)
	}
	if out, err := runCmd(t, "serve", "--nats-url", ns.ClientURL(), "--mysql-url", dsn, "--postgres-url", "postgres://x@127.0.0.1:1/db"); err == nil || !strings.Contains(err.Error(), "give one segment store") {
		t.Errorf("serve with both stores: %v\n%s, want refused", err, out)
	}
}

func errString(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

// TestTagsImport: tags import copies Leaf's rows into PostgreSQL from
// Leaf's max_id plus the margin; a tag already there is raised to that if
// lower and kept if higher, never lowered; a row with a name dispenser
// refuses is reported, and the import fails after importing the others.
// Bad flags change nothing.
func TestTagsImport(t *testing.T) {
	dsn := testenv.MySQL(t)
	pg := testenv.Postgres(t)
	for _, args := range [][]string{{"migrate", "--mysql-url", dsn}, {"migrate", "--postgres-url", pg}} {
		if out, err := runCmd(t, args...); err != nil {
			t.Fatalf("%v: %v\n%s", args, err, out)
		}
	}
	leafDB, err := sql.Open("mysql", dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer leafDB.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	// Rows as Leaf's operators insert them.
	if _, err := leafDB.ExecContext(ctx, `INSERT INTO leaf_alloc (biz_tag, max_id, step, description) VALUES
('orders', 1, 1000, 'order numbers'), ('users', 5, 10, NULL), ('payments', 500, 20, 'pay'), ('bad name', 3, 10, NULL)`); err != nil {
		t.Fatal(err)
	}
	for range 3 { // a Leaf server takes orders up to 3001
		if _, _, err := leafsql.Fetch(ctx, leafDB, "orders", 0); err != nil {
			t.Fatal(err)
		}
	}
	for _, args := range [][]string{
		{"tags", "create", "users", "--step", "10", "--start", "1000000", "--postgres-url", pg},
		{"tags", "create", "payments", "--step", "20", "--start", "7", "--postgres-url", pg},
	} {
		if out, err := runCmd(t, args...); err != nil {
			t.Fatalf("%v: %v\n%s", args, err, out)
		}
	}
	list := func() string {
		t.Helper()
		out, err := runCmd(t, "tags", "list", "--postgres-url", pg)
		if err != nil {
			t.Fatalf("tags list: %v\n%s", err, out)
		}
		return out
	}
	before := list()
	bad := []struct {
		name string
		args []string
		want string
	}{
		{"no margin", []string{"--from-mysql-url", dsn}, "--margin is required"},
		{"negative margin", []string{"--from-mysql-url", dsn, "--margin", "-5"}, "--margin is required"},
		{"margin not a number", []string{"--from-mysql-url", dsn, "--margin", "lots"}, "--margin=lots: want a whole number"},
		{"no source", []string{"--margin", "10"}, "--from-mysql-url is required"},
		{"bad source", []string{"--from-mysql-url", "leaf.example", "--margin", "10"}, "--from-mysql-url: mysql: DSN"},
		{"an argument", []string{"orders", "--from-mysql-url", dsn, "--margin", "10"}, "want no arguments"},
		{"into itself", []string{"--from-mysql-url", dsn, "--mysql-url", dsn, "--margin", "10"}, "same database"},
		{"margin past 2^63-1", []string{"--from-mysql-url", dsn, "--margin", "9223372036854775000"}, "not in 1..2^63-1"},
	}
	for _, tt := range bad {
		t.Run(tt.name, func(t *testing.T) {
			args := append([]string{"tags", "import", "--postgres-url", pg}, tt.args...)
			out, err := runCmd(t, args...)
			if err == nil || !strings.Contains(out+err.Error(), tt.want) {
				t.Errorf("%v: %v\n%s\nwant an error saying %q", args, err, out, tt.want)
			}
			if after := list(); after != before {
				t.Errorf("a refused import changed the store:\nbefore:\n%s\nafter:\n%s", before, after)
			}
		})
	}

	out, err := runCmd(t, "tags", "import", "--from-mysql-url", dsn, "--margin", "100000", "--postgres-url", pg)
	if err == nil || !strings.Contains(err.Error(), "1 of 4 tags not imported") {
		t.Errorf("import with a bad row: %v, want 1 of 4 not imported", err)
	}
	for _, want := range []string{
		`bad name: NOT imported: segment: invalid tag "bad name"`,
		"orders: created, first ID 103001 (Leaf's max_id 3001 + margin 100000), step 1000",
		"payments: raised: next ID 100501, was 7 (Leaf's max_id 500 + margin 100000)",
		"users: kept: next ID 1000000 is not below 100005",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("import output lacks %q:\n%s", want, out)
		}
	}
	after := list()
	for _, want := range []string{"orders    103001", "payments  100501", "users     1000000", "order numbers"} {
		if !strings.Contains(after, want) {
			t.Errorf("tags list after the import lacks %q:\n%s", want, after)
		}
	}
	// Again: everything is kept, nothing lowered (margin 0 is below).
	out, _ = runCmd(t, "tags", "import", "--from-mysql-url", dsn, "--margin", "0", "--postgres-url", pg)
	if strings.Count(out, "kept") != 3 {
		t.Errorf("second import: want 3 tags kept:\n%s", out)
	}
	if again := list(); again != after {
		t.Errorf("a second import changed the store:\nbefore:\n%s\nafter:\n%s", after, again)
	}
}

// TestTagsImportRegions: tags import takes the region flags as tags create
// does: on a new store it records them before its first tag, so that the
// region's workers and commands are accepted there, and a store of other
// region settings is refused, unchanged.
func TestTagsImportRegions(t *testing.T) {
	dsn := testenv.MySQL(t)
	pg := testenv.Postgres(t)
	steps := []struct {
		name    string
		args    []string
		wantErr bool
		want    string
	}{
		{"migrate MySQL", []string{"migrate", "--mysql-url", dsn}, false, ""},
		{"migrate PostgreSQL", []string{"migrate", "--postgres-url", pg}, false, ""},
		{"a Leaf row", []string{"tags", "create", "orders", "--step", "100", "--start", "5000", "--mysql-url", dsn}, false, ""},
		{"import into region 1 of 2", []string{"tags", "import", "--from-mysql-url", dsn, "--margin", "0", "--postgres-url", pg, "--regions", "2", "--region", "1"}, false, "orders: created"},
		{"region 1 goes on", []string{"tags", "create", "users", "--step", "10", "--postgres-url", pg, "--regions", "2", "--region", "1"}, false, "created tag users"},
		{"import as region 0", []string{"tags", "import", "--from-mysql-url", dsn, "--margin", "7000", "--postgres-url", pg, "--regions", "2", "--region", "0"}, true, "store belongs to another region"},
		{"import as one region", []string{"tags", "import", "--from-mysql-url", dsn, "--margin", "7000", "--postgres-url", pg}, true, "store belongs to another region"},
		{"unchanged", []string{"tags", "list", "--postgres-url", pg, "--regions", "2", "--region", "1"}, false, "orders  5000"},
	}
	for _, st := range steps {
		out, err := runCmd(t, st.args...)
		if (err != nil) != st.wantErr || !strings.Contains(out+errString(err), st.want) {
			t.Fatalf("%s: %v: err %v, output:\n%s\nwant error %v and %q", st.name, st.args, err, out, st.wantErr, st.want)
		}
	}
}

// TestTagsImportPeriods: a tag with a reset period served from MySQL
// hands out its numbers from its periods' rows (dispenser_period), not
// from its leaf_alloc row, whose max_id stays at the tag's start. tags
// import with margin 0, everything stopped (exact, as the docs say), and
// the reset period set again on the target as the docs say: the current
// period's numbers on PostgreSQL start above every number MySQL handed out
// in any period, so that no business number repeats.
func TestTagsImportPeriods(t *testing.T) {
	dsn := testenv.MySQL(t)
	pg := testenv.Postgres(t)
	for _, args := range [][]string{
		{"migrate", "--mysql-url", dsn},
		{"migrate", "--postgres-url", pg},
		{"tags", "create", "inv", "--step", "10", "--reset", "month", "--format", "INV-{date:200601}-{seq:6}", "--mysql-url", dsn},
	} {
		if out, err := runCmd(t, args...); err != nil {
			t.Fatalf("%v: %v\n%s", args, err, out)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	period := tagmodel.PeriodName("inv", time.Now().UTC().Format("200601"))
	my, err := mysql.Open(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer my.Close()
	var served int64 // MySQL's period hands out [1, served)
	for range 3 {
		a, err := my.Fetch(ctx, period, 0)
		if err != nil {
			t.Fatal(err)
		}
		served = a.End
	}
	for _, args := range [][]string{
		{"tags", "import", "--from-mysql-url", dsn, "--margin", "0", "--postgres-url", pg},
		{"tags", "update", "inv", "--reset", "month", "--format", "INV-{date:200601}-{seq:6}", "--postgres-url", pg},
	} {
		if out, err := runCmd(t, args...); err != nil {
			t.Fatalf("%v: %v\n%s", args, err, out)
		}
	}
	ps, err := postgres.Open(ctx, pg)
	if err != nil {
		t.Fatal(err)
	}
	defer ps.Close()
	a, err := ps.Fetch(ctx, period, 0)
	if err != nil {
		t.Fatal(err)
	}
	if a.Start < served {
		t.Errorf("period %s on PostgreSQL after the import hands out [%d, %d), want above %d: MySQL handed out [1, %d) of it", period, a.Start, a.End, served, served)
	}

	// A table of Leaf alone (no dispenser_period) imports as before.
	leafOnly := testenv.MySQL(t)
	leafDB, err := sql.Open("mysql", leafOnly)
	if err != nil {
		t.Fatal(err)
	}
	defer leafDB.Close()
	for _, q := range []string{
		"CREATE TABLE leaf_alloc (biz_tag varchar(128) NOT NULL DEFAULT '', max_id bigint(20) NOT NULL DEFAULT '1', step int(11) NOT NULL, description varchar(256) DEFAULT NULL, update_time timestamp NOT NULL DEFAULT CURRENT_TIMESTAMP ON UPDATE CURRENT_TIMESTAMP, PRIMARY KEY (biz_tag)) ENGINE=InnoDB",
		"INSERT INTO leaf_alloc (biz_tag, max_id, step) VALUES ('leafonly', 700, 10)",
	} {
		if _, err := leafDB.ExecContext(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	out, err := runCmd(t, "tags", "import", "--from-mysql-url", leafOnly, "--margin", "0", "--postgres-url", pg)
	if want := "leafonly: created, first ID 700"; err != nil || !strings.Contains(out, want) {
		t.Errorf("import of a table of Leaf alone: %v\n%s\nwant %q", err, out, want)
	}
}
