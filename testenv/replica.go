package testenv

import (
	"context"
	"fmt"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// pairInstallHint says how to get what PostgresPair and StartReplica need.
// Unlike Postgres, they always run their own servers, so a URL in
// PostgresURLEnv does not replace the programs.
const pairInstallHint = "install the PostgreSQL server, which brings pg_basebackup " +
	"(Debian/Ubuntu: apt-get install postgresql); " + PostgresURLEnv + " does not help here: " +
	"a primary and a replica always run as local throwaway clusters"

// replicaTimeout bounds how long StartReplica waits for the new replica to
// stream from its primary.
const replicaTimeout = 2 * time.Minute

// StartReplica makes an asynchronous streaming replica of the running
// cluster c with pg_basebackup -R in dir, starts it on a free port of
// 127.0.0.1 and returns it once its WAL receiver streams from c. The rules
// for dir are those of StartPostgresCluster ("" means a new temporary
// directory); the replica runs as the postgres user when we are root.
//
// The replica is a hot standby: it answers read-only queries, has the
// databases c had when it was made and replays what c writes later (see
// WaitReplayed), until CutReplication or Promote. It uses no replication
// slot, so c keeps no WAL for it once replication is cut. Close stops it and
// removes dir, as for any cluster.
func (c *PostgresCluster) StartReplica(dir string) (*PostgresCluster, error) {
	basebackup, err := c.basebackupPath()
	if err != nil {
		return nil, err
	}
	r, err := newPostgresCluster(dir)
	if err != nil {
		return nil, err
	}
	if err := r.startReplicaOf(c, basebackup); err != nil {
		r.Close()
		return nil, err
	}
	return r, nil
}

// basebackupPath returns the path of the pg_basebackup of c's installation:
// next to c's pg_ctl, or next to the file it links to (pg_ctl, initdb and
// postgres may be linked into a directory on PATH without pg_basebackup).
func (c *PostgresCluster) basebackupPath() (string, error) {
	dirs := []string{filepath.Dir(c.pgCtl)}
	if real, err := filepath.EvalSymlinks(c.pgCtl); err == nil {
		dirs = append(dirs, filepath.Dir(real))
	}
	for _, dir := range dirs {
		p := filepath.Join(dir, "pg_basebackup")
		if fi, err := os.Stat(p); err == nil && fi.Mode().IsRegular() && fi.Mode()&0o111 != 0 {
			return p, nil
		}
	}
	return "", fmt.Errorf("testenv: pg_basebackup not found next to %s: %s", c.pgCtl, pairInstallHint)
}

// findReplicaPrograms reports a clear error if PostgresPair cannot find the
// programs it needs in path or libDir (see findPostgresBinaries).
func findReplicaPrograms(path, libDir string) error {
	_, pgCtl, err := findPostgresBinaries(path, libDir)
	if err == nil {
		_, err = (&PostgresCluster{pgCtl: pgCtl}).basebackupPath()
	}
	if err != nil {
		return fmt.Errorf("testenv: PostgresPair needs the PostgreSQL server programs (initdb, pg_ctl, postgres, pg_basebackup) on PATH or in %s/*/bin; %s (%w)", libDir, pairInstallHint, err)
	}
	return nil
}

// startReplicaOf fills r's empty directory with a base backup of primary,
// starts r and waits until it streams.
func (r *PostgresCluster) startReplicaOf(primary *PostgresCluster, basebackup string) error {
	if err := r.own(); err != nil {
		return err
	}
	// -c fast: checkpoint at once instead of spreading it, which would make
	// a fresh cluster's backup take minutes. -R: write standby.signal and
	// primary_conninfo. -X stream: the WAL written during the backup comes
	// along. The copy includes postgresql.conf and dispenser.conf;
	// startOnFreePort rewrites the latter with r's own port and socket.
	if _, err := r.run(basebackup, "-D", r.dataDir(),
		"-h", "127.0.0.1", "-p", strconv.Itoa(primary.Port()), "-U", "postgres",
		"-R", "-X", "stream", "-c", "fast", "--no-sync"); err != nil {
		return err
	}
	if err := r.startOnFreePort(); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), replicaTimeout)
	defer cancel()
	conn, err := r.connect(ctx)
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	var status string
	err = poll(ctx, func() (bool, error) {
		err := conn.QueryRow(ctx, "SELECT coalesce((SELECT status FROM pg_stat_wal_receiver), '')").Scan(&status)
		return status == "streaming", err
	})
	if err != nil {
		return fmt.Errorf("testenv: replica on port %d of the primary on port %d: WAL receiver status %q, want streaming: %w\n%s",
			r.Port(), primary.Port(), status, err, tail(r.logFile(), 2000))
	}
	return nil
}

