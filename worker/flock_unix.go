//go:build unix

package worker

import (
	"errors"
	"os"
	"syscall"
)

// errLocked means another open file description holds the lock.
var errLocked = errors.New("locked")

// flock takes f's exclusive lock without waiting (flock(2) LOCK_EX|LOCK_NB).
func flock(f *os.File) error {
	for {
		err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
		switch {
		case err == nil:
			return nil
		case errors.Is(err, syscall.EINTR):
			continue
		case errors.Is(err, syscall.EWOULDBLOCK):
			return errLocked
		default:
			return err
		}
	}
}
