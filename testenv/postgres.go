package testenv

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// PostgresURLEnv names the environment variable that points the tests at an
// existing PostgreSQL server instead of a throwaway cluster. Its value is a
// connection URL of a role allowed to create and drop databases, e.g.
// postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable.
const PostgresURLEnv = "DISPENSER_TEST_POSTGRES_URL"

// installHint says how to get what Postgres and StartPostgresCluster need.
const installHint = "install the PostgreSQL server (Debian/Ubuntu: apt-get install postgresql) or set " +
	PostgresURLEnv + " to the URL of an existing server"

// Root of the Debian/Ubuntu layout, searched when the binaries are not on PATH.
const debianPostgresLib = "/usr/lib/postgresql"

// Prefix of the temporary directories of clusters that StartPostgresCluster
// creates itself; a stale one whose owner process is gone is reaped.
const tempClusterPrefix = "dispenser-pg-"

// PostgresCluster is a throwaway PostgreSQL cluster listening on 127.0.0.1 on
// a free port, with trust authentication for the superuser "postgres" and
// settings for speed, not durability against OS crashes (fsync=off; commits
// still survive a server crash or an immediate stop). When the process runs
// as root, the server runs as the "postgres" system user, since PostgreSQL
// refuses to run as root. Its methods are safe for concurrent use.
type PostgresCluster struct {
	dir    string // holds data/, the log and the unix socket
	port   int
	initdb string
	pgCtl  string
	cred   *syscall.Credential // nil: run as ourselves

	mu sync.Mutex // serializes Start, Stop and Close
}

// StartPostgresCluster creates a new cluster in dir and starts it. dir must
// be empty or not exist; "" means a new temporary directory. When running as
// root, dir and all its parents must be searchable by the postgres user, which
// a fresh temporary directory (dir "") always is but t.TempDir() is not.
// Close stops the cluster and removes dir.
func StartPostgresCluster(dir string) (*PostgresCluster, error) {
	c, err := newPostgresCluster(dir)
	if err != nil {
		return nil, err
	}
	if err := c.create(); err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}

// newPostgresCluster finds the PostgreSQL programs, the user to run them as
// and prepares dir as StartPostgresCluster describes, without creating a
// cluster in it.
func newPostgresCluster(dir string) (*PostgresCluster, error) {
	initdb, pgCtl, err := findPostgresBinaries(os.Getenv("PATH"), debianPostgresLib)
	if err != nil {
		return nil, err
	}
	c := &PostgresCluster{initdb: initdb, pgCtl: pgCtl}
	if os.Geteuid() == 0 {
		u, err := user.Lookup("postgres")
		if err != nil {
			return nil, fmt.Errorf("testenv: running as root, but PostgreSQL refuses to run as root and there is no \"postgres\" system user to run it as (%v): %s", err, installHint)
		}
		uid, err1 := strconv.ParseUint(u.Uid, 10, 32)
		gid, err2 := strconv.ParseUint(u.Gid, 10, 32)
		if err1 != nil || err2 != nil {
			return nil, fmt.Errorf("testenv: user postgres has uid %q gid %q", u.Uid, u.Gid)
		}
		c.cred = &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}
	}
	if dir == "" {
		reapStaleClusters()
		if dir, err = os.MkdirTemp("", tempClusterPrefix); err != nil {
			return nil, fmt.Errorf("testenv: %w", err)
		}
		// Lets a later run reap this cluster if we die without Close.
		owner := filepath.Join(dir, "owner.pid")
		if err := os.WriteFile(owner, []byte(strconv.Itoa(os.Getpid())), 0o644); err != nil {
			os.RemoveAll(dir)
			return nil, fmt.Errorf("testenv: %w", err)
		}
	} else {
		if dir, err = filepath.Abs(dir); err != nil {
			return nil, fmt.Errorf("testenv: %w", err)
		}
		if err := os.MkdirAll(dir, 0o700); err != nil {
			return nil, fmt.Errorf("testenv: %w", err)
		}
		// Close removes dir, so it must hold nothing else.
		if entries, err := os.ReadDir(dir); err != nil || len(entries) > 0 {
			return nil, fmt.Errorf("testenv: cluster directory %s is not empty (%v)", dir, err)
		}
	}
	c.dir = dir
	return c, nil
}

