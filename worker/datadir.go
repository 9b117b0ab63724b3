package worker

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"time"
	"unicode"
)

// LockFile is the file inside a data directory whose lock says which
// process holds the directory; it also names the holder (PID, host, start).
const LockFile = "dispenser.lock"

// The data directory's lock.
//
// Safety argument: two embedded nats-servers on one JetStream store each
// believe they alone write it: both workers find the same max_id in the
// segment bucket and the same free worker IDs in the lease bucket, and
// hand out the same IDs (issue 34), and each server's later writes and
// compactions destroy the other's. So a data directory is held by one
// process at a time:
//
//   - lockDataDir takes flock(2) LOCK_EX|LOCK_NB on DataDir/dispenser.lock
//     before the nats-server is created (which opens DataDir/jetstream),
//     and StartEmbedded's server releases it (closes the file) only after
//     the server has shut down and closed its JetStream files
//     (EmbeddedServer.Close: Shutdown, WaitForShutdown, then unlock).
//   - flock's lock belongs to the open file description, and the kernel
//     drops it when the last descriptor of that description is closed,
//     which the death of the process does, SIGKILL included. A crash
//     leaves the file, never the lock: the next start takes it, nothing
//     is cleared by hand. The file's content (the holder) is only for the
//     error message; it is never trusted to decide anything.
//   - Every lockDataDir opens the file itself, so a second holder in the
//     same process (a second worker.New on the same directory) conflicts
//     with the first exactly as a second process does.
//   - Go opens files close-on-exec: a program the worker starts does not
//     inherit the descriptor, so it cannot keep the lock once the worker
//     died.
//   - flock is advisory: it keeps out other dispenser workers (and any
//     program that asks for the lock), not a nats-server started by hand
//     on the same directory. Don't.
//   - Network file systems: whether flock is honoured across machines
//     depends on the file system and its mount options (NFS with `nolock`
//     or `local_lock=flock` locks on one client only), which the worker
//     cannot find out. Where it can tell that the directory is on a
//     network file system (Linux: NFS, SMB/CIFS, AFS, Coda, NCP), it
//     refuses to start (ErrNetworkDataDir); a file system that refuses
//     locks (ENOLCK, EOPNOTSUPP) is refused too. docs/operations.md says so.

// dirLock is a held data directory lock; unlock releases it.
type dirLock struct {
	f *os.File
}

// lockDataDir creates dir if needed and takes its lock, then writes this
// process into the lock file. A directory held by another process (or by
// another lockDataDir of this one) is ErrDataDirInUse, with the holder
// the lock file names.
func lockDataDir(dir string) (*dirLock, error) {
	abs, err := filepath.Abs(dir)
	if err != nil {
		abs = dir
	}
	if err := os.MkdirAll(dir, 0o750); err != nil {
		return nil, fmt.Errorf("--data-dir %s: %w", abs, err)
	}
	if fs, ok := networkFS(dir); ok {
		return nil, fmt.Errorf("%w: --data-dir %s is on %s: whether its lock keeps a second worker on another machine out cannot be known there, and two workers on one data directory hand out the same IDs; put the data directory on a local disk, or run nats-server yourself and start the workers with --nats-url", ErrNetworkDataDir, abs, fs)
	}
	path := filepath.Join(dir, LockFile)
	// Not O_TRUNC: the file names the holder while someone holds it.
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, fmt.Errorf("--data-dir %s: lock file: %w", abs, err)
	}
	if err := flock(f); err != nil {
		defer f.Close()
		if errors.Is(err, errLocked) {
			return nil, fmt.Errorf("%w: --data-dir %s is held by another process%s: two workers on one data directory would hand out the same IDs; stop that worker first, or give this one another --data-dir (its own data), or connect it to a shared NATS with --nats-url", ErrDataDirInUse, abs, holder(f))
		}
		return nil, fmt.Errorf("%w: --data-dir %s: cannot lock %s (%w): without a lock a second worker could open the same data and hand out the same IDs; put the data directory on a local file system", ErrNetworkDataDir, abs, LockFile, err)
	}
	host, _ := os.Hostname()
	info := fmt.Sprintf("pid %d on host %s, started %s\n", os.Getpid(), host, time.Now().UTC().Format(time.RFC3339))
	if err := f.Truncate(0); err == nil {
		_, _ = f.WriteAt([]byte(info), 0) // only for the message of the next one
	}
	return &dirLock{f: f}, nil
}

// unlock releases the lock. The file stays: removing it would let a
// process that opened it just before lock a file no longer in the
// directory while a third locks a new one.
func (l *dirLock) unlock() {
	if l != nil && l.f != nil {
		l.f.Close() // closing the only descriptor drops the flock
		l.f = nil
	}
}

// holder returns " (pid …)" from a lock file, or "" if it names nobody
// readable (the holder may be writing it right now).
func holder(f *os.File) string {
	b, _ := io.ReadAll(io.LimitReader(io.NewSectionReader(f, 0, 512), 512))
	s := strings.TrimSpace(string(b))
	if s == "" || strings.ContainsFunc(s, func(r rune) bool { return !unicode.IsPrint(r) }) {
		return ""
	}
	return " (" + s + ")"
}
