//go:build windows

package worker

import (
	"errors"
	"os"

	"golang.org/x/sys/windows"
)

// errLocked means another handle holds the lock.
var errLocked = errors.New("locked")

// flock takes f's exclusive lock without waiting (LockFileEx). Windows
// drops it when the handle is closed, the process's death included.
func flock(f *os.File) error {
	err := windows.LockFileEx(windows.Handle(f.Fd()), windows.LOCKFILE_EXCLUSIVE_LOCK|windows.LOCKFILE_FAIL_IMMEDIATELY, 0, 1, 0, &windows.Overlapped{})
	if errors.Is(err, windows.ERROR_LOCK_VIOLATION) {
		return errLocked
	}
	return err
}
