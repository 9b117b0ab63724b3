package testenv

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	driver "github.com/go-sql-driver/mysql"
)

// MySQLDSNEnv names the environment variable that points the tests at an
// existing MySQL or MariaDB server instead of a throwaway one. Its value is
// a go-sql-driver DSN of a user allowed to create and drop databases, e.g.
// root:secret@tcp(127.0.0.1:3306)/.
const MySQLDSNEnv = "DISPENSER_TEST_MYSQL_DSN"

// mysqlInstallHint says how to get what MySQL and StartMariaDB need.
const mysqlInstallHint = "install the MariaDB server (Debian/Ubuntu: apt-get install --no-install-recommends mariadb-server) or set " +
	MySQLDSNEnv + " to the DSN of an existing MySQL or MariaDB server"

// Prefix of the temporary directories of the servers StartMariaDB creates;
// a stale one whose owner process is gone is reaped.
const tempMariaDBPrefix = "dispenser-mariadb-"

// MariaDB is a throwaway MariaDB (or MySQL) server listening on 127.0.0.1
// on a free port, without authentication (--skip-grant-tables: any user
// name connects, with every right) and with settings for speed, not
// durability against OS crashes. As root, the server runs as the "mysql"
// system user.
type MariaDB struct {
	dir  string
	port int
	cmd  *exec.Cmd
	done chan struct{} // closed when the server process has exited

	closeOnce sync.Once
}

// StartMariaDB creates a data directory in a new temporary directory with
// the machine's mariadb-install-db (or mysql_install_db) and starts
// mariadbd (or mysqld) on it. Close stops the server and removes the
// directory.
func StartMariaDB() (*MariaDB, error) {
	server, install, err := findMariaDB(append(filepath.SplitList(os.Getenv("PATH")), "/usr/sbin", "/usr/bin"))
	if err != nil {
		return nil, err
	}
	var runAs []string
	var cred *syscall.Credential
	if os.Geteuid() == 0 {
		u, err := user.Lookup("mysql")
		if err != nil {
			return nil, fmt.Errorf("testenv: running as root, but there is no \"mysql\" system user to run MariaDB as (%v): %s", err, mysqlInstallHint)
		}
		uid, err1 := strconv.ParseUint(u.Uid, 10, 32)
		gid, err2 := strconv.ParseUint(u.Gid, 10, 32)
		if err1 != nil || err2 != nil {
			return nil, fmt.Errorf("testenv: user mysql has uid %q gid %q", u.Uid, u.Gid)
		}
		cred = &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}
		runAs = []string{"--user=mysql"}
	}
	reapStaleMariaDB()
	dir, err := os.MkdirTemp("", tempMariaDBPrefix)
	if err != nil {
		return nil, fmt.Errorf("testenv: %w", err)
	}
	m := &MariaDB{dir: dir, done: make(chan struct{})}
	fail := func(err error) (*MariaDB, error) {
		os.RemoveAll(dir)
		return nil, err
	}
	if err := os.WriteFile(filepath.Join(dir, "owner.pid"), []byte(strconv.Itoa(os.Getpid())), 0o644); err != nil {
		return fail(fmt.Errorf("testenv: %w", err))
	}
	if cred != nil {
		if err := os.Chown(dir, int(cred.Uid), int(cred.Gid)); err != nil {
			return fail(fmt.Errorf("testenv: %w", err))
		}
	}
	data := filepath.Join(dir, "data")
	initdb := exec.Command(install, append([]string{"--no-defaults", "--datadir=" + data, "--auth-root-authentication-method=normal", "--skip-test-db"}, runAs...)...)
	initdb.Dir = dir
	initdb.WaitDelay = 5 * time.Second
	if out, err := initdb.CombinedOutput(); err != nil {
		return fail(fmt.Errorf("testenv: %s: %v\n%s", initdb, err, tail2(out, 2000)))
	}
	if m.port, err = ServerPort(); err != nil {
		return fail(err)
	}
	m.cmd = exec.Command(server, append([]string{"--no-defaults", "--datadir=" + data,
		"--bind-address=127.0.0.1", "--port=" + strconv.Itoa(m.port),
		"--socket=" + filepath.Join(dir, "sock"), "--pid-file=" + filepath.Join(dir, "server.pid"),
		"--log-error=" + m.logFile(),
		"--skip-grant-tables", "--skip-name-resolve", "--skip-log-bin",
		"--character-set-server=utf8mb4", "--collation-server=utf8mb4_bin",
		"--innodb-buffer-pool-size=64M", "--innodb-flush-log-at-trx-commit=2", "--innodb-doublewrite=0",
		"--max-connections=500"}, runAs...)...)
	m.cmd.Dir = dir
	if err := m.cmd.Start(); err != nil {
		return fail(fmt.Errorf("testenv: start %s: %w", server, err))
	}
	go func() { m.cmd.Wait(); close(m.done) }()
	if err := m.waitReady(2 * time.Minute); err != nil {
		m.Close()
		return nil, err
	}
	return m, nil
}

