// Package schema holds dispenser's database migrations as embedded SQL
// files, one directory per database, found by one loader (Load): postgres/
// for the PostgreSQL store, applied and recorded by segment/postgres's
// Migrate, and mysql/ for the MySQL store, one CREATE TABLE IF NOT EXISTS
// per table, applied by segment/mysql's Migrate. Each store applies its
// own, so this package needs no database driver. A file is NNN_NAME.sql:
// NNN orders the files, and its leading comment lines document it.
package schema

import (
	"embed"
	"io/fs"
	"path"
	"sort"
	"strings"
)

//go:embed postgres/*.sql mysql/*.sql
var files embed.FS

// The directories of the two databases' migrations, for Load.
const (
	Postgres = "postgres"
	MySQL    = "mysql"
)

// Migration is one embedded migration file.
type Migration struct {
	// Name is the file name without ".sql", such as 001_leaf_alloc: for
	// PostgreSQL the version recorded in VersionTable.
	Name string
	// SQL is the file's statements, without the comment lines that head
	// it (the file's documentation).
	SQL string
}

// Load returns the embedded migrations of db (Postgres or MySQL) in the
// order they apply: by file name.
func Load(db string) []Migration {
	names, err := fs.Glob(files, db+"/*.sql")
	if err != nil {
		panic(err) // the pattern is valid
	}
	sort.Strings(names)
	out := make([]Migration, len(names))
	for i, n := range names {
		b, err := files.ReadFile(n)
		if err != nil {
			panic(err) // embedded: it is there
		}
		sql := string(b)
		for strings.HasPrefix(sql, "--") {
			_, sql, _ = strings.Cut(sql, "\n")
		}
		out[i] = Migration{Name: strings.TrimSuffix(path.Base(n), ".sql"), SQL: strings.TrimSpace(sql)}
	}
	return out
}

// Versions lists the embedded PostgreSQL migrations in the order they
// apply: their file names without ".sql".
func Versions() []string {
	var names []string
	for _, m := range Load(Postgres) {
		names = append(names, m.Name)
	}
	return names
}