// create runs initdb and starts the server on a free port.
func (c *PostgresCluster) create() error {
	if err := c.own(); err != nil {
		return err
	}
	if _, err := c.run(c.initdb, "-D", c.dataDir(), "-U", "postgres", "--auth=trust",
		"-E", "UTF8", "--locale=C", "--no-sync"); err != nil {
		return err
	}
	conf := filepath.Join(c.dataDir(), "postgresql.conf")
	f, err := os.OpenFile(conf, os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		return fmt.Errorf("testenv: %w", err)
	}
	_, err = f.WriteString("\ninclude 'dispenser.conf'\n")
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("testenv: %w", err)
	}
	return c.startOnFreePort()
}

// own hands c.dir to the user that runs the server, if that is not us, and
// checks that this user can reach it.
func (c *PostgresCluster) own() error {
	if c.cred == nil {
		return nil
	}
	if err := os.Chown(c.dir, int(c.cred.Uid), int(c.cred.Gid)); err != nil {
		return fmt.Errorf("testenv: %w", err)
	}
	return c.checkSearchable()
}

// startOnFreePort writes the settings with a free port and starts the
// server, retrying on another port if the one picked was taken meanwhile.
func (c *PostgresCluster) startOnFreePort() error {
	for attempt := 1; ; attempt++ {
		if err := c.configure(); err != nil {
			return err
		}
		err := c.Start()
		if err == nil || attempt == 3 || !strings.Contains(err.Error(), "could not bind") {
			return err
		}
	}
}

// configure picks a free port and writes the cluster's settings.
func (c *PostgresCluster) configure() error {
	port, err := ServerPort() // stable across Stop and Start
	if err != nil {
		return err
	}
	c.port = port
	socketDir := c.dir
	if len(socketDir) > 80 { // a unix socket path has at most 107 bytes
		socketDir = ""
	}
	// wal_level and max_wal_senders are PostgreSQL's defaults, spelled out
	// because StartReplica needs them; initdb's pg_hba.conf already lets
	// 127.0.0.1 connect for replication with the --auth given.
	settings := fmt.Sprintf(`listen_addresses = '127.0.0.1'
port = %d
unix_socket_directories = '%s'
max_connections = 200
shared_buffers = 32MB
fsync = off
full_page_writes = off
max_wal_size = 256MB
log_min_messages = warning
log_min_error_statement = panic
log_checkpoints = off
wal_level = replica
max_wal_senders = 10
`, c.port, strings.ReplaceAll(socketDir, "'", "''"))
	name := filepath.Join(c.dataDir(), "dispenser.conf")
	if err := os.WriteFile(name, []byte(settings), 0o600); err != nil {
		return fmt.Errorf("testenv: %w", err)
	}
	if c.cred != nil {
		if err := os.Chown(name, int(c.cred.Uid), int(c.cred.Gid)); err != nil {
			return fmt.Errorf("testenv: %w", err)
		}
	}
	return nil
}

// checkSearchable reports a clear error if the postgres user cannot reach
// c.dir, instead of initdb's "permission denied".
func (c *PostgresCluster) checkSearchable() error {
	for p := filepath.Dir(c.dir); ; p = filepath.Dir(p) {
		fi, err := os.Stat(p)
		if err != nil {
			return fmt.Errorf("testenv: %w", err)
		}
		st, ok := fi.Sys().(*syscall.Stat_t)
		perm := fi.Mode().Perm()
		if ok && !(st.Uid == c.cred.Uid && perm&0o100 != 0 ||
			st.Gid == c.cred.Gid && perm&0o010 != 0 ||
			perm&0o001 != 0) {
			return fmt.Errorf("testenv: the postgres user cannot reach %s because of the permissions of %s; use a directory it can reach (StartPostgresCluster(\"\") makes one)", c.dir, p)
		}
		if p == filepath.Dir(p) {
			return nil
		}
	}
}

