package mysql_test

import (
	"database/sql"
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/dispenser-dev/dispenser/segment/mysql"
	"github.com/dispenser-dev/dispenser/tagmodel"
	"github.com/dispenser-dev/dispenser/testenv"
)

// exec runs SQL directly on db.
func exec(tb testing.TB, db *sql.DB, query string, args ...any) {
	tb.Helper()
	if _, err := db.ExecContext(ctx, query, args...); err != nil {
		tb.Fatalf("%s: %v", query, err)
	}
}

// leafRowsQuery reads every row of leaf_alloc, every column, as text.
const leafRowsQuery = "SELECT CONCAT_WS('|', biz_tag, max_id, step, description, update_time) FROM leaf_alloc ORDER BY biz_tag"

// leafRows returns every row of leaf_alloc as text.
func leafRows(tb testing.TB, db *sql.DB) string {
	tb.Helper()
	return rowsText(tb, db, leafRowsQuery)
}

// rowsText returns the rows of a query of one text column, one a line.
func rowsText(tb testing.TB, db *sql.DB, queries ...string) string {
	tb.Helper()
	var b strings.Builder
	for _, q := range queries {
		rows, err := db.QueryContext(ctx, q)
		if err != nil {
			tb.Fatalf("snapshot: %v", err)
		}
		for rows.Next() {
			var s string
			if err := rows.Scan(&s); err != nil {
				tb.Fatalf("snapshot: %v", err)
			}
			b.WriteString(s + "\n")
		}
		rows.Close()
		b.WriteString("--\n")
	}
	return b.String()
}

// snapshot returns every row of the store's three tables, every column,
// as text, so that tests can check that an operation changed nothing.
func snapshot(tb testing.TB, db *sql.DB) string {
	tb.Helper()
	return rowsText(tb, db, leafRowsQuery,
		"SELECT CONCAT_WS('|', biz_tag, version, ordered, reset_period, time_zone, number_format, retention_days, periods_pruned_until) FROM dispenser_tag ORDER BY biz_tag",
		"SELECT CONCAT_WS('|', biz_tag, period_of, max_id, step, version, period_end) FROM dispenser_period ORDER BY biz_tag")
}

// checkErr fails the test unless err wraps want and reads as a store error.
func checkErr(tb testing.TB, err, want error) {
	tb.Helper()
	if !errors.Is(err, want) {
		tb.Fatalf("got error %v, want %v", err, want)
	}
	if !strings.HasPrefix(err.Error(), "mysql: ") {
		tb.Errorf("error %q lacks the mysql: prefix", err)
	}
}

// showCreate returns SHOW CREATE TABLE of table.
func showCreate(tb testing.TB, db *sql.DB, table string) string {
	tb.Helper()
	var name, ddl string
	if err := db.QueryRowContext(ctx, "SHOW CREATE TABLE "+table).Scan(&name, &ddl); err != nil {
		tb.Fatalf("SHOW CREATE TABLE %s: %v", table, err)
	}
	return ddl
}

// leafScript is the CREATE TABLE of Leaf's scripts/leaf_alloc.sql.
const leafScript = `CREATE TABLE ` + "`leaf_alloc`" + ` (
  ` + "`biz_tag`" + ` varchar(128)  NOT NULL DEFAULT '',
  ` + "`max_id`" + ` bigint(20) NOT NULL DEFAULT '1',
  ` + "`step`" + ` int(11) NOT NULL,
  ` + "`description`" + ` varchar(256)  DEFAULT NULL,
  ` + "`update_time`" + ` timestamp NOT NULL DEFAULT CURRENT_TIMESTAMP ON UPDATE CURRENT_TIMESTAMP,
  PRIMARY KEY (` + "`biz_tag`" + `)
) ENGINE=InnoDB;`

