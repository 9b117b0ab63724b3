package testenv

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// pairDatabase creates a database on primary, waits until replica has it and
// returns its name.
func pairDatabase(tb testing.TB, ctx context.Context, primary, replica *PostgresCluster) string {
	tb.Helper()
	u, err := primary.CreateDatabase(ctx)
	if err != nil {
		tb.Fatal(err)
	}
	cfg, err := pgx.ParseConfig(u)
	if err != nil {
		tb.Fatal(err)
	}
	if err := replica.WaitReplayed(ctx, primary); err != nil {
		tb.Fatal(err)
	}
	return cfg.Database
}

// mustExec runs sql on conn and fails the test on error.
func mustExec(tb testing.TB, conn *pgx.Conn, sql string) {
	tb.Helper()
	if _, err := conn.Exec(context.Background(), sql); err != nil {
		tb.Fatalf("%s: %v", sql, err)
	}
}

// rows returns the values of t.x, sorted and joined by commas.
func rows(tb testing.TB, conn *pgx.Conn) string {
	tb.Helper()
	return queryString(tb, conn, "SELECT coalesce(string_agg(x::text, ',' ORDER BY x), '') FROM t")
}

func TestReplicaCutAndPromote(t *testing.T) {
	primary, replica := PostgresPair(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	if primary.Port() == replica.Port() || primary.Dir() == replica.Dir() {
		t.Fatalf("primary and replica share port %d or directory %s", primary.Port(), primary.Dir())
	}
	if got := queryString(t, connect(t, primary.URL("postgres")), "SELECT count(*)::text FROM pg_stat_replication"); got != "1" {
		t.Errorf("primary lists %s replicas in pg_stat_replication, want 1", got)
	}

	db := pairDatabase(t, ctx, primary, replica)
	pconn := connect(t, primary.URL(db))
	mustExec(t, pconn, "CREATE TABLE t (x int); INSERT INTO t VALUES (1)")
	if err := replica.WaitReplayed(ctx, primary); err != nil {
		t.Fatal(err)
	}
	rconn := connect(t, replica.URL(db))
	if got := rows(t, rconn); got != "1" {
		t.Fatalf("replica rows after WaitReplayed = %q, want 1", got)
	}
	if _, err := rconn.Exec(ctx, "INSERT INTO t VALUES (100)"); err == nil {
		t.Error("a write on the replica before Promote succeeded")
	}

	if err := replica.CutReplication(ctx); err != nil {
		t.Fatal(err)
	}
	if got := queryString(t, rconn, "SELECT pg_is_in_recovery()::text"); got != "true" {
		t.Errorf("pg_is_in_recovery() on the replica after CutReplication = %s, want true", got)
	}
	mustExec(t, pconn, "INSERT INTO t VALUES (2)")
	// The row can never arrive: WaitReplayed can only end with the deadline.
	short, cancelShort := context.WithTimeout(ctx, 500*time.Millisecond)
	err := replica.WaitReplayed(short, primary)
	cancelShort()
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("WaitReplayed after CutReplication and a write on the primary = %v, want the deadline", err)
	}

	if err := replica.Promote(ctx); err != nil {
		t.Fatal(err)
	}
	rconn = connect(t, replica.URL(db))
	if got := rows(t, rconn); got != "1" {
		t.Errorf("promoted replica rows = %q, want 1 (row 2 was written after CutReplication)", got)
	}
	mustExec(t, rconn, "INSERT INTO t VALUES (3)")
	if got := rows(t, rconn); got != "1,3" {
		t.Errorf("promoted replica rows after a write = %q, want 1,3", got)
	}
	if got := rows(t, pconn); got != "1,2" {
		t.Errorf("old primary rows = %q, want 1,2", got)
	}

	// Neither operation applies to a primary.
	if err := primary.CutReplication(ctx); err == nil || !strings.Contains(err.Error(), "not a replica") {
		t.Errorf("CutReplication on a primary = %v, want an error saying it is not a replica", err)
	}
	if err := primary.WaitReplayed(ctx, replica); err == nil || !strings.Contains(err.Error(), "not a replica") {
		t.Errorf("WaitReplayed on a primary = %v, want an error saying it is not a replica", err)
	}
}

