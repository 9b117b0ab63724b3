package segment

import (
	"context"
	"errors"
	"github.com/dispenser-dev/dispenser/tagmodel"
	"math"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/dispenser-dev/dispenser/internal/tests/wait"
)

// TestRegionsMapIDs: with regions, each store value v is handed out as
// v×count+region, in singles and batches across segments; a region's IDs
// increase, and three regions whose stores hand out the same values never
// share an ID. (With appendRegionRuns ignoring the regions, every region hands
// out 1, 2, 3, … and the test fails.)
func TestRegionsMapIDs(t *testing.T) {
	seen := map[int64]int{}
	for region := range 3 {
		st := newMemStore(t, tagmodel.Tag{Name: "orders", MaxID: 1, Step: 10})
		a := newAllocator(t, Settings{Store: st, MaxStep: 10, MaxDepth: 1, Regions: tagmodel.Regions{Count: 3, Region: region}})
		var got []int64
		for _, n := range []int{1, 1, 7, 15, 1, 4} {
			got = append(got, take(t, a, "orders", n)...)
		}
		want := make([]int64, 0, len(got))
		for v := int64(1); v <= 29; v++ {
			want = append(want, v*3+int64(region))
		}
		if !slices.Equal(got, want) {
			t.Fatalf("region %d: got %v, want %v", region, got, want)
		}
		for _, id := range got {
			if r, ok := seen[id]; ok {
				t.Fatalf("ID %d handed out by regions %d and %d", id, r, region)
			}
			seen[id] = region
		}
	}
}

// TestRegionsExhausted: a segment whose IDs would pass 2^63-1 once mapped
// is not served: the tag is exhausted, nothing wraps around.
func TestRegionsExhausted(t *testing.T) {
	r := tagmodel.Regions{Count: 4, Region: 3}
	top := r.MaxValue()
	if top*4+3 < 0 || (top+1)*4+3 > 0 {
		t.Fatalf("MaxValue %d is not the largest value that maps below 2^63", top)
	}
	st := newMemStore(t, tagmodel.Tag{Name: "orders", MaxID: top - 4, Step: 10})
	a := newAllocator(t, Settings{Store: st, MaxStep: 10, MaxDepth: 1, Regions: r})
	_, err := a.Take(t.Context(), "orders", 1, nil)
	if !errors.Is(err, tagmodel.ErrExhausted) && !errors.Is(err, ErrUnavailable) {
		t.Fatalf("Take = %v, want ErrExhausted (or ErrUnavailable)", err)
	}
	wait.For(t, 10*time.Second, "the tag exhausted", func() bool {
		_, err := a.Take(t.Context(), "orders", 1, nil)
		return errors.Is(err, tagmodel.ErrExhausted)
	})
	if top > math.MaxInt64/4 {
		t.Fatalf("MaxValue %d above 2^63/4", top)
	}
}

func TestRegionsCheck(t *testing.T) {
	for _, tc := range []struct {
		name string
		r    tagmodel.Regions
		ok   bool
	}{
		{"zero", tagmodel.Regions{}, true},
		{"one", tagmodel.Regions{Count: 1}, true},
		{"last of three", tagmodel.Regions{Count: 3, Region: 2}, true},
		{"region beyond", tagmodel.Regions{Count: 3, Region: 3}, false},
		{"negative region", tagmodel.Regions{Count: 3, Region: -1}, false},
		{"negative count", tagmodel.Regions{Count: -1}, false},
		{"too many", tagmodel.Regions{Count: tagmodel.MaxRegions + 1}, false},
		{"region without count", tagmodel.Regions{Region: 1}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.r.Check()
			if (err == nil) != tc.ok || (err != nil && !errors.Is(err, tagmodel.ErrInvalidArgument)) {
				t.Fatalf("Check(%+v) = %v, want ok %v", tc.r, err, tc.ok)
			}
			if _, err := New(Settings{Store: newMemStore(t), Regions: tc.r}); (err == nil) != tc.ok {
				t.Fatalf("New with %+v = %v, want ok %v", tc.r, err, tc.ok)
			}
		})
	}
}