// TestMigrateKeepsLeafsTable: on a database where Leaf created leaf_alloc
// (its own script, without IF NOT EXISTS) and has rows, Migrate creates
// dispenser's own tables only: leaf_alloc and its rows stay exactly as
// they were. On an empty database it creates leaf_alloc as Leaf's script
// does. A second Migrate creates nothing.
func TestMigrateKeepsLeafsTable(t *testing.T) {
	leafs := openDB(t, testenv.MySQL(t))
	exec(t, leafs, leafScript)
	exec(t, leafs, "INSERT INTO leaf_alloc (biz_tag, max_id, step, description) VALUES ('leaf-test', 1, 2000, 'Test leaf Segment Mode Get Id')")
	beforeDDL, beforeRows := showCreate(t, leafs, "leaf_alloc"), leafRows(t, leafs)
	created, err := mysql.Migrate(ctx, leafs)
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{"dispenser_tag", "dispenser_period", "dispenser_region"}; !slices.Equal(created, want) {
		t.Errorf("Migrate created %q, want %q", created, want)
	}
	if got := showCreate(t, leafs, "leaf_alloc"); got != beforeDDL {
		t.Errorf("Migrate changed Leaf's table:\nbefore: %s\nafter: %s", beforeDDL, got)
	}
	if got := leafRows(t, leafs); got != beforeRows {
		t.Errorf("Migrate changed Leaf's rows:\nbefore: %s\nafter: %s", beforeRows, got)
	}

	fresh := openDB(t, testenv.MySQL(t))
	if created, err := mysql.Migrate(ctx, fresh); err != nil || len(created) != 4 {
		t.Fatalf("Migrate of an empty database = %q, %v, want the four tables", created, err)
	}
	if got, want := showCreate(t, fresh, "leaf_alloc"), beforeDDL; got != want {
		t.Errorf("leaf_alloc as Migrate creates it:\n%s\nwant it as Leaf's script creates it:\n%s", got, want)
	}
	if created, err := mysql.Migrate(ctx, fresh); err != nil || len(created) != 0 {
		t.Errorf("second Migrate = %q, %v, want nothing created", created, err)
	}
	if missing, err := mysql.Missing(ctx, fresh); err != nil || len(missing) != 0 {
		t.Errorf("Missing after Migrate = %q, %v, want none", missing, err)
	}
}

// newLegacyDB returns a Store on a database whose leaf_alloc has charset,
// the character set of Leaf's table where the database default was
// something else than utf8mb4_bin: latin1 (collation latin1_swedish_ci)
// was MySQL's default before 8.0, utf8mb4_0900_ai_ci or
// utf8mb4_general_ci since; all case-insensitive.
func newLegacyDB(tb testing.TB, charset string) (*mysql.Store, *sql.DB) {
	tb.Helper()
	db := openDB(tb, testenv.MySQL(tb))
	exec(tb, db, mysql.LeafAllocDDL+" DEFAULT CHARSET="+charset)
	if _, err := mysql.Migrate(ctx, db); err != nil {
		tb.Fatal(err)
	}
	return mysql.New(db), db
}

// TestCaseInsensitiveLeafTable: on a Leaf table whose collation ignores
// case, a tag is still only its exact name: a fetch, lookup or update of
// the name in another case is an unknown tag (not the other tag's row),
// and creating it is refused as existing, changing nothing.
func TestCaseInsensitiveLeafTable(t *testing.T) {
	for _, charset := range []string{"latin1", "utf8mb4 COLLATE utf8mb4_general_ci"} {
		t.Run(charset, func(t *testing.T) {
			s, db := newLegacyDB(t, charset)
			if err := s.CreateTag(ctx, tagmodel.Tag{Name: "orders", Step: 10, MaxID: 1}); err != nil {
				t.Fatal(err)
			}
			before := snapshot(t, db)
			_, err := s.Fetch(ctx, "Orders", 0)
			checkErr(t, err, tagmodel.ErrUnknownTag)
			_, _, err = s.FetchAbove(ctx, "ORDERS", 100, 0)
			checkErr(t, err, tagmodel.ErrUnknownTag)
			_, err = s.Tag(ctx, "ORDERS")
			checkErr(t, err, tagmodel.ErrUnknownTag)
			checkErr(t, s.UpdateTag(ctx, "Orders", tagmodel.Update{Step: new(int64(5))}), tagmodel.ErrUnknownTag)
			checkErr(t, s.CreateTag(ctx, tagmodel.Tag{Name: "Orders", Step: 10, MaxID: 1}), tagmodel.ErrTagExists)
			if after := snapshot(t, db); after != before {
				t.Errorf("operations on another case changed the tables:\nbefore:\n%s\nafter:\n%s", before, after)
			}
			if a, err := s.Fetch(ctx, "orders", 0); err != nil || a != (tagmodel.Allocation{Start: 1, End: 11, TagStep: 10}) {
				t.Errorf("Fetch(orders) = %+v, %v, want [1, 11)", a, err)
			}
		})
	}
}

