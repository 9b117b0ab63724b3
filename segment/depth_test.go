package segment

import (
	"context"
	"fmt"
	"github.com/dispenser-dev/dispenser/tagmodel"
	"math"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/dispenser-dev/dispenser/internal/tests/wait"
)

// fetchSizes returns the sizes asked of st for tag, in order (0: the tag's
// own step).
func fetchSizes(st *memStore, tag string) []int64 {
	st.mu.Lock()
	defer st.mu.Unlock()
	var out []int64
	for _, f := range st.fetches {
		if f.tag == tag {
			out = append(out, f.step)
		}
	}
	return out
}

// TestDepthFollowsBursts: a tag pinned at step 10 meets a burst of 40
// waiting requests while its fetches are held back: the fetches after the
// first take several steps at once (never more than MaxDepth), every
// request gets its ID, none twice; once requests stop outrunning the
// fetches, each fetch takes half as many steps until it is back at one.
// Without the depth (nextDepth always 1) every fetch asks for one step and
// the burst assertion fails; without the calm halving the last one does.
func TestDepthFollowsBursts(t *testing.T) {
	const step, maxDepth, burst = 10, 16, 40
	st := newMemStore(t, tagmodel.Tag{Name: "a", MaxID: 1, Step: step})
	gate := make(chan struct{})
	st.set(func(s *memStore) { s.gate = gate })
	var mu sync.Mutex
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	advance := func(d time.Duration) { mu.Lock(); now = now.Add(d); mu.Unlock() }
	a := newAllocator(t, Settings{Store: st, MaxStep: step, MaxDepth: maxDepth, MaxWait: time.Minute, Now: clock})

	var wg sync.WaitGroup
	ids := make(chan int64, burst)
	for range burst {
		wg.Go(func() {
			runs, err := a.Take(context.Background(), "a", 1, nil)
			if err != nil {
				t.Errorf("Take: %v", err)
				return
			}
			ids <- runs[0].First
		})
	}
	wait.For(t, 10*time.Second, "the burst to wait", func() bool { return a.Totals().Waits == burst })
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	// Let the fetches through one at a time, each once the requests left
	// have spent what is in memory and wait for it, until every request
	// has its ID.
	starving := func() bool {
		s := a.Stats()[0]
		return s.Loading && !s.NextReady && (s.Current == nil || s.Current.Cursor == s.Current.End)
	}
	for served := false; !served; {
		select {
		case <-done:
			served = true
			continue
		default:
		}
		if !starving() {
			time.Sleep(time.Millisecond)
			continue
		}
		select {
		case gate <- struct{}{}:
		case <-done:
			served = true
		}
	}
	close(ids)
	var got []int64
	for id := range ids {
		got = append(got, id)
	}
	slices.Sort(got)
	if len(got) != burst || len(slices.Compact(slices.Clone(got))) != burst {
		t.Fatalf("burst got %d IDs, %d distinct, want %d distinct", len(got), len(slices.Compact(slices.Clone(got))), burst)
	}
	sizes := fetchSizes(st, "a")
	if len(sizes) < 2 || sizes[0] != 0 {
		t.Fatalf("fetch sizes %v: want the tag's own step first, then more", sizes)
	}
	if slices.Max(sizes) <= step {
		t.Errorf("fetch sizes %v: requests waited for every fetch, want one of more than one step (%d)", sizes, step)
	}
	for _, s := range sizes {
		if s > step*maxDepth {
			t.Errorf("fetch sizes %v: %d is above MaxDepth steps (%d)", sizes, s, step*maxDepth)
		}
	}

	// The burst is over: requests one at a time, each after the fetch it
	// started has arrived, never wait. Within a second of the last growth
	// the depth stays; after that it halves at most once a second.
	close(gate)
	n := len(sizes)
	depth := a.Stats()[0].Depth
	for range 3 * step * maxDepth {
		take(t, a, "a", 1)
		wait.For(t, 10*time.Second, "no fetch running", func() bool { return !a.Stats()[0].Loading })
	}
	if got := a.Stats()[0].Depth; got != depth {
		t.Fatalf("depth %d, then %d within the same second, want it kept", depth, got)
	}
	for i := 0; ; i++ {
		advance(depthDecay)
		take(t, a, "a", 1)
		wait.For(t, 10*time.Second, "no fetch running", func() bool { return !a.Stats()[0].Loading })
		sizes = fetchSizes(st, "a")
		if sizes[len(sizes)-1] == step && a.Stats()[0].Depth == 1 {
			break
		}
		if i > 10_000 {
			t.Fatalf("fetch sizes %v: the depth did not come back to 1", sizes)
		}
	}
	calm := sizes[n:]
	for i := 1; i < len(calm); i++ {
		if calm[i] > calm[i-1] {
			t.Errorf("calm fetch sizes %v: grew without a wait", calm)
		}
		if calm[i]/step < calm[i-1]/step/2 {
			t.Errorf("calm fetch sizes %v: fell by more than half in a second", calm)
		}
	}
	if got := a.Totals().Waits; got != burst {
		t.Errorf("waits = %d, want %d (none after the burst)", got, burst)
	}
}

