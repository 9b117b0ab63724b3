package segment

import (
	"context"
	"errors"
	"github.com/dispenser-dev/dispenser/tagmodel"
	"log/slog"
	"math"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/dispenser-dev/dispenser/internal/tests/wait"
)

// TestExhaustedTagAtMaxInt64 spends a tag whose IDs end near 2^63-1 one ID
// at a time: every ID is one the store allocated, handed out once, and the
// spent tag then answers ErrExhausted at once, without asking the store
// again, while other tags go on.
func TestExhaustedTagAtMaxInt64(t *testing.T) {
	const start = math.MaxInt64 - 250
	st := newMemStore(t, tagmodel.Tag{Name: "edge", MaxID: start, Step: 100}, tagmodel.Tag{Name: "other", MaxID: 1, Step: 100})
	a := newAllocator(t, Settings{Store: st})
	seen := map[int64]bool{}
	var err error
	for i := 0; i < 1000; i++ {
		var runs []Run
		runs, err = a.Take(context.Background(), "edge", 1, nil)
		if err != nil {
			break
		}
		for _, id := range expand(runs) {
			if id < start || id >= math.MaxInt64-50 {
				t.Fatalf("ID %d outside what the store allocated [%d, %d)", id, int64(start), int64(math.MaxInt64-50))
			}
			if seen[id] {
				t.Fatalf("ID %d handed out twice", id)
			}
			seen[id] = true
		}
	}
	if !errors.Is(err, tagmodel.ErrExhausted) {
		t.Fatalf("after %d IDs: err = %v, want ErrExhausted", len(seen), err)
	}
	// Two segments of the tag's own step fit below 2^63-1; the dynamic
	// step (200) does not, and must not cost the last segment.
	if got, want := len(seen), 200; got != want {
		t.Errorf("IDs handed out = %d, want %d", got, want)
	}
	fetches := st.fetchCount("edge")
	for range 100 {
		if _, err := a.Take(context.Background(), "edge", 1, nil); !errors.Is(err, tagmodel.ErrExhausted) {
			t.Fatalf("again: err = %v, want ErrExhausted", err)
		}
		if _, err := a.Take(context.Background(), "edge", 7, nil); !errors.Is(err, tagmodel.ErrExhausted) {
			t.Fatalf("batch: err = %v, want ErrExhausted", err)
		}
	}
	if got := st.fetchCount("edge"); got != fetches {
		t.Errorf("fetches after exhaustion = %d, want %d (no store call per request)", got, fetches)
	}
	b := a.tags.get("edge")
	for _, seg := range []*segment{b.cur.Load(), b.next.Load()} {
		if seg != nil && seg.cursor.Load() != seg.end {
			t.Errorf("spent segment's cursor = %d, want its end %d", seg.cursor.Load(), seg.end)
		}
	}
	if got := take(t, a, "other", 3); got[0] != 1 {
		t.Errorf("other tag: %v, want 1..3", got)
	}
}

// TestBatchesNearMaxInt64 takes batches that straddle segments ending at
// 2^63-1: runs end exactly where the store's allocations end.
func TestBatchesNearMaxInt64(t *testing.T) {
	const start = math.MaxInt64 - 300
	st := newMemStore(t, tagmodel.Tag{Name: "edge", MaxID: start, Step: 100})
	a := newAllocator(t, Settings{Store: st, MaxStep: 100})
	var got []int64
	var err error
	for {
		var runs []Run
		runs, err = a.Take(context.Background(), "edge", 70, nil)
		if err != nil {
			break
		}
		for _, r := range runs {
			if r.First > r.Last || r.Last >= math.MaxInt64 {
				t.Fatalf("bad run %+v", r)
			}
		}
		got = append(got, expand(runs)...)
	}
	if !errors.Is(err, tagmodel.ErrExhausted) {
		t.Fatalf("err = %v, want ErrExhausted", err)
	}
	for i, id := range got {
		if want := int64(start) + int64(i); id != want {
			t.Fatalf("ID %d = %d, want %d", i, id, want)
		}
	}
	// 300 IDs below 2^63-1 in three segments: four batches of 70 fit, the
	// fifth does not and is refused whole.
	if len(got) != 280 {
		t.Errorf("got %d IDs, want 280", len(got))
	}
}

