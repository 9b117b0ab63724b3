// Package wait is the one wait-for-a-condition helper of the test suites.
// A test waits for the event itself, not for something that usually comes
// first; the deadline a caller gives only bounds a hang: it asserts
// nothing about how long the wait took.
package wait

import (
	"testing"
	"time"
)

// maxPoll is the longest pause between two polls of For: the first polls
// come after a millisecond, the pause doubling up to maxPoll, so that a
// condition soon true is seen soon and a long wait does not spin.
const maxPoll = 10 * time.Millisecond

// For polls cond until it holds and fails tb (Fatalf) if it does not
// within d; what says what was awaited, for the message.
func For(tb testing.TB, d time.Duration, what string, cond func() bool) {
	tb.Helper()
	deadline := time.Now().Add(d)
	pause := time.Millisecond
	for !cond() {
		if time.Now().After(deadline) {
			tb.Fatalf("timed out after %v waiting for %s", d, what)
		}
		time.Sleep(pause)
		pause = min(2*pause, maxPoll)
	}
}

// UntilPoll is how often Until polls: its conditions ask servers.
const UntilPoll = 50 * time.Millisecond

// Until polls cond every UntilPoll until it returns nil or d has passed,
// and returns its last error, which says why the condition does not hold
// yet: for a caller that decides itself what a timeout means.
func Until(d time.Duration, cond func() error) error {
	deadline := time.Now().Add(d)
	for {
		err := cond()
		if err == nil || time.Now().After(deadline) {
			return err
		}
		time.Sleep(UntilPoll)
	}
}