func (c *PostgresCluster) dataDir() string { return filepath.Join(c.dir, "data") }
func (c *PostgresCluster) logFile() string { return filepath.Join(c.dir, "postgres.log") }

// Dir returns the directory that holds the cluster.
func (c *PostgresCluster) Dir() string { return c.dir }

// Port returns the TCP port the cluster listens on at 127.0.0.1. It stays
// the same across Stop and Start.
func (c *PostgresCluster) Port() int { return c.port }

// URL returns the connection URL of database db as the superuser postgres.
func (c *PostgresCluster) URL(db string) string {
	u := url.URL{
		Scheme:   "postgres",
		User:     url.User("postgres"),
		Host:     net.JoinHostPort("127.0.0.1", strconv.Itoa(c.port)),
		Path:     "/" + db,
		RawQuery: "sslmode=disable",
	}
	return u.String()
}

// CreateDatabase creates a new database with a unique name and returns its
// URL. DropDatabase removes it; Close removes everything.
func (c *PostgresCluster) CreateDatabase(ctx context.Context) (string, error) {
	u, _, err := createDatabase(ctx, c.URL("postgres"))
	return u, err
}

// DropDatabase drops the database that dbURL (from CreateDatabase) names,
// disconnecting its sessions.
func (c *PostgresCluster) DropDatabase(ctx context.Context, dbURL string) error {
	cfg, err := pgx.ParseConfig(dbURL)
	if err != nil {
		return fmt.Errorf("testenv: %w", err)
	}
	return dropDatabase(ctx, c.URL("postgres"), cfg.Database)
}

// Start starts the stopped cluster on its port and waits until it accepts
// connections, after crash recovery if it was stopped with mode immediate.
func (c *PostgresCluster) Start() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	_, err := c.run(c.pgCtl, "start", "-D", c.dataDir(), "-l", c.logFile(), "-w", "-t", "120")
	if err != nil {
		return fmt.Errorf("%w\n%s", err, tail(c.logFile(), 2000))
	}
	return nil
}

// Stop stops the cluster with a pg_ctl shutdown mode: "smart", "fast" (roll
// back transactions, disconnect clients, checkpoint) or "immediate" (like a
// crash: kill everything, recover on the next start). It waits until the
// server is down.
func (c *PostgresCluster) Stop(mode string) error {
	switch mode {
	case "smart", "fast", "immediate":
	default:
		return fmt.Errorf("testenv: pg_ctl stop mode %q: want smart, fast or immediate", mode)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	_, err := c.run(c.pgCtl, "stop", "-D", c.dataDir(), "-m", mode, "-w", "-t", "120")
	return err
}

// Restart stops the cluster with mode (see Stop) and starts it again.
func (c *PostgresCluster) Restart(mode string) error {
	if err := c.Stop(mode); err != nil {
		return err
	}
	return c.Start()
}

// Close stops the cluster immediately if it runs and removes its directory.
func (c *PostgresCluster) Close() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if _, err := os.Stat(filepath.Join(c.dataDir(), "postmaster.pid")); err == nil {
		c.run(c.pgCtl, "stop", "-D", c.dataDir(), "-m", "immediate", "-w", "-t", "60")
	}
	os.RemoveAll(c.dir)
}

// run runs a PostgreSQL program, as the postgres user when we are root.
func (c *PostgresCluster) run(prog string, args ...string) ([]byte, error) {
	cmd := exec.Command(prog, args...)
	cmd.Dir = c.dir
	cmd.Env = append(os.Environ(), "LC_ALL=C")
	if c.cred != nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: c.cred}
	}
	// The server started by pg_ctl writes to its log, not to our pipe, but
	// do not hang if something keeps the pipe open.
	cmd.WaitDelay = 5 * time.Second
	out, err := cmd.CombinedOutput()
	if err != nil {
		return out, fmt.Errorf("testenv: %s %s: %v\n%s", filepath.Base(prog), strings.Join(args, " "), err, bytes.TrimSpace(out))
	}
	return out, nil
}

