package testenv

import (
	"context"
	"database/sql"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestMySQL: each call gives a new, empty, usable database that compares
// names byte for byte, dropped at the end of the test.
func TestMySQL(t *testing.T) {
	var names []string
	t.Run("two databases", func(t *testing.T) {
		a, b := MySQL(t), MySQL(t)
		if a == b {
			t.Fatalf("two calls gave the same DSN %q", a)
		}
		for _, dsn := range []string{a, b} {
			db, err := sql.Open("mysql", dsn)
			if err != nil {
				t.Fatal(err)
			}
			defer db.Close()
			var name, collation string
			if err := db.QueryRowContext(context.Background(), "SELECT DATABASE(), @@collation_database").Scan(&name, &collation); err != nil {
				t.Fatal(err)
			}
			if collation != "utf8mb4_bin" {
				t.Errorf("database %s has collation %s, want utf8mb4_bin", name, collation)
			}
			if _, err := db.Exec("CREATE TABLE t (a varchar(10) PRIMARY KEY)"); err != nil {
				t.Fatal(err)
			}
			if _, err := db.Exec("INSERT INTO t VALUES ('b'), ('B')"); err != nil {
				t.Errorf("'b' and 'B' in one primary key: %v, want both", err)
			}
			names = append(names, name)
		}
	})
	admin, err := mysqlShared()
	if err != nil {
		t.Fatal(err)
	}
	db, err := sql.Open("mysql", admin.FormatDSN())
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	for _, name := range names {
		var n int
		if err := db.QueryRow("SELECT COUNT(*) FROM information_schema.schemata WHERE schema_name = ?", name).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n != 0 {
			t.Errorf("database %s still exists after its test", name)
		}
	}
}

// TestFindMariaDBMissing: without the programs the error says what to
// install.
func TestFindMariaDBMissing(t *testing.T) {
	empty := t.TempDir()
	_, _, err := findMariaDB([]string{empty})
	if err == nil || !strings.Contains(err.Error(), "apt-get install --no-install-recommends mariadb-server") {
		t.Fatalf("findMariaDB in an empty directory = %v, want an error naming mariadb-server", err)
	}
	// Only the server is not enough.
	if err := os.WriteFile(filepath.Join(empty, "mariadbd"), []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	if _, _, err := findMariaDB([]string{empty}); err == nil {
		t.Fatal("findMariaDB with mariadbd alone succeeded, want an error")
	}
	if err := os.WriteFile(filepath.Join(empty, "mariadb-install-db"), []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	server, install, err := findMariaDB([]string{empty})
	if err != nil || server != filepath.Join(empty, "mariadbd") || install != filepath.Join(empty, "mariadb-install-db") {
		t.Errorf("findMariaDB = %q, %q, %v, want both in %s", server, install, err, empty)
	}
}
