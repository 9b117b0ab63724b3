package testenv

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

func TestMain(m *testing.M) { os.Exit(Run(m)) }

// connect opens a connection to url and closes it in Cleanup.
func connect(tb testing.TB, url string) *pgx.Conn {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		tb.Fatalf("connect to %s: %v", url, err)
	}
	tb.Cleanup(func() { conn.Close(context.Background()) })
	return conn
}

// queryString runs a query that returns one text value.
func queryString(tb testing.TB, conn *pgx.Conn, sql string) string {
	tb.Helper()
	var s string
	if err := conn.QueryRow(context.Background(), sql).Scan(&s); err != nil {
		tb.Fatalf("%s: %v", sql, err)
	}
	return s
}

// databaseExists reports whether the server that conn is on has database name.
func databaseExists(tb testing.TB, conn *pgx.Conn, name string) bool {
	tb.Helper()
	var ok bool
	err := conn.QueryRow(context.Background(), "SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)", name).Scan(&ok)
	if err != nil {
		tb.Fatalf("look up database %s: %v", name, err)
	}
	return ok
}

func TestPostgresGivesFreshDatabases(t *testing.T) {
	url1, url2 := Postgres(t), Postgres(t)
	c1, c2 := connect(t, url1), connect(t, url2)
	db1 := queryString(t, c1, "SELECT current_database()")
	db2 := queryString(t, c2, "SELECT current_database()")
	if db1 == db2 {
		t.Fatalf("two calls gave the same database %s", db1)
	}
	ctx := context.Background()
	if _, err := c1.Exec(ctx, "CREATE TABLE t (x int)"); err != nil {
		t.Fatal(err)
	}
	// The second database must not see the first one's table.
	if _, err := c2.Exec(ctx, "CREATE TABLE t (x int)"); err != nil {
		t.Fatalf("create table t in second database: %v", err)
	}
	if got, want := queryString(t, c1, "SELECT pg_encoding_to_char(encoding) FROM pg_database WHERE datname = current_database()"), "UTF8"; got != want {
		t.Errorf("encoding = %s, want %s", got, want)
	}
	if got := queryString(t, c1, "SHOW max_connections"); os.Getenv(PostgresURLEnv) == "" && got != "200" {
		t.Errorf("max_connections = %s, want 200", got)
	}
}

func TestPostgresDropsDatabaseInCleanup(t *testing.T) {
	var name string
	parent := t
	t.Run("user", func(t *testing.T) {
		// Cleanup must drop the database even with a session still open: the
		// connection is closed only at the end of the parent test.
		c := connect(parent, Postgres(t))
		name = queryString(t, c, "SELECT current_database()")
	})
	if t.Failed() {
		return
	}
	admin, err := sharedServer()
	if err != nil {
		t.Fatal(err)
	}
	if databaseExists(t, connect(t, admin), name) {
		t.Errorf("database %s still exists after its test ended", name)
	}
}

func TestPostgresCluster(t *testing.T) {
	c, err := StartPostgresCluster("")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	url, err := c.CreateDatabase(ctx)
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Host != "127.0.0.1" || int(cfg.Port) != c.Port() || cfg.Database == "postgres" {
		t.Errorf("CreateDatabase URL %s: want a new database on 127.0.0.1:%d", url, c.Port())
	}
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, "CREATE TABLE t (x int); INSERT INTO t VALUES (1)"); err != nil {
		t.Fatal(err)
	}
	conn.Close(ctx)

	// Committed data survives a fast stop, an immediate (crash) restart, and
	// the port stays the same.
	port := c.Port()
	if err := c.Stop("fast"); err != nil {
		t.Fatal(err)
	}
	if _, err := pgx.Connect(ctx, url); err == nil {
		t.Fatal("connected to a stopped cluster")
	}
	if err := c.Start(); err != nil {
		t.Fatal(err)
	}
	conn = connect(t, url)
	if _, err := conn.Exec(ctx, "INSERT INTO t VALUES (2)"); err != nil {
		t.Fatal(err)
	}
	if err := c.Restart("immediate"); err != nil {
		t.Fatal(err)
	}
	if c.Port() != port {
		t.Errorf("port changed from %d to %d", port, c.Port())
	}
	conn = connect(t, url)
	if got, want := queryString(t, conn, "SELECT string_agg(x::text, ',' ORDER BY x) FROM t"), "1,2"; got != want {
		t.Errorf("rows after restarts = %s, want %s", got, want)
	}

	if err := c.Stop("sideways"); err == nil {
		t.Error("Stop with an unknown mode succeeded")
	}

	if err := c.DropDatabase(ctx, url); err != nil {
		t.Fatal(err)
	}
	if databaseExists(t, connect(t, c.URL("postgres")), cfg.Database) {
		t.Errorf("database %s exists after DropDatabase", cfg.Database)
	}

	c.Close()
	if _, err := os.Stat(c.Dir()); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("cluster dir after Close: stat error %v, want not exist", err)
	}
	if _, err := pgx.Connect(ctx, c.URL("postgres")); err == nil {
		t.Error("connected to a closed cluster")
	}
}