// TestCloseFreezesHighIDs: freezing a tag's segments on Close must not be
// able to produce an ID, also for IDs above 2^62 (Close once stored
// MaxInt64/2 in the cursor, which is an ID below such a segment).
func TestCloseFreezesHighIDs(t *testing.T) {
	const start = 1<<62 + 5
	st := newMemStore(t, tagmodel.Tag{Name: "high", MaxID: start, Step: 1000})
	a, err := New(Settings{Store: st, Logger: discard})
	if err != nil {
		t.Fatal(err)
	}
	seen := map[int64]bool{}
	var mu sync.Mutex
	record := func(runs []Run) error {
		mu.Lock()
		defer mu.Unlock()
		for _, id := range expand(runs) {
			if id < start || seen[id] {
				return errors.New("bad or duplicate ID")
			}
			seen[id] = true
		}
		return nil
	}
	for range 10 {
		if err := record(mustTake(t, a, "high", 1)); err != nil {
			t.Fatal(err)
		}
	}
	var wg sync.WaitGroup
	errs := make(chan error, 4)
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				runs, err := a.Take(context.Background(), "high", 1, nil)
				if errors.Is(err, ErrClosed) {
					return
				}
				if err == nil {
					err = record(runs)
				}
				if err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	if err := a.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Errorf("take racing with Close: %v", err)
	}
	for range 10 {
		if runs, err := a.Take(context.Background(), "high", 1, nil); !errors.Is(err, ErrClosed) {
			t.Fatalf("Take after Close = %v, %v; want ErrClosed", runs, err)
		}
	}
	// Everything handed out lies below what was given back.
	maxID := st.maxID("high")
	for id := range seen {
		if id >= maxID {
			t.Fatalf("ID %d handed out, but max_id after give-back is %d", id, maxID)
		}
	}
}

func mustTake(tb testing.TB, a *Allocator, tag string, n int) []Run {
	tb.Helper()
	runs, err := a.Take(context.Background(), tag, n, nil)
	if err != nil {
		tb.Fatalf("Take(%q, %d): %v", tag, n, err)
	}
	return runs
}

// TestOneDeadlineForLookupAndWait: a tag that takes the whole MaxWait to
// look up must not then wait another MaxWait for its first segment.
func TestOneDeadlineForLookupAndWait(t *testing.T) {
	const maxWait = time.Hour // only the clock below makes it pass
	tests := []struct {
		name string
		take func(a *Allocator) error
	}{
		{"Take", func(a *Allocator) error {
			_, err := a.Take(context.Background(), "slow", 1, nil)
			return err
		}},
		{"TakeNow then Wait", func(a *Allocator) error {
			_, p, err := a.TakeNow("slow", 1, nil)
			if err != nil || p == nil {
				return errors.New("TakeNow did not return a Pending")
			}
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			_, err = p.Wait(ctx)
			return err
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var mu sync.Mutex
			now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
			clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
			st := newMemStore(t)
			st.gate = make(chan struct{}) // the first fetch never ends
			t.Cleanup(func() { close(st.gate) })
			a := newAllocator(t, Settings{Store: st, MaxWait: maxWait, RefreshInterval: time.Hour, Now: clock})
			wait.For(t, 10*time.Second, "the tag list", a.Ready)
			// A tag created after the list loaded is looked up, and the
			// lookup uses up the whole wait (by the allocator's clock).
			st.set(func(s *memStore) {
				s.tags["slow"] = &tagmodel.Tag{Name: "slow", MaxID: 1, Step: 10}
				s.onTag = func() { mu.Lock(); now = now.Add(maxWait + time.Millisecond); mu.Unlock() }
			})
			done := make(chan error, 1)
			go func() { done <- tt.take(a) }()
			select {
			case err := <-done:
				if !errors.Is(err, ErrUnavailable) {
					t.Fatalf("err = %v, want ErrUnavailable", err)
				}
			case <-time.After(10 * time.Second):
				t.Fatal("still waiting after the deadline of lookup plus wait had passed")
			}
		})
	}
}

var discard = slog.New(slog.DiscardHandler)

