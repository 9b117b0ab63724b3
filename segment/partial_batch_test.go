package segment

import (
	"context"
	"errors"
	"fmt"
	"github.com/dispenser-dev/dispenser/tagmodel"
	"log/slog"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/dispenser-dev/dispenser/internal/tests/wait"
)

// partialStore is an in-memory Store of one tag, "a", whose fetches fail
// while it is down and which records every fetch and give-back.
type partialStore struct {
	mu       sync.Mutex // protects the fields below
	maxID    int64
	step     int64
	down     bool
	fetched  []tagmodel.Allocation
	gaveBack []int64 // firstUnissued of each give-back that took
}

var errPartialDown = errors.New("partial store: down")

func (s *partialStore) setDown(down bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.down = down
}

func (s *partialStore) Fetch(ctx context.Context, tag string, step int64) (tagmodel.Allocation, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if tag != "a" {
		return tagmodel.Allocation{}, fmt.Errorf("partial store: %w", tagmodel.ErrUnknownTag)
	}
	if s.down {
		return tagmodel.Allocation{}, errPartialDown
	}
	if step <= 0 {
		step = s.step
	}
	a := tagmodel.Allocation{Start: s.maxID, End: s.maxID + step, TagStep: s.step}
	s.maxID += step
	s.fetched = append(s.fetched, a)
	return a, nil
}

func (s *partialStore) Tags(ctx context.Context) ([]string, error) { return []string{"a"}, nil }

func (s *partialStore) Tag(ctx context.Context, name string) (tagmodel.Tag, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if name != "a" {
		return tagmodel.Tag{}, fmt.Errorf("partial store: %w", tagmodel.ErrUnknownTag)
	}
	return tagmodel.Tag{Name: "a", MaxID: s.maxID, Step: s.step}, nil
}

func (s *partialStore) GiveBack(ctx context.Context, tag string, end, first int64) (bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if tag != "a" || s.maxID != end {
		return false, nil
	}
	s.maxID = first
	s.gaveBack = append(s.gaveBack, first)
	return true, nil
}

// partialStats returns the allocator's stats of tag "a".
func partialStats(tb testing.TB, a *Allocator) TagStats {
	tb.Helper()
	for _, ts := range a.Stats() {
		if ts.Tag == "a" {
			return ts
		}
	}
	tb.Fatal(`no stats of tag "a"`)
	return TagStats{}
}

// TestFailedBatchSkipsTheIDsItTook checks the README's promise "a batch that
// fails with 503 midway skips the IDs it took": a batch larger than the
// two buffers together takes the rest of the current segment, switches to
// the next one, and then finds no segment because the store is down. It
// must fail with ErrUnavailable, and none of the IDs it took may ever be
// handed out, neither by this allocator once the store is back nor by the
// next one after a give-back.
func TestFailedBatchSkipsTheIDsItTook(t *testing.T) {
	const step = 10
	st := &partialStore{maxID: 1, step: step}
	a, err := New(Settings{Store: st, MaxStep: step, PrefetchRatio: 0.1, MaxWait: 50 * time.Millisecond,
		RetryMin: time.Millisecond, RetryMax: 5 * time.Millisecond, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Close(context.Background()) })
	ctx := context.Background()

	handed := map[int64]bool{} // every ID handed out, by either allocator
	record := func(who string, runs []Run) {
		t.Helper()
		for _, id := range expandRuns(runs) {
			if handed[id] {
				t.Fatalf("%s: ID %d handed out twice", who, id)
			}
			handed[id] = true
		}
	}
	runs, err := a.Take(ctx, "a", 3, nil)
	if err != nil {
		t.Fatal(err)
	}
	record("before the failure", runs) // 1..3; the next segment is fetched
	wait.For(t, 30*time.Second, "the next segment", func() bool { return partialStats(t, a).NextReady })
	before := partialStats(t, a)
	if before.Current == nil || before.Next == nil {
		t.Fatalf("stats %+v: want a current and a next segment", before)
	}

	st.setDown(true)
	const n = 2*step + 5 // more than both buffers hold
	taken, err := a.Take(ctx, "a", n, nil)
	if !errors.Is(err, ErrUnavailable) {
		t.Fatalf("Take(%d) with the store down = %v, %v; want ErrUnavailable", n, taken, err)
	}
	// What the batch took: the IDs the buffers held before it and no
	// longer hold, whatever Take returned with its error.
	after := partialStats(t, a)
	var took []int64
	for id := range unissued(before) {
		if !unissued(after)[id] {
			took = append(took, id)
		}
	}
	slices.Sort(took)
	if len(took) == 0 || len(took) >= n {
		t.Fatalf("the failed batch took %d IDs (%v; buffers before %+v %+v, after %+v %+v); the test needs one that took part of its %d",
			len(took), took, before.Current, before.Next, after.Current, after.Next, n)
	}
	if got := expandRuns(taken); len(got) > 0 && !slices.Equal(got, took) {
		t.Errorf("Take returned %v with its error, but the buffers lost %v", got, took)
	}
	for _, id := range took {
		if handed[id] {
			t.Fatalf("the failed batch took ID %d, which was handed out before", id)
		}
	}

	// The store comes back: this allocator serves again, then a second one
	// takes over after Close's give-back. Neither may hand out what the
	// failed batch took.
	st.setDown(false)
	for range 5 {
		runs, err := a.Take(ctx, "a", 7, nil)
		if err != nil {
			t.Fatalf("Take after the store came back: %v", err)
		}
		record("first allocator after the failure", runs)
	}
	if err := a.Close(ctx); err != nil {
		t.Fatal(err)
	}
	b, err := New(Settings{Store: st, MaxStep: step, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close(context.Background()) })
	for range 5 {
		runs, err := b.Take(ctx, "a", 7, nil)
		if err != nil {
			t.Fatalf("second allocator: %v", err)
		}
		record("second allocator", runs)
	}
	for _, id := range took {
		if handed[id] {
			t.Errorf("ID %d, taken by the failed batch, was handed out later", id)
		}
	}
	st.mu.Lock()
	gave := st.gaveBack
	st.mu.Unlock()
	if len(gave) == 0 {
		t.Errorf("Close gave nothing back; the test wants the give-back path exercised")
	}
}

// unissued returns the IDs a tag's buffers hold, from its stats.
func unissued(ts TagStats) map[int64]bool {
	ids := map[int64]bool{}
	for _, seg := range []*SegmentStats{ts.Current, ts.Next} {
		if seg == nil {
			continue
		}
		for id := seg.Cursor; id < seg.End; id++ {
			ids[id] = true
		}
	}
	return ids
}

// expandRuns lists the IDs of runs.
func expandRuns(runs []Run) []int64 {
	var ids []int64
	for _, r := range runs {
		for id := r.First; id <= r.Last; id++ {
			ids = append(ids, id)
		}
	}
	return ids
}