// fakeInstall creates dir/<version>/bin with the given programs.
func fakeInstall(tb testing.TB, dir, version string, progs ...string) string {
	tb.Helper()
	bin := filepath.Join(dir, version, "bin")
	if err := os.MkdirAll(bin, 0o755); err != nil {
		tb.Fatal(err)
	}
	for _, p := range progs {
		if err := os.WriteFile(filepath.Join(bin, p), []byte("#!/bin/sh\n"), 0o755); err != nil {
			tb.Fatal(err)
		}
	}
	return bin
}

func TestFindPostgresBinaries(t *testing.T) {
	all := []string{"initdb", "pg_ctl", "postgres"}
	tests := []struct {
		name    string
		setup   func(lib, path string) // creates installs under lib and path
		want    string                 // directory of the binaries, relative to lib or path
		wantErr bool
	}{
		{
			name:    "nothing installed",
			setup:   func(lib, path string) {},
			wantErr: true,
		},
		{
			name: "highest version wins",
			setup: func(lib, path string) {
				fakeInstall(t, lib, "9.6", all...)
				fakeInstall(t, lib, "15", all...)
				fakeInstall(t, lib, "10", all...)
			},
			want: "lib/15/bin",
		},
		{
			name: "incomplete install skipped",
			setup: func(lib, path string) {
				fakeInstall(t, lib, "16", "initdb", "pg_ctl") // client only
				fakeInstall(t, lib, "14", all...)
			},
			want: "lib/14/bin",
		},
		{
			name: "PATH first",
			setup: func(lib, path string) {
				fakeInstall(t, lib, "17", all...)
				fakeInstall(t, path, "x", all...)
			},
			want: "path/x/bin",
		},
		{
			name: "only client programs",
			setup: func(lib, path string) {
				fakeInstall(t, lib, "15", "psql", "pg_dump")
			},
			wantErr: true,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			root := t.TempDir()
			lib, path := filepath.Join(root, "lib"), filepath.Join(root, "path")
			tt.setup(lib, path)
			initdb, pgCtl, err := findPostgresBinaries(filepath.Join(path, "x", "bin"), lib)
			if tt.wantErr {
				if err == nil {
					t.Fatalf("got %s, %s, want error", initdb, pgCtl)
				}
				for _, want := range []string{"apt-get install postgresql", PostgresURLEnv} {
					if !strings.Contains(err.Error(), want) {
						t.Errorf("error %q does not mention %q", err, want)
					}
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			want := filepath.Join(root, tt.want)
			if initdb != filepath.Join(want, "initdb") || pgCtl != filepath.Join(want, "pg_ctl") {
				t.Errorf("got %s, %s, want them in %s", initdb, pgCtl, want)
			}
		})
	}
}

// exitedPid returns the pid of a process that has exited and been reaped.
func exitedPid(tb testing.TB) int {
	tb.Helper()
	cmd := exec.Command("true")
	if err := cmd.Run(); err != nil {
		tb.Fatal(err)
	}
	return cmd.Process.Pid
}

func TestProcessGone(t *testing.T) {
	if processGone(os.Getpid()) {
		t.Error("processGone(own pid) = true")
	}
	if pid := exitedPid(t); !processGone(pid) {
		t.Errorf("processGone(%d) = false for an exited, reaped process", pid)
	}
	// A zombie (exited, not yet waited for) is gone too.
	cmd := exec.Command("true")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Wait()
	deadline := time.Now().Add(30 * time.Second)
	for !processGone(cmd.Process.Pid) {
		if time.Now().After(deadline) {
			t.Fatalf("processGone(%d) still false for an exited process", cmd.Process.Pid)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestReapStaleClusters(t *testing.T) {
	mk := func(owner int) string {
		dir, err := os.MkdirTemp("", tempClusterPrefix)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { os.RemoveAll(dir) })
		if err := os.MkdirAll(filepath.Join(dir, "data"), 0o700); err != nil {
			t.Fatal(err)
		}
		// A postmaster.pid naming this test process, which must not be
		// signalled: its working directory is not the data directory.
		pidFile := filepath.Join(dir, "data", "postmaster.pid")
		if err := os.WriteFile(pidFile, []byte(strconv.Itoa(os.Getpid())+"\n"), 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, "owner.pid"), []byte(strconv.Itoa(owner)), 0o644); err != nil {
			t.Fatal(err)
		}
		return dir
	}
	stale, live := mk(exitedPid(t)), mk(os.Getpid())
	reapStaleClusters()
	if _, err := os.Stat(stale); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("cluster dir of a dead process: stat error %v, want not exist", err)
	}
	if _, err := os.Stat(live); err != nil {
		t.Errorf("cluster dir of a live process was removed: %v", err)
	}
}

func TestStartPostgresClusterNeedsEmptyDir(t *testing.T) {
	dir := t.TempDir()
	keep := filepath.Join(dir, "precious")
	if err := os.WriteFile(keep, []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	c, err := StartPostgresCluster(dir)
	if err == nil {
		c.Close()
		t.Fatal("StartPostgresCluster in a non-empty directory succeeded")
	}
	if _, err := os.Stat(keep); err != nil {
		t.Errorf("file in the directory after the failed start: %v", err)
	}
}