// tail returns at most the last n bytes of file name.
func tail(name string, n int64) string {
	b, err := os.ReadFile(name)
	if err != nil {
		return ""
	}
	if int64(len(b)) > n {
		b = b[int64(len(b))-n:]
	}
	return string(b)
}

// findPostgresBinaries returns the paths of initdb and pg_ctl: from path if
// initdb, pg_ctl and postgres are all there, else from the highest version
// under libDir (<libDir>/<version>/bin, the Debian layout).
func findPostgresBinaries(path, libDir string) (initdb, pgCtl string, err error) {
	names := []string{"initdb", "pg_ctl", "postgres"}
	isExec := func(name string) bool {
		fi, err := os.Stat(name)
		return err == nil && fi.Mode().IsRegular() && fi.Mode()&0o111 != 0
	}
	complete := func(dir string) bool {
		for _, n := range names {
			if !isExec(filepath.Join(dir, n)) {
				return false
			}
		}
		return true
	}
	for _, dir := range filepath.SplitList(path) {
		if dir != "" && complete(dir) {
			return filepath.Join(dir, "initdb"), filepath.Join(dir, "pg_ctl"), nil
		}
	}
	bins, _ := filepath.Glob(filepath.Join(libDir, "*", "bin"))
	version := func(bin string) []int {
		var v []int
		for _, f := range strings.Split(filepath.Base(filepath.Dir(bin)), ".") {
			n, err := strconv.Atoi(f)
			if err != nil {
				return nil
			}
			v = append(v, n)
		}
		return v
	}
	sort.Slice(bins, func(i, j int) bool { // highest version first
		a, b := version(bins[i]), version(bins[j])
		for k := 0; k < len(a) && k < len(b); k++ {
			if a[k] != b[k] {
				return a[k] > b[k]
			}
		}
		return len(a) > len(b)
	})
	for _, bin := range bins {
		if version(bin) != nil && complete(bin) {
			return filepath.Join(bin, "initdb"), filepath.Join(bin, "pg_ctl"), nil
		}
	}
	return "", "", fmt.Errorf("testenv: PostgreSQL server programs (initdb, pg_ctl, postgres) not found on PATH or in %s/*/bin: %s", libDir, installHint)
}

// reapStaleClusters stops and removes the temporary clusters of processes
// that died without closing them (say, killed by go test's timeout).
func reapStaleClusters() {
	dirs, _ := filepath.Glob(filepath.Join(os.TempDir(), tempClusterPrefix+"*"))
	for _, dir := range dirs {
		b, err := os.ReadFile(filepath.Join(dir, "owner.pid"))
		if err != nil {
			continue
		}
		pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
		if err != nil || pid <= 0 || !processGone(pid) {
			continue
		}
		// postmaster.pid's first line is the server's pid; a server still
		// running works in its data directory.
		data := filepath.Join(dir, "data")
		b, err = os.ReadFile(filepath.Join(data, "postmaster.pid"))
		if err == nil {
			first, _, _ := strings.Cut(string(b), "\n")
			spid, err := strconv.Atoi(strings.TrimSpace(first))
			if cwd, _ := os.Readlink(fmt.Sprintf("/proc/%d/cwd", spid)); err == nil && spid > 0 && cwd == data {
				syscall.Kill(spid, syscall.SIGQUIT) // immediate shutdown
			}
		}
		os.RemoveAll(dir)
	}
}

// processGone reports whether process pid has exited: it does not exist or
// is a zombie that nobody has reaped yet.
func processGone(pid int) bool {
	if syscall.Kill(pid, 0) == syscall.ESRCH {
		return true
	}
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	// The state follows the parenthesized command name.
	i := bytes.LastIndexByte(stat, ')')
	return i >= 0 && bytes.HasPrefix(stat[i+1:], []byte(" Z"))
}