// WaitReplayed waits until the replica c has replayed all the WAL that
// primary had written when WaitReplayed was called: everything committed on
// primary before the call, including CREATE DATABASE, is then visible on c.
// It waits until ctx is done if replication is cut or the primary is down
// and c misses some of that WAL.
func (c *PostgresCluster) WaitReplayed(ctx context.Context, primary *PostgresCluster) error {
	pconn, err := primary.connect(ctx)
	if err != nil {
		return err
	}
	var target string
	err = pconn.QueryRow(ctx, "SELECT pg_current_wal_lsn()::text").Scan(&target)
	pconn.Close(context.WithoutCancel(ctx))
	if err != nil {
		return fmt.Errorf("testenv: WAL position of the primary on port %d: %w", primary.Port(), err)
	}
	conn, err := c.connect(ctx)
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	var replayed *string // NULL: c has never been in recovery
	err = poll(ctx, func() (bool, error) {
		var done *bool
		err := conn.QueryRow(ctx, "SELECT pg_last_wal_replay_lsn()::text, pg_last_wal_replay_lsn() >= $1::pg_lsn", target).Scan(&replayed, &done)
		if err == nil && done == nil {
			err = fmt.Errorf("cluster on port %d is not a replica", c.Port())
		}
		return err == nil && *done, err
	})
	if err != nil {
		at := "nothing"
		if replayed != nil {
			at = *replayed
		}
		return fmt.Errorf("testenv: replica on port %d replayed %s, want the primary's %s (port %d): %w",
			c.Port(), at, target, primary.Port(), err)
	}
	return nil
}

// CutReplication stops the replica c from replicating without promoting
// it: it clears primary_conninfo (ALTER SYSTEM, pg_reload_conf) and waits
// until c's WAL receiver has stopped. c stays a read-only standby with what
// it had received; nothing its primary writes after CutReplication returns
// reaches c, also across a restart of c. Promote makes it a primary.
//
// The end of the receiver is what shows that c has reread its settings, so
// call it while c streams, as StartReplica leaves it: if the receiver is
// down already (say, the primary is stopped), CutReplication returns at
// once and c might still start one more receiver with the old setting.
func (c *PostgresCluster) CutReplication(ctx context.Context) error {
	conn, err := c.connect(ctx)
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	var inRecovery bool
	if err := conn.QueryRow(ctx, "SELECT pg_is_in_recovery()").Scan(&inRecovery); err != nil {
		return fmt.Errorf("testenv: cut replication on port %d: %w", c.Port(), err)
	}
	if !inRecovery {
		return fmt.Errorf("testenv: cut replication on port %d: the cluster is not a replica", c.Port())
	}
	for _, sql := range []string{"ALTER SYSTEM SET primary_conninfo = ''", "SELECT pg_reload_conf()"} {
		if _, err := conn.Exec(ctx, sql); err != nil {
			return fmt.Errorf("testenv: cut replication on port %d: %s: %w", c.Port(), sql, err)
		}
	}
	// The startup process rereads the settings and stops the receiver;
	// with primary_conninfo empty it starts no other.
	var receivers int
	err = poll(ctx, func() (bool, error) {
		err := conn.QueryRow(ctx, "SELECT count(*) FROM pg_stat_wal_receiver").Scan(&receivers)
		return receivers == 0, err
	})
	if err != nil {
		return fmt.Errorf("testenv: cut replication on port %d: the WAL receiver still runs: %w", c.Port(), err)
	}
	return nil
}