func TestMultiHostURLFollowsFailover(t *testing.T) {
	primary, replica := PostgresPair(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	db := pairDatabase(t, ctx, primary, replica)

	serverPort := func(url string) (int, error) {
		cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		conn, err := pgx.Connect(cctx, url)
		if err != nil {
			return 0, err
		}
		defer conn.Close(cctx)
		var port int
		err = conn.QueryRow(cctx, "SELECT inet_server_port()").Scan(&port)
		return port, err
	}
	url := MultiHostURL(db, primary, replica)
	if port, err := serverPort(url); err != nil || port != primary.Port() {
		t.Fatalf("%s reached port %d (%v), want the primary's %d", url, port, err, primary.Port())
	}
	// The replica, listed first, is skipped: it does not accept writes.
	back := MultiHostURL(db, replica, primary)
	if port, err := serverPort(back); err != nil || port != primary.Port() {
		t.Fatalf("%s reached port %d (%v), want the primary's %d", back, port, err, primary.Port())
	}

	if err := primary.Stop("immediate"); err != nil {
		t.Fatal(err)
	}
	if port, err := serverPort(url); err == nil {
		t.Fatalf("%s reached port %d with the primary down and the replica not promoted", url, port)
	}
	if err := replica.Promote(ctx); err != nil {
		t.Fatal(err)
	}
	if port, err := serverPort(url); err != nil || port != replica.Port() {
		t.Fatalf("%s reached port %d (%v) after failover, want the promoted replica's %d", url, port, err, replica.Port())
	}
	mustExec(t, connect(t, url), "CREATE TABLE t (x int); INSERT INTO t VALUES (1)")
}

func TestMultiHostURL(t *testing.T) {
	a, b := &PostgresCluster{port: 15432}, &PostgresCluster{port: 25432}
	url := MultiHostURL("my_db", a, b)
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		t.Fatalf("parse %s: %v", url, err)
	}
	if cfg.Host != "127.0.0.1" || cfg.Port != 15432 || cfg.Database != "my_db" || cfg.User != "postgres" {
		t.Errorf("%s: first host %s:%d, database %s, user %s", url, cfg.Host, cfg.Port, cfg.Database, cfg.User)
	}
	if len(cfg.Fallbacks) != 1 || cfg.Fallbacks[0].Host != "127.0.0.1" || cfg.Fallbacks[0].Port != 25432 {
		t.Errorf("%s: fallbacks %+v, want 127.0.0.1:25432", url, cfg.Fallbacks)
	}
	if cfg.ValidateConnect == nil || !strings.Contains(url, "target_session_attrs=read-write") {
		t.Errorf("%s: no read-write check of the server", url)
	}
	if want := "127.0.0.1:" + strconv.Itoa(a.Port()) + "/"; !strings.Contains(MultiHostURL("d", a), want) {
		t.Errorf("single-host MultiHostURL = %s, want it to contain %s", MultiHostURL("d", a), want)
	}
}

func TestStartReplicaNeedsEmptyDir(t *testing.T) {
	// The directory is checked before the primary is contacted, so the
	// primary need not run.
	_, pgCtl, err := findPostgresBinaries(os.Getenv("PATH"), debianPostgresLib)
	if err != nil {
		t.Fatal(err)
	}
	primary := &PostgresCluster{pgCtl: pgCtl, port: 1}
	dir := t.TempDir()
	keep := filepath.Join(dir, "precious")
	if err := os.WriteFile(keep, []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	r, err := primary.StartReplica(dir)
	if err == nil {
		r.Close()
		t.Fatal("StartReplica in a non-empty directory succeeded")
	}
	if _, err := os.Stat(keep); err != nil {
		t.Errorf("file in the directory after the failed start: %v", err)
	}
}

func TestStartReplicaOfUnreachablePrimaryCleansUp(t *testing.T) {
	_, pgCtl, err := findPostgresBinaries(os.Getenv("PATH"), debianPostgresLib)
	if err != nil {
		t.Fatal(err)
	}
	ours := func() map[string]bool { // temporary cluster dirs of this process
		dirs, _ := filepath.Glob(filepath.Join(os.TempDir(), tempClusterPrefix+"*"))
		m := map[string]bool{}
		for _, d := range dirs {
			if b, err := os.ReadFile(filepath.Join(d, "owner.pid")); err == nil && string(b) == strconv.Itoa(os.Getpid()) {
				m[d] = true
			}
		}
		return m
	}
	before := ours()
	// Nothing listens on port 1, so pg_basebackup fails.
	r, err := (&PostgresCluster{pgCtl: pgCtl, port: 1}).StartReplica("")
	if err == nil {
		r.Close()
		t.Fatal("StartReplica of a primary that is not running succeeded")
	}
	if !strings.Contains(err.Error(), "pg_basebackup") {
		t.Errorf("error %q does not name pg_basebackup", err)
	}
	for d := range ours() {
		if !before[d] {
			t.Errorf("failed StartReplica left its directory %s", d)
		}
	}
}

func TestFindReplicaPrograms(t *testing.T) {
	server := []string{"initdb", "pg_ctl", "postgres"}
	t.Run("no pg_basebackup", func(t *testing.T) {
		lib := t.TempDir()
		fakeInstall(t, lib, "15", server...)
		err := findReplicaPrograms("", lib)
		if err == nil {
			t.Fatal("found the programs of an install without pg_basebackup")
		}
		for _, want := range []string{"pg_basebackup", "apt-get install postgresql"} {
			if !strings.Contains(err.Error(), want) {
				t.Errorf("error %q does not mention %q", err, want)
			}
		}
	})
	t.Run("nothing installed", func(t *testing.T) {
		if err := findReplicaPrograms("", t.TempDir()); err == nil || !strings.Contains(err.Error(), "apt-get install postgresql") {
			t.Errorf("error %v, want one saying what to install", err)
		}
	})
	t.Run("complete install", func(t *testing.T) {
		lib := t.TempDir()
		fakeInstall(t, lib, "15", append(server, "pg_basebackup")...)
		if err := findReplicaPrograms("", lib); err != nil {
			t.Error(err)
		}
	})
	t.Run("server programs linked onto PATH", func(t *testing.T) {
		// As on this project's machines: /usr/local/bin/pg_ctl links to
		// /usr/lib/postgresql/15/bin/pg_ctl, and pg_basebackup is only there.
		root := t.TempDir()
		bin := fakeInstall(t, root, "15", append(server, "pg_basebackup")...)
		path := filepath.Join(root, "path")
		if err := os.Mkdir(path, 0o755); err != nil {
			t.Fatal(err)
		}
		for _, p := range server {
			if err := os.Symlink(filepath.Join(bin, p), filepath.Join(path, p)); err != nil {
				t.Fatal(err)
			}
		}
		if err := findReplicaPrograms(path, filepath.Join(root, "nolib")); err != nil {
			t.Error(err)
		}
	})
}