// createDatabase creates a database with a unique name on the server that
// adminURL connects to, and returns its URL and name.
func createDatabase(ctx context.Context, adminURL string) (dbURL, name string, err error) {
	u, err := url.Parse(adminURL)
	if err != nil {
		return "", "", fmt.Errorf("testenv: postgres URL: %w", err)
	}
	var b [8]byte
	rand.Read(b[:])
	name = "dispenser_test_" + hex.EncodeToString(b[:])
	conn, err := pgx.Connect(ctx, adminURL)
	if err != nil {
		return "", "", fmt.Errorf("testenv: connect to postgres: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if _, err := conn.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()); err != nil {
		return "", "", fmt.Errorf("testenv: create database %s: %w", name, err)
	}
	u.Path = "/" + name
	u.RawPath = ""
	return u.String(), name, nil
}

// dropDatabase drops database name, disconnecting its sessions.
func dropDatabase(ctx context.Context, adminURL, name string) error {
	conn, err := pgx.Connect(ctx, adminURL)
	if err != nil {
		return fmt.Errorf("testenv: connect to postgres: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if _, err := conn.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)"); err != nil {
		return fmt.Errorf("testenv: drop database %s: %w", name, err)
	}
	return nil
}

// The server that Postgres creates databases on, set up on first use.
var (
	running atomic.Bool // Run is running the tests

	sharedOnce     sync.Once
	sharedAdminURL string
	sharedErr      error
	sharedCluster  atomic.Pointer[PostgresCluster]
)

// sharedServer returns the URL of the maintenance database of the server
// that Postgres uses: the one in PostgresURLEnv or this binary's cluster.
func sharedServer() (string, error) {
	sharedOnce.Do(func() {
		if u := os.Getenv(PostgresURLEnv); u != "" {
			sharedAdminURL = u
			return
		}
		c, err := StartPostgresCluster("")
		if err != nil {
			sharedErr = err
			return
		}
		sharedCluster.Store(c)
		sharedAdminURL = c.URL("postgres")
	})
	return sharedAdminURL, sharedErr
}

// Postgres returns the connection URL of a new, empty database for this test
// and drops the database in Cleanup. The database lives on the server that
// DISPENSER_TEST_POSTGRES_URL names if set, else on a throwaway cluster that
// the test binary starts on first use from the machine's PostgreSQL
// programs. A package that calls Postgres must stop that cluster when its
// tests end, so it needs
//
//	func TestMain(m *testing.M) { os.Exit(testenv.Run(m)) }
//
// Postgres fails the test if there is no such TestMain or no PostgreSQL to
// run; it never skips.
func Postgres(tb testing.TB) string {
	tb.Helper()
	if !running.Load() {
		tb.Fatalf("testenv: Postgres needs the package's tests to run under testenv.Run: add func TestMain(m *testing.M) { os.Exit(testenv.Run(m)) }")
	}
	admin, err := sharedServer()
	if err != nil {
		tb.Fatalf("%v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	dbURL, name, err := createDatabase(ctx, admin)
	if err != nil {
		tb.Fatalf("%v", err)
	}
	tb.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if err := dropDatabase(ctx, admin, name); err != nil {
			tb.Errorf("%v", err)
		}
	})
	return dbURL
}

// Run runs the tests and then stops and removes the PostgreSQL cluster that
// Postgres started and the MariaDB server that MySQL started, if any, and
// returns the exit code for os.Exit. Use it in
// TestMain of every package that calls Postgres:
//
//	func TestMain(m *testing.M) { os.Exit(testenv.Run(m)) }
func Run(m *testing.M) int {
	running.Store(true)
	code := m.Run()
	running.Store(false)
	if c := sharedCluster.Load(); c != nil {
		c.Close()
	}
	stopMySQL()
	return code
}