func (m *MariaDB) logFile() string { return filepath.Join(m.dir, "server.log") }

// waitReady waits until the server accepts connections, exits or timeout
// passes.
func (m *MariaDB) waitReady(timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		db, err := sql.Open("mysql", m.DSN(""))
		if err == nil {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			err = db.PingContext(ctx)
			cancel()
			db.Close()
		}
		if err == nil {
			return nil
		}
		select {
		case <-m.done:
			return fmt.Errorf("testenv: MariaDB exited while starting (%v)\n%s", m.cmd.ProcessState, tail(m.logFile(), 2000))
		case <-time.After(100 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("testenv: MariaDB did not accept connections within %s: %v\n%s", timeout, err, tail(m.logFile(), 2000))
		}
	}
}

// Port returns the TCP port the server listens on at 127.0.0.1.
func (m *MariaDB) Port() int { return m.port }

// DSN returns the go-sql-driver DSN of database db ("": none) as root.
func (m *MariaDB) DSN(db string) string {
	return fmt.Sprintf("root@tcp(127.0.0.1:%d)/%s", m.port, db)
}

// Close stops the server and removes its directory.
func (m *MariaDB) Close() {
	m.closeOnce.Do(func() {
		if m.cmd != nil && m.cmd.Process != nil {
			m.cmd.Process.Signal(syscall.SIGTERM)
			select {
			case <-m.done:
			case <-time.After(30 * time.Second):
				m.cmd.Process.Kill()
				<-m.done
			}
		}
		os.RemoveAll(m.dir)
	})
}

// tail2 returns at most the last n bytes of b.
func tail2(b []byte, n int) string {
	if len(b) > n {
		b = b[len(b)-n:]
	}
	return strings.TrimSpace(string(b))
}

// findMariaDB returns the paths of the server and of the program that
// creates a data directory: mariadbd and mariadb-install-db, or mysqld and
// mysql_install_db, from the first of dirs that has them (StartMariaDB
// looks on PATH, then in /usr/sbin and /usr/bin: Debian puts the server in
// /usr/sbin, which a non-root PATH may lack).
func findMariaDB(dirs []string) (server, install string, err error) {
	find := func(names ...string) string {
		for _, n := range names {
			for _, d := range dirs {
				if d == "" {
					continue
				}
				p := filepath.Join(d, n)
				if fi, err := os.Stat(p); err == nil && fi.Mode().IsRegular() && fi.Mode()&0o111 != 0 {
					return p
				}
			}
		}
		return ""
	}
	server = find("mariadbd", "mysqld")
	install = find("mariadb-install-db", "mysql_install_db")
	if server == "" || install == "" {
		return "", "", fmt.Errorf("testenv: MariaDB server programs (mariadbd and mariadb-install-db, or mysqld and mysql_install_db) not found on PATH, in /usr/sbin or /usr/bin: %s", mysqlInstallHint)
	}
	return server, install, nil
}

