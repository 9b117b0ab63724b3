package wait_test

import (
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dispenser-dev/dispenser/internal/tests/wait"
)

// fatalTB records Fatalf instead of failing the test, and stops the
// goroutine as Fatalf does.
type fatalTB struct {
	testing.TB
	msg string
}

func (f *fatalTB) Helper() {}
func (f *fatalTB) Fatalf(format string, args ...any) {
	f.msg = fmt.Sprintf(format, args...)
	panic(f)
}

// run runs fn with a fatalTB and returns the message it failed with, "" if
// it did not fail.
func run(t *testing.T, fn func(tb testing.TB)) (msg string) {
	tb := &fatalTB{TB: t}
	defer func() {
		if r := recover(); r != nil && r != any(tb) {
			panic(r)
		}
		msg = tb.msg
	}()
	fn(tb)
	return ""
}

func TestFor(t *testing.T) {
	var polls atomic.Int64
	if msg := run(t, func(tb testing.TB) {
		wait.For(tb, time.Minute, "the third poll", func() bool { return polls.Add(1) == 3 })
	}); msg != "" {
		t.Errorf("For failed on a condition that came true: %s", msg)
	}
	if polls.Load() != 3 {
		t.Errorf("polled %d times, want 3: For returns once the condition holds", polls.Load())
	}
	msg := run(t, func(tb testing.TB) {
		wait.For(tb, 20*time.Millisecond, "never", func() bool { return false })
	})
	if want := "timed out after 20ms waiting for never"; msg != want {
		t.Errorf("For on a condition never true failed with %q, want %q", msg, want)
	}
}

func TestUntil(t *testing.T) {
	n := 0
	if err := wait.Until(time.Minute, func() error {
		if n++; n < 3 {
			return errors.New("not yet")
		}
		return nil
	}); err != nil || n != 3 {
		t.Errorf("Until = %v after %d polls, want nil after 3", err, n)
	}
	err := wait.Until(10*time.Millisecond, func() error { return errors.New("still down") })
	if err == nil || !strings.Contains(err.Error(), "still down") {
		t.Errorf("Until on a condition never true = %v, want its last error", err)
	}
}
