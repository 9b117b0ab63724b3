package snowflake_test

import (
	"math/rand/v2"
	"testing"
	"time"

	"github.com/dispenser-dev/dispenser/snowflake"
)

// Meituan Leaf's snowflake: epoch 1288834974657 (2010-11-04T01:42:54.657Z),
// 41 bits of milliseconds, 10 of worker ID (its ZooKeeper sequence number,
// 0..1023), 12 of sequence, as SnowflakeIDGenImpl composes them.
var leafEpoch = time.UnixMilli(1288834974657).UTC()

func leafID(at time.Time, worker, seq int64) int64 {
	return (at.UnixMilli()-leafEpoch.UnixMilli())<<22 | worker<<12 | seq
}

// migrationEpoch is the --snowflake-epoch docs/migrate-from-leaf.md
// recommends to a team moving off Leaf: before Leaf's by the lead below.
var migrationEpoch = time.Date(2009, 1, 1, 0, 0, 0, 0, time.UTC)

// dispenserID is the first ID a dispenser worker with worker ID worker
// issues at time at, with epoch and layout.
func dispenserID(tb testing.TB, epoch time.Time, layout snowflake.Layout, worker int, at time.Time) int64 {
	tb.Helper()
	g, err := snowflake.New(snowflake.Settings{Epoch: epoch, Layout: layout, WorkerID: worker, Now: func() time.Time { return at }})
	if err != nil {
		tb.Fatalf("snowflake.New: %v", err)
	}
	id, err := g.Next()
	if err != nil {
		tb.Fatalf("Next: %v", err)
	}
	return id
}

// TestLeafIDsBelowDispensers is the claim of docs/migrate-from-leaf.md:
// with --snowflake-epoch an amount L before Leaf's epoch (L is the lead;
// 2009-01-01 gives about 673 days), every ID a Leaf server issues before
// L has passed since dispenser's first snowflake ID is below every ID
// dispenser issues, whatever the worker IDs: the timestamp bits come
// first, and dispenser's are always L ahead of Leaf's. So the two never
// collide and IDs keep growing across the switch. At L exactly they can
// collide: the bound is tight.
func TestLeafIDsBelowDispensers(t *testing.T) {
	lead := leafEpoch.Sub(migrationEpoch)
	if lead < 365*24*time.Hour {
		t.Fatalf("lead %v: the recommended epoch should leave Leaf at least a year", lead)
	}
	start := time.Date(2026, 11, 26, 8, 0, 0, 0, time.UTC) // dispenser's first snowflake ID
	first := dispenserID(t, migrationEpoch, snowflake.DefaultLayout, 0, start)

	// At the boundary: Leaf's largest ID 1 ms before start+lead is below
	// dispenser's smallest; Leaf's smallest at start+lead is equal to it.
	if last := leafID(start.Add(lead-time.Millisecond), 1023, 4095); last >= first {
		t.Errorf("Leaf's largest ID 1 ms before the lead ends, %d, is not below dispenser's first, %d", last, first)
	}
	if at := leafID(start.Add(lead), 0, 0); at != first {
		t.Errorf("Leaf's ID at the end of the lead = %d, want %d, dispenser's first (the bound is tight)", at, first)
	}

	// Random IDs of both, Leaf's before the lead ends, dispenser's after
	// its start: every Leaf ID below every dispenser ID, none twice.
	r := rand.New(rand.NewPCG(1, 2))
	seen := map[int64]bool{}
	var maxLeaf int64
	minDisp := int64(1<<63 - 1)
	span := start.Add(lead).Sub(leafEpoch)
	for range 5000 {
		at := leafEpoch.Add(time.Duration(r.Int64N(int64(span))).Truncate(time.Millisecond))
		id := leafID(at, r.Int64N(1024), r.Int64N(4096))
		maxLeaf = max(maxLeaf, id)
		seen[id] = true
	}
	for range 500 {
		at := start.Add(time.Duration(r.Int64N(int64(5 * 365 * 24 * time.Hour))).Truncate(time.Millisecond))
		id := dispenserID(t, migrationEpoch, snowflake.DefaultLayout, r.IntN(1024), at)
		minDisp = min(minDisp, id)
		if seen[id] {
			t.Fatalf("dispenser ID %d was a Leaf ID", id)
		}
	}
	if maxLeaf >= minDisp {
		t.Errorf("largest Leaf ID %d is not below the smallest dispenser ID %d", maxLeaf, minDisp)
	}
}

// TestDefaultEpochCollidesWithLeaf: why the guide tells a team with Leaf
// IDs to set --snowflake-epoch. With dispenser's default epoch
// (2026-01-01), a worker issues in 2030 the very ID a Leaf server with the
// same worker ID issued in 2014: dispenser's timestamps repeat Leaf's
// about 15 years later, and every dispenser ID is smaller than Leaf's of
// the same day.
func TestDefaultEpochCollidesWithLeaf(t *testing.T) {
	at := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	d := dispenserID(t, time.Time{}, snowflake.DefaultLayout, 5, at)
	leafAt := at.Add(-snowflake.DefaultEpoch.Sub(leafEpoch))
	if l := leafID(leafAt, 5, 0); l != d {
		t.Errorf("Leaf's ID of %s = %d, want %d, dispenser's of %s", leafAt.Format(time.RFC3339), l, d, at.Format(time.RFC3339))
	}
	if leafAt.Year() != 2014 {
		t.Errorf("the colliding Leaf ID is of %s, want 2014", leafAt)
	}
	if today := leafID(at, 0, 0); d >= today {
		t.Errorf("dispenser's ID %d is not below Leaf's %d of the same time", d, today)
	}
}

// TestJSLayoutBelowLeaf: the js layout's IDs are below 2^53, every Leaf ID
// issued after 2010-11-29 (2^31 ms after Leaf's epoch) is at least 2^53:
// they never collide, whatever the epoch (but js IDs are smaller than
// Leaf's).
func TestJSLayoutBelowLeaf(t *testing.T) {
	if got := snowflake.JSLayout.MaxID(); got >= 1<<53 {
		t.Fatalf("JSLayout.MaxID() = %d, want below 2^53", got)
	}
	from := leafEpoch.Add(1 << 31 * time.Millisecond)
	if got := leafID(from, 0, 0); got != 1<<53 {
		t.Errorf("Leaf's smallest ID of %s = %d, want 2^53", from.Format(time.RFC3339), got)
	}
	if from.After(time.Date(2010, 11, 29, 0, 0, 0, 0, time.UTC)) {
		t.Errorf("Leaf's IDs reach 2^53 at %s, want before 2010-11-29", from)
	}
	at := time.Date(2095, 1, 1, 0, 0, 0, 0, time.UTC)
	if d := dispenserID(t, time.Time{}, snowflake.JSLayout, 31, at); d >= 1<<53 {
		t.Errorf("a js ID of 2095 = %d, want below 2^53", d)
	}
}