// reapStaleMariaDB stops and removes the servers of processes that died
// without closing them (say, killed by go test's timeout).
func reapStaleMariaDB() {
	dirs, _ := filepath.Glob(filepath.Join(os.TempDir(), tempMariaDBPrefix+"*"))
	for _, dir := range dirs {
		b, err := os.ReadFile(filepath.Join(dir, "owner.pid"))
		if err != nil {
			continue
		}
		pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
		if err != nil || pid <= 0 || !processGone(pid) {
			continue
		}
		if b, err := os.ReadFile(filepath.Join(dir, "server.pid")); err == nil {
			spid, err := strconv.Atoi(strings.TrimSpace(string(b)))
			if cwd, _ := os.Readlink(fmt.Sprintf("/proc/%d/cwd", spid)); err == nil && spid > 0 && strings.HasPrefix(cwd, dir) {
				syscall.Kill(spid, syscall.SIGKILL)
			}
		}
		os.RemoveAll(dir)
	}
}

// The server that MySQL creates databases on, set up on first use.
var (
	mysqlOnce     sync.Once
	mysqlAdminDSN string
	mysqlErr      error
	mysqlServer   atomic.Pointer[MariaDB]
)

// mysqlShared returns the DSN (without a database) of the server that
// MySQL uses: the one in MySQLDSNEnv or this binary's MariaDB.
func mysqlShared() (*driver.Config, error) {
	mysqlOnce.Do(func() {
		if d := os.Getenv(MySQLDSNEnv); d != "" {
			mysqlAdminDSN = d
			return
		}
		m, err := StartMariaDB()
		if err != nil {
			mysqlErr = err
			return
		}
		mysqlServer.Store(m)
		mysqlAdminDSN = m.DSN("")
	})
	if mysqlErr != nil {
		return nil, mysqlErr
	}
	cfg, err := driver.ParseDSN(mysqlAdminDSN)
	if err != nil {
		return nil, fmt.Errorf("testenv: %s: %w", MySQLDSNEnv, err)
	}
	return cfg, nil
}

// MySQL returns the go-sql-driver DSN of a new, empty database for this
// test (character set utf8mb4, collation utf8mb4_bin: tag names are
// compared byte for byte) and drops the database in Cleanup. The database
// lives on the server that DISPENSER_TEST_MYSQL_DSN names if set, else on
// a throwaway MariaDB that the test binary starts on first use from the
// machine's MariaDB programs (StartMariaDB). A package that calls MySQL
// needs
//
//	func TestMain(m *testing.M) { os.Exit(testenv.Run(m)) }
//
// so that the server stops when its tests end. MySQL fails the test if
// there is no such TestMain or no MariaDB to run; it never skips.
func MySQL(tb testing.TB) string {
	tb.Helper()
	if !running.Load() {
		tb.Fatalf("testenv: MySQL needs the package's tests to run under testenv.Run: add func TestMain(m *testing.M) { os.Exit(testenv.Run(m)) }")
	}
	admin, err := mysqlShared()
	if err != nil {
		tb.Fatalf("%v", err)
	}
	var b [8]byte
	rand.Read(b[:])
	name := "dispenser_test_" + hex.EncodeToString(b[:])
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := mysqlAdmin(ctx, admin, "CREATE DATABASE `"+name+"` CHARACTER SET utf8mb4 COLLATE utf8mb4_bin"); err != nil {
		tb.Fatalf("testenv: create database %s: %v", name, err)
	}
	tb.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if err := mysqlAdmin(ctx, admin, "DROP DATABASE IF EXISTS `"+name+"`"); err != nil {
			tb.Errorf("testenv: drop database %s: %v", name, err)
		}
	})
	cfg := admin.Clone()
	cfg.DBName = name
	return cfg.FormatDSN()
}

// mysqlAdmin runs one statement on the server of admin.
func mysqlAdmin(ctx context.Context, admin *driver.Config, stmt string) error {
	conn, err := driver.NewConnector(admin)
	if err != nil {
		return err
	}
	db := sql.OpenDB(conn)
	defer db.Close()
	_, err = db.ExecContext(ctx, stmt)
	return err
}

// stopMySQL stops the MariaDB that MySQL started, if any (Run calls it).
func stopMySQL() {
	if m := mysqlServer.Load(); m != nil {
		m.Close()
	}
}