// TestDepthAtTheEndOfTheRange: a deep fetch that would pass 2^63-1 falls
// back to the tag's own step, and every ID up to the end is handed out
// once.
func TestDepthAtTheEndOfTheRange(t *testing.T) {
	const step = 10
	start := int64(math.MaxInt64 - 95)
	st := newMemStore(t, tagmodel.Tag{Name: "edge", MaxID: start, Step: step})
	a := newAllocator(t, Settings{Store: st, MaxStep: step, MaxDepth: 64, MaxWait: time.Minute})
	var mu sync.Mutex
	seen := map[int64]bool{}
	var wg sync.WaitGroup
	for range 16 {
		wg.Go(func() {
			for {
				runs, err := a.Take(context.Background(), "edge", 1, nil)
				if err != nil {
					return // ErrExhausted once the range is spent
				}
				mu.Lock()
				if seen[runs[0].First] {
					t.Errorf("ID %d twice", runs[0].First)
				}
				seen[runs[0].First] = true
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	// The range holds 9 whole steps (90 IDs) below 2^63-1.
	if want := 90; len(seen) != want {
		t.Errorf("handed out %d IDs, want %d", len(seen), want)
	}
	if _, err := a.Take(context.Background(), "edge", 1, nil); err == nil {
		t.Errorf("Take after the end: no error, want ErrExhausted")
	}
}

// limitStore is a memStore that, as the real stores do, refuses a fetch
// of more than tagmodel.MaxStepLimit IDs.
type limitStore struct{ *memStore }

func (s limitStore) Fetch(ctx context.Context, tag string, step int64) (tagmodel.Allocation, error) {
	if step > tagmodel.MaxStepLimit {
		return tagmodel.Allocation{}, fmt.Errorf("limit: %w %d: want at most %d", tagmodel.ErrInvalidStep, step, tagmodel.MaxStepLimit)
	}
	return s.memStore.Fetch(ctx, tag, step)
}

// TestDepthKeepsAFetchWithinTheStepLimit: a deeper fetch never asks for
// more than tagmodel.MaxStepLimit IDs, which every store refuses; for a
// tag whose step is over half the limit the depth stays 1 and the tag
// keeps being served.
func TestDepthKeepsAFetchWithinTheStepLimit(t *testing.T) {
	step := int64(tagmodel.MaxStepLimit/2 + 1)
	st := limitStore{newMemStore(t, tagmodel.Tag{Name: "big", MaxID: 1, Step: step})}
	a := newAllocator(t, Settings{Store: st, MaxStep: tagmodel.MaxStepLimit, MaxDepth: 4, MaxWait: 2 * time.Second})
	runs, err := a.Take(t.Context(), "big", int(step), nil)
	if err != nil || len(runs) != 1 || runs[0] != (Run{First: 1, Last: step}) {
		t.Fatalf("Take of the first segment = %v, %v; want one run 1..%d", runs, err, step)
	}
	runs, err = a.Take(t.Context(), "big", 1, nil)
	if err != nil {
		t.Fatalf("Take after the first segment: %v (a fetch above the step limit?)", err)
	}
	if got := runs[0].First; got != step+1 {
		t.Fatalf("next ID = %d, want %d", got, step+1)
	}
}
