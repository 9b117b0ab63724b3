package mysql_test

import (
	"context"
	"database/sql"
	"errors"
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

// callsStore counts the calls that reach the store.
type callsStore struct {
	*mysql.Store
	calls *atomic.Int64
}

func (s callsStore) Tag(ctx context.Context, name string) (tagmodel.Tag, error) {
	s.calls.Add(1)
	return s.Store.Tag(ctx, name)
}

func (s callsStore) CreateTag(ctx context.Context, t tagmodel.Tag) error {
	s.calls.Add(1)
	return s.Store.CreateTag(ctx, t)
}

func (s callsStore) Fetch(ctx context.Context, tag string, step int64) (tagmodel.Allocation, error) {
	s.calls.Add(1)
	return s.Store.Fetch(ctx, tag, step)
}

// TestAutoCreateOtherCaseOfLeafTag: on a Leaf table whose collation
// ignores case, a request for another case of a Leaf tag, with tags
// created on first use, is an unknown tag that is remembered as unknown
// like any other: the store refuses to create it (it exists, in the
// table's eyes) and does not know it (byte for byte), so a flood of such
// requests must not reach the store each time (a lookup, a failed INSERT
// and a failed fetch per request, with no bound).
func TestAutoCreateOtherCaseOfLeafTag(t *testing.T) {
	s, db := newLegacyDB(t, "latin1")
	if err := s.CreateTag(ctx, tagmodel.Tag{Name: "orders", Step: 10, MaxID: 1}); err != nil {
		t.Fatal(err)
	}
	before := snapshot(t, db)
	var calls atomic.Int64
	a, err := segment.New(segment.Settings{Store: callsStore{s, &calls}, AutoCreateStep: 10, NegativeTTL: time.Hour, MaxWait: 10 * time.Second, IdleTimeout: -1})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close(ctx)
	for i := range 3 {
		n := calls.Load()
		if _, err := a.Take(ctx, "ORDERS", 1, nil); !errors.Is(err, tagmodel.ErrUnknownTag) {
			t.Errorf("request %d for ORDERS: %v, want %v", i+1, err, tagmodel.ErrUnknownTag)
		}
		if got := calls.Load() - n; i > 0 && got != 0 {
			t.Errorf("request %d for ORDERS: %d store calls, want 0 (remembered as unknown)", i+1, got)
		}
	}
	if after := snapshot(t, db); after != before {
		t.Errorf("requests for ORDERS changed the tables:\nbefore:\n%s\nafter:\n%s", before, after)
	}
	if runs, err := a.Take(ctx, "orders", 1, nil); err != nil || len(runs) != 1 || runs[0].First != 1 {
		t.Errorf("Take(orders) = %v, %v, want ID 1", runs, err)
	}
}
