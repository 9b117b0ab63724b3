package mysql

import (
	"context"
	"database/sql"
	"fmt"
	"slices"
	"strings"

	"github.com/dispenser-dev/dispenser/schema"
)

// LeafAllocDDL is Meituan Leaf's own CREATE TABLE of leaf_alloc
// (scripts/leaf_alloc.sql in Leaf's repository), word for word but for IF
// NOT EXISTS: Migrate leaves an existing table, Leaf's or anybody's, as it
// is. Its character set and collation are the database's: create the
// database with COLLATE utf8mb4_bin so that tags differing only in case
// are different tags, as everywhere else in dispenser (with a
// case-insensitive collation they are one row, and creating the second
// fails with tagmodel.ErrTagExists). It is the first of tables.
var LeafAllocDDL = tables[0].ddl

// tables are the tables the store needs, in creation order: the embedded
// migrations schema/mysql/NNN_TABLE.sql (package schema, where each
// table's columns are documented), each a CREATE TABLE IF NOT EXISTS.
var tables = func() []struct{ name, ddl string } {
	var ts []struct{ name, ddl string }
	for _, m := range schema.Load(schema.MySQL) {
		_, name, _ := strings.Cut(m.Name, "_")
		ts = append(ts, struct{ name, ddl string }{name, m.SQL})
	}
	return ts
}()

// Migrate creates the tables the store needs where missing: leaf_alloc as
// Leaf creates it, and dispenser's own dispenser_tag, dispenser_period and
// dispenser_region.
// It changes no existing table, so Leaf servers keep working on
// leaf_alloc. It returns the names of the tables it created.
func Migrate(ctx context.Context, db *sql.DB) ([]string, error) {
	missing, err := Missing(ctx, db)
	if err != nil {
		return nil, err
	}
	for _, t := range tables {
		if !slices.Contains(missing, t.name) {
			continue
		}
		if _, err := db.ExecContext(ctx, t.ddl); err != nil {
			return nil, fmt.Errorf("mysql: migrate: create table %s: %w", t.name, err)
		}
	}
	return missing, nil
}

// Missing returns the names of the tables the store needs that the
// database lacks (none: Migrate has run).
func Missing(ctx context.Context, db *sql.DB) ([]string, error) {
	rows, err := db.QueryContext(ctx, `SELECT table_name FROM information_schema.tables WHERE table_schema = DATABASE()`)
	if err != nil {
		return nil, fmt.Errorf("mysql: reading the tables: %w", err)
	}
	defer rows.Close()
	have := map[string]bool{}
	for rows.Next() {
		var n string
		if err := rows.Scan(&n); err != nil {
			return nil, fmt.Errorf("mysql: reading the tables: %w", err)
		}
		have[strings.ToLower(n)] = true
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("mysql: reading the tables: %w", err)
	}
	var missing []string
	for _, t := range tables {
		if !have[t.name] {
			missing = append(missing, t.name)
		}
	}
	return missing, nil
}
