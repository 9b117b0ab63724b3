package snowflake

import (
	"log/slog"
	"slices"
	"sync"
	"testing"
	"time"
)

// fakeClock is an injected wall clock plus monotonic clock. Add moves both;
// SetWall moves only the wall clock, as an NTP step would.
type fakeClock struct {
	mu   sync.Mutex
	wall time.Time
	mono time.Duration
}

func newFakeClock(tb testing.TB, start time.Time) *fakeClock {
	tb.Helper()
	return &fakeClock{wall: start}
}

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.wall
}

func (c *fakeClock) Mono() time.Duration {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.mono
}

func (c *fakeClock) Add(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.wall = c.wall.Add(d)
	c.mono += d
}

func (c *fakeClock) SetWall(t time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.wall = t
}

// Sleep advances the clock, as if time passed while sleeping.
func (c *fakeClock) Sleep(d time.Duration) { c.Add(d) }

// testLogger logs to the test's output.
func testLogger(tb testing.TB) *slog.Logger {
	tb.Helper()
	return slog.New(slog.NewTextHandler(tb.Output(), &slog.HandlerOptions{Level: slog.LevelDebug}))
}

// requireUnique fails if ids holds a duplicate.
func requireUnique(tb testing.TB, ids []int64) {
	tb.Helper()
	sorted := slices.Clone(ids)
	slices.Sort(sorted)
	for i := 1; i < len(sorted); i++ {
		if sorted[i] == sorted[i-1] {
			p := Decode(sorted[i], time.Time{})
			tb.Fatalf("duplicate ID %d (worker %d, timestamp %d, sequence %d) among %d IDs",
				sorted[i], p.Worker, p.Timestamp, p.Sequence, len(ids))
		}
	}
}

// requireIncreasing fails unless ids strictly increase.
func requireIncreasing(tb testing.TB, ids []int64) {
	tb.Helper()
	for i := 1; i < len(ids); i++ {
		if ids[i] <= ids[i-1] {
			tb.Fatalf("ids[%d] = %d <= ids[%d] = %d", i, ids[i], i-1, ids[i-1])
		}
	}
}
