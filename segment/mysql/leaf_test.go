package mysql_test

import (
	"context"
	"database/sql"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dispenser-dev/dispenser/internal/leafsql"
	"github.com/dispenser-dev/dispenser/segment"
	"github.com/dispenser-dev/dispenser/segment/mysql"
	"github.com/dispenser-dev/dispenser/tagmodel"
)

// idSet collects IDs per tag and remembers who got each first.
type idSet struct {
	mu   sync.Mutex // protects seen and dups
	seen map[string]map[int64]string
	dups []string
}

func newIDSet() *idSet { return &idSet{seen: map[string]map[int64]string{}} }

// add records the IDs start..end-1 of tag, handed to who.
func (s *idSet) add(tag string, start, end int64, who string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	m := s.seen[tag]
	if m == nil {
		m = map[int64]string{}
		s.seen[tag] = m
	}
	for id := start; id < end; id++ {
		if first, ok := m[id]; ok {
			if len(s.dups) < 10 {
				s.dups = append(s.dups, fmt.Sprintf("%s ID %d: handed to %s and to %s", tag, id, first, who))
			}
			continue
		}
		m[id] = who
	}
}

// check fails the test on any ID handed out twice.
func (s *idSet) check(tb testing.TB) {
	tb.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, d := range s.dups {
		tb.Errorf("duplicate: %s", d)
	}
}

// count returns how many IDs of tag were handed to who (a prefix).
func (s *idSet) count(tag, prefix string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, who := range s.seen[tag] {
		if len(who) >= len(prefix) && who[:len(prefix)] == prefix {
			n++
		}
	}
	return n
}

// TestSharedWithLeaf: Leaf servers (goroutines running Leaf's own
// statements, with its own step and with custom steps, on plain
// connections) and dispenser workers (allocators over Stores of their own,
// each closed and opened again over and over, so that they give their
// unissued IDs back while Leaf fetches) take segments of the same tags of
// one leaf_alloc table at the same time. Every ID either side got is
// collected: none twice.
func TestSharedWithLeaf(t *testing.T) {
	dsn := newDB(t)
	admin := mysql.New(openDB(t, dsn))
	tags := []string{"orders", "users"}
	for _, tag := range tags {
		if err := admin.CreateTag(ctx, tagmodel.Tag{Name: tag, Step: 50, MaxID: 1}); err != nil {
			t.Fatal(err)
		}
	}
	// Leaf's connections are the driver's defaults, not OpenDB's.
	leafDB, err := sql.Open("mysql", dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { leafDB.Close() })

	const (
		leafs        = 3
		leafFetches  = 120
		workers      = 3
		rounds       = 12
		takesInRound = 40
	)
	ids := newIDSet()
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	var wg sync.WaitGroup
	errs := make(chan error, leafs+workers)
	for l := range leafs {
		wg.Go(func() {
			for i := range leafFetches {
				tag := tags[(l+i)%len(tags)]
				custom := int64(0) // Leaf's updateMaxId, or its dynamic step
				if i%3 == 1 {
					custom = int64(20 + (l*13+i)%90)
				}
				start, end, err := leafsql.Fetch(ctx, leafDB, tag, custom)
				if err != nil {
					errs <- err
					return
				}
				ids.add(tag, start, end, fmt.Sprintf("leaf%d fetch %d", l, i))
			}
		})
	}
	var given atomic.Int64
	for w := range workers {
		wg.Go(func() {
			for r := range rounds {
				store := countingStore{mysql.New(openDB(t, dsn)), &given}
				a, err := segment.New(segment.Settings{Store: store, MaxWait: 30 * time.Second, IdleTimeout: -1})
				if err != nil {
					errs <- err
					return
				}
				who := fmt.Sprintf("dispenser%d round %d", w, r)
				var runs []segment.Run
				for i := range takesInRound {
					tag := tags[(w+i)%len(tags)]
					runs, err = a.Take(ctx, tag, 1+(w*7+i)%20, runs[:0])
					if err != nil {
						errs <- fmt.Errorf("%s: Take(%s): %w", who, tag, err)
						a.Close(ctx)
						return
					}
					for _, run := range runs {
						ids.add(tag, run.First, run.Last+1, who)
					}
				}
				if err := a.Close(ctx); err != nil { // gives back the unissued rest
					errs <- fmt.Errorf("%s: Close: %w", who, err)
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	ids.check(t)
	t.Logf("%d give-backs applied", given.Load())
	for _, tag := range tags {
		l, d := ids.count(tag, "leaf"), ids.count(tag, "dispenser")
		t.Logf("%s: %d IDs to Leaf, %d to dispenser", tag, l, d)
		if l == 0 || d == 0 {
			t.Errorf("%s: %d IDs to Leaf, %d to dispenser: both should have taken some", tag, l, d)
		}
	}
}

// countingStore counts the give-backs that applied.
type countingStore struct {
	*mysql.Store
	given *atomic.Int64
}

func (s countingStore) GiveBack(ctx context.Context, tag string, end, firstUnissued int64) (bool, error) {
	ok, err := s.Store.GiveBack(ctx, tag, end, firstUnissued)
	if ok {
		s.given.Add(1)
	}
	return ok, err
}