// Promote promotes the replica c to a primary with pg_ctl promote and
// returns once c accepts writes (pg_is_in_recovery() is false). Without
// CutReplication or a stopped primary, c may have replayed its primary's
// latest writes or not: replication is asynchronous.
func (c *PostgresCluster) Promote(ctx context.Context) error {
	c.mu.Lock()
	_, err := c.run(c.pgCtl, "promote", "-D", c.dataDir(), "-w", "-t", "120")
	c.mu.Unlock()
	if err != nil {
		return err
	}
	conn, err := c.connect(ctx)
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	err = poll(ctx, func() (bool, error) {
		var inRecovery bool
		err := conn.QueryRow(ctx, "SELECT pg_is_in_recovery()").Scan(&inRecovery)
		return !inRecovery, err
	})
	if err != nil {
		return fmt.Errorf("testenv: promote the replica on port %d: still in recovery: %w", c.Port(), err)
	}
	return nil
}

// MultiHostURL returns a connection URL of database db as the superuser
// postgres that lists the clusters' addresses in order, with
// target_session_attrs=read-write: a client (pgx, libpq) connects to the
// first of them that is up and accepts writes, so the URL follows a
// failover from a primary to a promoted replica.
func MultiHostURL(db string, clusters ...*PostgresCluster) string {
	hosts := make([]string, len(clusters))
	for i, c := range clusters {
		hosts[i] = net.JoinHostPort("127.0.0.1", strconv.Itoa(c.Port()))
	}
	u := url.URL{
		Scheme:   "postgres",
		User:     url.User("postgres"),
		Host:     strings.Join(hosts, ","),
		Path:     "/" + db,
		RawQuery: "sslmode=disable&target_session_attrs=read-write",
	}
	return u.String()
}

// PostgresPair starts a new primary cluster and an asynchronous streaming
// replica of it (StartReplica), each in a new temporary directory, and
// closes both in Cleanup, whether the test passes or not. A process killed
// before Cleanup leaves them to be reaped by a later StartPostgresCluster.
// A database created on the primary (CreateDatabase) exists on the replica
// after WaitReplayed. PostgresPair needs the PostgreSQL server programs
// including pg_basebackup on this machine and fails the test, saying what
// to install, without them; it never skips. It does not need testenv.Run.
func PostgresPair(tb testing.TB) (primary, replica *PostgresCluster) {
	tb.Helper()
	if err := findReplicaPrograms(os.Getenv("PATH"), debianPostgresLib); err != nil {
		tb.Fatalf("%v", err)
	}
	// Not tb.TempDir(): as root, the postgres user cannot reach it.
	primary, err := StartPostgresCluster("")
	if err != nil {
		tb.Fatalf("testenv: PostgresPair: start the primary: %v", err)
	}
	tb.Cleanup(primary.Close)
	replica, err = primary.StartReplica("")
	if err != nil {
		tb.Fatalf("testenv: PostgresPair: start the replica: %v", err)
	}
	tb.Cleanup(replica.Close)
	return primary, replica
}

// connect connects to c's maintenance database.
func (c *PostgresCluster) connect(ctx context.Context) (*pgx.Conn, error) {
	conn, err := pgx.Connect(ctx, c.URL("postgres"))
	if err != nil {
		return nil, fmt.Errorf("testenv: connect to the cluster on port %d: %w", c.Port(), err)
	}
	return conn, nil
}

// poll calls check until it reports done or fails, or ctx is done, backing
// off from 5ms to 100ms between calls.
func poll(ctx context.Context, check func() (done bool, err error)) error {
	wait := 5 * time.Millisecond
	for {
		done, err := check()
		if err != nil || done {
			return err
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		case <-t.C:
		}
		wait = min(2*wait, 100*time.Millisecond)
	}
}