// TestColdWait: the first request for a tag whose store is slow to answer
// (far away) waits ColdWait, not MaxWait, for the first segment; a warm
// tag's requests still give up after MaxWait. (With every wait bounded by
// MaxWait, the first Take fails with ErrUnavailable.)
func TestColdWait(t *testing.T) {
	st := newMemStore(t, tagmodel.Tag{Name: "far", MaxID: 1, Step: 5})
	a := newAllocator(t, Settings{Store: st, MaxStep: 5, MaxDepth: 1, MaxWait: 20 * time.Millisecond, ColdWait: time.Minute})
	wait.For(t, 10*time.Second, "the tag list", a.Ready)
	gate := make(chan struct{})
	st.set(func(s *memStore) { s.gate = gate })
	time.AfterFunc(200*time.Millisecond, func() { close(gate) }) // ten MaxWaits
	if got := take(t, a, "far", 1); !slices.Equal(got, []int64{1}) {
		t.Fatalf("first Take = %v, want [1]", got)
	}
	// Warm now: spend the segment while its next fetch hangs.
	st.set(func(s *memStore) { s.gate = make(chan struct{}) })
	t.Cleanup(func() { st.set(func(s *memStore) { close(s.gate) }) })
	var err error
	for range 10 {
		if _, err = a.Take(t.Context(), "far", 1, nil); err != nil {
			break
		}
	}
	if !errors.Is(err, ErrUnavailable) {
		t.Fatalf("a warm tag's Take with its fetch hanging = %v, want ErrUnavailable after MaxWait", err)
	}
}

// TestBufferTime: with BufferTime, fetches grow to hold that long's worth
// of IDs at the tag's rate: 10 IDs a second for 30 s is 300 IDs, 30 steps
// of 10. (Without it, the fetches stay at one step: the store answers at
// once, so no request ever waits.)
func TestBufferTime(t *testing.T) {
	var mu sync.Mutex // protects now
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	st := newMemStore(t, tagmodel.Tag{Name: "far", MaxID: 1, Step: 10})
	a := newAllocator(t, Settings{Store: st, MaxStep: 10, MaxDepth: 1000, BufferTime: 30 * time.Second, Now: clock})
	for range 400 {
		take(t, a, "far", 1)
		// Let a fetch end before the next request, so that none waits
		// (a request that waits deepens the next fetch by itself).
		wait.For(t, 10*time.Second, "the fetch", func() bool { b := a.tags.get("far"); return b != nil && !b.loading.Load() })
		mu.Lock()
		now = now.Add(100 * time.Millisecond)
		mu.Unlock()
	}
	st.mu.Lock()
	defer st.mu.Unlock()
	var largest int64
	for _, f := range st.fetches {
		largest = max(largest, f.step)
	}
	if largest < 300 {
		t.Fatalf("largest fetch %d IDs (fetches %v), want at least 300: 30 s at 10 IDs a second", largest, st.fetches)
	}
}

// TestVerifyBeforeFirstFetch: nothing is fetched until Verify passes; its
// error fails the requests meanwhile; once it passed it is not called
// again. (With fetch not calling Verify, the first Take succeeds while
// Verify fails.)
func TestVerifyBeforeFirstFetch(t *testing.T) {
	st := newMemStore(t, tagmodel.Tag{Name: "orders", MaxID: 1, Step: 10})
	var mu sync.Mutex // protects verifyErr, calls
	verifyErr, calls := error(tagmodel.ErrRegionMismatch), 0
	a := newAllocator(t, Settings{Store: st, MaxWait: 20 * time.Millisecond, ColdWait: 20 * time.Millisecond, MaxStep: 10,
		Verify: func(context.Context) error { mu.Lock(); defer mu.Unlock(); calls++; return verifyErr }})
	_, err := a.Take(t.Context(), "orders", 1, nil)
	if !errors.Is(err, tagmodel.ErrRegionMismatch) {
		t.Fatalf("Take while Verify fails = %v, want its error", err)
	}
	if n := st.fetchCount("orders"); n != 0 {
		t.Fatalf("%d fetches while Verify fails, want none", n)
	}
	mu.Lock()
	verifyErr = nil
	mu.Unlock()
	wait.For(t, 10*time.Second, "a Take once Verify passes", func() bool {
		_, err := a.Take(t.Context(), "orders", 1, nil)
		return err == nil
	})
	mu.Lock()
	before := calls
	mu.Unlock()
	take(t, a, "orders", 25) // more fetches
	mu.Lock()
	defer mu.Unlock()
	if calls != before {
		t.Fatalf("Verify called %d more times after it passed, want none", calls-before)
	}
}
