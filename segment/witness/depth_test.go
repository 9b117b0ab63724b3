package witness_test

import (
	"context"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dispenser-dev/dispenser/segment"
	"github.com/dispenser-dev/dispenser/segment/witness"
	"github.com/dispenser-dev/dispenser/tagmodel"
)

// sizes records the most IDs one Fetch asked of the store it wraps.
type sizes struct {
	tagmodel.Store
	most atomic.Int64
}

func (s *sizes) Fetch(ctx context.Context, tag string, step int64) (tagmodel.Allocation, error) {
	for m := s.most.Load(); step > m && !s.most.CompareAndSwap(m, step); m = s.most.Load() {
	}
	return s.Store.Fetch(ctx, tag, step)
}

// burst takes n IDs of tag "t" from a, one per request, with 32 requests at
// a time, and returns them.
func burst(tb testing.TB, a *segment.Allocator, n int) []int64 {
	tb.Helper()
	var mu sync.Mutex
	var ids []int64
	var left atomic.Int64
	left.Store(int64(n))
	var wg sync.WaitGroup
	for range 32 {
		wg.Go(func() {
			for left.Add(-1) >= 0 {
				runs, err := a.Take(context.Background(), "t", 1, nil)
				if err != nil {
					tb.Errorf("Take: %v", err)
					return
				}
				mu.Lock()
				ids = append(ids, runs[0].First)
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	return ids
}

// TestDeepFetchesStayExact: a tag pinned at step 10 under a burst fetches
// several steps at once through the witness (PostgreSQL and NATS, real);
// every ID is handed out once across two workers, no deep fetch is taken
// for a rollback, and a worker's give-back on Close returns exactly the
// IDs it did not hand out: the next fetch, through a new witness, starts
// right after the highest ID handed out. (Without the depth the first
// assertion fails: every fetch asks for 10; without the give-back the
// last one does.)
func TestDeepFetchesStayExact(t *testing.T) {
	const step, maxDepth = 10, 64
	e := newEnv(t)
	open := func() (*segment.Allocator, *witness.Store, *sizes) {
		w := e.open(t, witness.Settings{})
		s := &sizes{Store: w}
		a, err := segment.New(segment.Settings{Store: s, MaxStep: step, MaxDepth: maxDepth, MaxWait: time.Minute, Logger: quiet})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { a.Close(context.Background()) })
		return a, w, s
	}

	t.Run("two workers", func(t *testing.T) {
		a, wa, sa := open()
		b, wb, sb := open()
		var ids []int64
		var mu sync.Mutex
		var wg sync.WaitGroup
		for _, al := range []*segment.Allocator{a, b} {
			wg.Go(func() {
				got := burst(t, al, 5000)
				mu.Lock()
				ids = append(ids, got...)
				mu.Unlock()
			})
		}
		wg.Wait()
		slices.Sort(ids)
		if n := len(slices.Compact(slices.Clone(ids))); n != len(ids) || n != 10000 {
			t.Fatalf("%d IDs, %d distinct, want 10000 distinct", len(ids), n)
		}
		most := max(sa.most.Load(), sb.most.Load())
		if most <= step || most > step*maxDepth {
			t.Errorf("largest fetch %d IDs, want more than the step %d and at most %d", most, step, step*maxDepth)
		}
		if n := wa.Rollbacks() + wb.Rollbacks(); n != 0 {
			t.Errorf("%d rollbacks counted, want none", n)
		}
		a.Close(context.Background())
		b.Close(context.Background())
	})

	t.Run("give-back", func(t *testing.T) {
		a, w, s := open()
		ids := burst(t, a, 5000)
		if most := s.most.Load(); most <= step {
			t.Errorf("largest fetch %d IDs, want more than the step %d", most, step)
		}
		t.Logf("stats before Close: %+v cur %+v next %+v", a.Stats()[0], a.Stats()[0].Current, a.Stats()[0].Next)
		if err := a.Close(context.Background()); err != nil {
			t.Fatalf("Close: %v", err)
		}
		hi := slices.Max(ids)
		after := e.open(t, witness.Settings{})
		next := fetch(t, after, "t")
		if next.Start != hi+1 {
			t.Errorf("after the give-back the next segment is %+v, want it to start at %d (the highest ID handed out + 1)", next, hi+1)
		}
		if n := w.Rollbacks() + after.Rollbacks(); n != 0 {
			t.Errorf("%d rollbacks counted, want none", n)
		}
	})
}