// TestRemovedTagMidBatch: a tag removed from the store while a batch is
// being served answers ErrUnknownTag (404). A batch that had to wait takes
// nothing; one that had taken part of its IDs skips them, and they are never
// handed out, also not after the tag is created again.
func TestRemovedTagMidBatch(t *testing.T) {
	tests := []struct {
		name      string
		nextReady bool // the next segment is in memory when the batch comes
		wantTaken int64
	}{
		{"batch waits for a segment: takes nothing", false, 0},
		{"batch took part of the buffers: skips it", true, 8},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			st := newMemStore(t, tagmodel.Tag{Name: "a", MaxID: 1, Step: 10})
			ratio := 1.0
			if tt.nextReady {
				ratio = 0.05
			}
			a := newAllocator(t, Settings{Store: st, MaxStep: 10, PrefetchRatio: ratio})
			take(t, a, "a", 2) // past the threshold with ratio 0.05
			if tt.nextReady {
				wait.For(t, 10*time.Second, "the next segment", func() bool { return a.Stats()[0].NextReady })
			}
			st.set(func(s *memStore) { delete(s.tags, "a") })
			runs, err := a.Take(context.Background(), "a", 25, nil)
			if !errors.Is(err, tagmodel.ErrUnknownTag) {
				t.Fatalf("err = %v, want ErrUnknownTag", err)
			}
			var taken int64
			for _, r := range runs {
				taken += r.Len()
			}
			if taken != tt.wantTaken {
				t.Errorf("IDs taken by the failed batch = %d, want %d", taken, tt.wantTaken)
			}
			// The tag comes back where the store left it.
			maxID := 1 + 10*int64(st.fetchCount("a")-1) // the failed fetch allocated nothing
			st.set(func(s *memStore) { s.tags["a"] = &tagmodel.Tag{Name: "a", MaxID: maxID, Step: 10} })
			wait.For(t, 10*time.Second, "the tag to be dropped", func() bool { return !a.Known("a") })
			got := take(t, a, "a", 5)
			last := runs
			for _, id := range got {
				for _, r := range last {
					if id >= r.First && id <= r.Last {
						t.Fatalf("ID %d handed out again after the failed batch took it", id)
					}
				}
				if id < maxID {
					t.Fatalf("ID %d below the store's max_id %d", id, maxID)
				}
			}
		})
	}
}

// badAllocStore is a Store whose every fetch returns alloc: a store that
// breaks its contract.
type badAllocStore struct {
	*memStore
	alloc tagmodel.Allocation
}

func (s badAllocStore) Fetch(ctx context.Context, tag string, step int64) (tagmodel.Allocation, error) {
	return s.alloc, nil
}

// TestBadAllocationNeverServed: a segment a store returns that starts
// below 1 or holds no ID is refused, never handed out: the request fails
// with ErrUnavailable naming the bad allocation.
func TestBadAllocationNeverServed(t *testing.T) {
	for _, tc := range []struct {
		name  string
		alloc tagmodel.Allocation
	}{
		{"starts at zero", tagmodel.Allocation{Start: 0, End: 10, TagStep: 10}},
		{"starts below zero", tagmodel.Allocation{Start: -20, End: -10, TagStep: 10}},
		{"ends at its start", tagmodel.Allocation{Start: 5, End: 5, TagStep: 10}},
		{"ends below its start", tagmodel.Allocation{Start: 50, End: 40, TagStep: 10}},
		{"no tag step", tagmodel.Allocation{Start: 1, End: 11, TagStep: 0}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			st := badAllocStore{newMemStore(t, tagmodel.Tag{Name: "a", MaxID: 1, Step: 10}), tc.alloc}
			a := newAllocator(t, Settings{Store: st, MaxWait: 50 * time.Millisecond, ColdWait: 50 * time.Millisecond, RetryMin: time.Millisecond, RetryMax: 2 * time.Millisecond})
			runs, err := a.Take(t.Context(), "a", 1, nil)
			if !errors.Is(err, ErrUnavailable) || !strings.Contains(err.Error(), "bad allocation") {
				t.Fatalf("Take = %v, %v; want ErrUnavailable for a bad allocation", runs, err)
			}
			if len(runs) != 0 {
				t.Fatalf("Take handed out %v from a bad allocation", runs)
			}
		})
	}
}