// TestDescriptionOutsideCharset: a latin1 Leaf table cannot hold every
// character: a description it cannot hold is an invalid argument and
// changes nothing (strict mode, not a silent '?'); one it can is kept.
func TestDescriptionOutsideCharset(t *testing.T) {
	s, db := newLegacyDB(t, "latin1")
	if err := s.CreateTag(ctx, tagmodel.Tag{Name: "orders", Step: 10, MaxID: 1, Description: "Bestellungen für Köln"}); err != nil {
		t.Fatal(err)
	}
	if got, err := s.Tag(ctx, "orders"); err != nil || got.Description != "Bestellungen für Köln" {
		t.Errorf("Tag(orders) = %+v, %v, want the description kept", got, err)
	}
	if err := s.UpdateTag(ctx, "orders", tagmodel.Update{Description: new("Aufträge")}); err != nil {
		t.Fatalf("UpdateTag with a description latin1 holds: %v", err)
	}
	before := snapshot(t, db)
	checkErr(t, s.CreateTag(ctx, tagmodel.Tag{Name: "snow", Step: 10, MaxID: 1, Description: "雪"}), tagmodel.ErrInvalidArgument)
	checkErr(t, s.UpdateTag(ctx, "orders", tagmodel.Update{Description: new("订单"), Step: new(int64(7))}), tagmodel.ErrInvalidArgument)
	if after := snapshot(t, db); after != before {
		t.Errorf("refused writes changed the tables:\nbefore:\n%s\nafter:\n%s", before, after)
	}
}

// TestFetchNonPositiveStoredStep: a table inherited from Leaf may hold
// rows this store would not create; fetching them with their own step is
// refused and changes nothing, an explicit step still works.
func TestFetchNonPositiveStoredStep(t *testing.T) {
	db := openDB(t, newDB(t))
	s := mysql.New(db)
	exec(t, db, "INSERT INTO leaf_alloc (biz_tag, max_id, step) VALUES ('zero', 100, 0), ('negative', 100, -5)")
	for _, name := range []string{"zero", "negative"} {
		before := snapshot(t, db)
		_, err := s.Fetch(ctx, name, 0)
		checkErr(t, err, tagmodel.ErrInvalidStep)
		if after := snapshot(t, db); after != before {
			t.Errorf("Fetch(%s, 0) changed the tables:\nbefore:\n%s\nafter:\n%s", name, before, after)
		}
	}
	if got, err := s.Fetch(ctx, "zero", 5); err != nil || got != (tagmodel.Allocation{Start: 100, End: 105, TagStep: 0}) {
		t.Errorf("Fetch(zero, 5) = %+v, %v, want [100, 105)", got, err)
	}
}

// TestFetchAbove: the witness's fetch moves max_id above a floor and
// reports max_id as it was; a floor below max_id changes nothing of the
// fetch.
func TestFetchAbove(t *testing.T) {
	s := mysql.New(openDB(t, newDB(t)))
	if err := s.CreateTag(ctx, tagmodel.Tag{Name: "orders", Step: 10, MaxID: 1}); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name        string
		floor, step int64
		want        tagmodel.Allocation
		before      int64
	}{
		{name: "floor above", floor: 500, want: tagmodel.Allocation{Start: 500, End: 510, TagStep: 10}, before: 1},
		{name: "floor below", floor: 3, step: 5, want: tagmodel.Allocation{Start: 510, End: 515, TagStep: 10}, before: 510},
		{name: "floor equal", floor: 515, want: tagmodel.Allocation{Start: 515, End: 525, TagStep: 10}, before: 515},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			a, before, err := s.FetchAbove(ctx, "orders", tt.floor, tt.step)
			if err != nil || a != tt.want || before != tt.before {
				t.Errorf("FetchAbove(orders, %d, %d) = %+v, %d, %v, want %+v, %d", tt.floor, tt.step, a, before, err, tt.want, tt.before)
			}
		})
	}
	_, _, err := s.FetchAbove(ctx, "orders", -1, 0)
	checkErr(t, err, tagmodel.ErrInvalidArgument)
	_, _, err = s.FetchAbove(ctx, "nosuch", 10, 0)
	checkErr(t, err, tagmodel.ErrUnknownTag)
}

// TestOpenDB: DSNs that cannot work are refused with a clear error.
func TestOpenDB(t *testing.T) {
	for _, dsn := range []string{"postgres://u@h/db", "u@tcp(127.0.0.1:3306)/", "u@tcp(127.0.0.1:3306)"} {
		if _, err := mysql.OpenDB(dsn); err == nil || !strings.HasPrefix(err.Error(), "mysql: ") {
			t.Errorf("OpenDB(%q) = %v, want a mysql: error", dsn, err)
		}
	}
	if _, err := mysql.OpenDB("u:secret@tcp(127.0.0.1:3306)/"); err == nil || strings.Contains(err.Error(), "secret") {
		t.Errorf("OpenDB of a DSN without a database = %v, want an error without the password", err)
	}
	if _, err := mysql.Open(ctx, "root@tcp(127.0.0.1:1)/db?timeout=1s"); err == nil {
		t.Error("Open of a closed port succeeded")
	}
}
