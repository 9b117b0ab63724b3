package segment

import (
	"context"
	"errors"
	"fmt"
	"github.com/dispenser-dev/dispenser/tagmodel"
	"log/slog"
	"math"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dispenser-dev/dispenser/internal/tests/wait"
)

// memStore is an in-memory Store for unit tests. Fetches can be gated,
// failed and counted.
type memStore struct {
	mu       sync.Mutex // protects the fields below
	tags     map[string]*tagmodel.Tag
	fetches  []fetchCall
	inFlight map[string]int
	maxIn    int // most concurrent fetches of one tag seen
	lookups  int
	fail     error         // returned by Fetch and Tag while set
	gate     chan struct{} // Fetch waits on it while set
	tagsGate chan struct{} // Tags waits on it, after listing, while set
	listed   chan struct{} // Tags sends on it before waiting on tagsGate
	onTag    func()        // called by Tag, without mu, while set
	giveBack []string      // tag:first of each give-back taken
	// onGiveBack is called by GiveBack, without mu, once it has decided,
	// while set.
	onGiveBack func(tag string)
}

type fetchCall struct {
	tag  string
	step int64
}

func newMemStore(tb testing.TB, tags ...tagmodel.Tag) *memStore {
	tb.Helper()
	s := &memStore{tags: map[string]*tagmodel.Tag{}, inFlight: map[string]int{}}
	for _, t := range tags {
		s.tags[t.Name] = &t
	}
	return s
}

func (s *memStore) Fetch(ctx context.Context, tag string, step int64) (tagmodel.Allocation, error) {
	s.mu.Lock()
	s.inFlight[tag]++
	s.maxIn = max(s.maxIn, s.inFlight[tag])
	gate, fail := s.gate, s.fail
	s.fetches = append(s.fetches, fetchCall{tag, step})
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		s.inFlight[tag]--
		s.mu.Unlock()
	}()
	if gate != nil {
		select {
		case <-gate:
		case <-ctx.Done():
			return tagmodel.Allocation{}, ctx.Err()
		}
	}
	if fail != nil {
		return tagmodel.Allocation{}, fail
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	t := s.tags[tag]
	if parent, key, ok := tagmodel.SplitPeriodName(tag); ok && t == nil {
		// A period's first fetch creates its row from its tag's start
		// and step (the Store contract).
		p := s.tags[parent]
		if p == nil {
			return tagmodel.Allocation{}, fmt.Errorf("mem: %w", tagmodel.ErrUnknownTag)
		}
		if p.Reset == tagmodel.ResetNone || len(key) != p.Reset.KeyLen() {
			return tagmodel.Allocation{}, fmt.Errorf("mem: %w: %q is no period of %q", tagmodel.ErrInvalidArgument, key, parent)
		}
		t = &tagmodel.Tag{Name: tag, MaxID: p.MaxID, Step: p.Step}
		s.tags[tag] = t
	}
	if t == nil {
		return tagmodel.Allocation{}, fmt.Errorf("mem: %w", tagmodel.ErrUnknownTag)
	}
	if t.Reset != tagmodel.ResetNone {
		return tagmodel.Allocation{}, fmt.Errorf("mem: %w: %q has a reset period: its periods are fetched, not it", tagmodel.ErrInvalidArgument, tag)
	}
	if step <= 0 {
		step = t.Step
	}
	if t.MaxID > math.MaxInt64-step {
		return tagmodel.Allocation{}, fmt.Errorf("mem: %w", tagmodel.ErrExhausted)
	}
	a := tagmodel.Allocation{Start: t.MaxID, End: t.MaxID + step, TagStep: t.Step}
	t.MaxID += step
	return a, nil
}

func (s *memStore) Tags(ctx context.Context) ([]string, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.fail != nil {
		return nil, s.fail
	}
	var names []string
	for n := range s.tags {
		if tagmodel.ValidTag(n) { // not a period's row
			names = append(names, n)
		}
	}
	slices.Sort(names)
	if gate := s.tagsGate; gate != nil {
		s.mu.Unlock()
		s.listed <- struct{}{}
		<-gate
		s.mu.Lock()
	}
	return names, nil
}

func (s *memStore) Tag(ctx context.Context, name string) (tagmodel.Tag, error) {
	s.mu.Lock()
	if f := s.onTag; f != nil {
		s.mu.Unlock()
		f()
		s.mu.Lock()
	}
	defer s.mu.Unlock()
	s.lookups++
	if s.fail != nil {
		return tagmodel.Tag{}, s.fail
	}
	t := s.tags[name]
	if t == nil {
		return tagmodel.Tag{}, fmt.Errorf("mem: %w", tagmodel.ErrUnknownTag)
	}
	return *t, nil
}

func (s *memStore) GiveBack(ctx context.Context, tag string, end, first int64) (bool, error) {
	s.mu.Lock()
	f := s.onGiveBack
	s.mu.Unlock()
	if f != nil {
		defer f(tag)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	t := s.tags[tag]
	if t == nil || t.MaxID != end {
		return false, nil
	}
	t.MaxID = first
	s.giveBack = append(s.giveBack, fmt.Sprintf("%s:%d", tag, first))
	return true, nil
}

func (s *memStore) set(f func(s *memStore)) {
	s.mu.Lock()
	defer s.mu.Unlock()
	f(s)
}

func (s *memStore) maxID(tag string) int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.tags[tag].MaxID
}

func (s *memStore) lookupCount() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.lookups
}

func (s *memStore) fetchCount(tag string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, f := range s.fetches {
		if f.tag == tag {
			n++
		}
	}
	return n
}

// newAllocator starts an Allocator on store and closes it in Cleanup.
func newAllocator(tb testing.TB, s Settings) *Allocator {
	tb.Helper()
	if s.Logger == nil {
		s.Logger = slog.New(slog.DiscardHandler)
	}
	a, err := New(s)
	if err != nil {
		tb.Fatalf("New: %v", err)
	}
	tb.Cleanup(func() { a.Close(context.Background()) })
	return a
}

// take takes n IDs of tag and returns them one by one.
func take(tb testing.TB, a *Allocator, tag string, n int) []int64 {
	tb.Helper()
	runs, err := a.Take(context.Background(), tag, n, nil)
	if err != nil {
		tb.Fatalf("Take(%q, %d): %v", tag, n, err)
	}
	return expand(runs)
}

func expand(runs []Run) []int64 {
	var ids []int64
	for _, r := range runs {
		for id := r.First; id <= r.Last; id++ {
			ids = append(ids, id)
		}
	}
	return ids
}

// ptr returns a pointer to a copy of v.
func ptr[T any](v T) *T { return &v }

func seq(from, n int64) []int64 {
	ids := make([]int64, n)
	for i := range ids {
		ids[i] = from + int64(i)
	}
	return ids
}

func TestTakeSequentialAndSwitch(t *testing.T) {
	st := newMemStore(t, tagmodel.Tag{Name: "orders", MaxID: 1, Step: 10})
	// MaxDepth 1: one step per fetch, however fast the IDs go.
	a := newAllocator(t, Settings{Store: st, MaxStep: 10, MaxDepth: 1})
	var got []int64
	for range 35 {
		got = append(got, take(t, a, "orders", 1)...)
	}
	if want := seq(1, 35); !slices.Equal(got, want) {
		t.Fatalf("got %v, want %v", got, want)
	}
	if n := st.fetchCount("orders"); n < 4 {
		t.Errorf("fetches = %d, want at least 4 for 35 IDs with step 10", n)
	}
}

func TestPrefetchAtThreshold(t *testing.T) {
	st := newMemStore(t, tagmodel.Tag{Name: "a", MaxID: 1, Step: 100})
	a := newAllocator(t, Settings{Store: st, MaxStep: 100, PrefetchRatio: 0.5})
	take(t, a, "a", 1) // first fetch
	take(t, a, "a", 49)
	// 50 of 100 used: not more than half, so no prefetch yet.
	if n := st.fetchCount("a"); n != 1 {
		t.Fatalf("fetches after 50 IDs = %d, want 1", n)
	}
	take(t, a, "a", 1) // 51 used: over the threshold
	wait.For(t, 10*time.Second, "the next segment", func() bool { return a.Stats()[0].NextReady })
	if n := st.fetchCount("a"); n != 2 {
		t.Fatalf("fetches = %d, want 2", n)
	}
	// Spending the rest switches to the prefetched segment without another fetch.
	got := take(t, a, "a", 50)
	if want := seq(52, 50); !slices.Equal(got, want) {
		t.Fatalf("got %v, want %v", got, want)
	}
	s := a.Stats()[0]
	if s.Current == nil || s.Current.Start != 101 || s.Current.Cursor != 102 {
		t.Fatalf("current = %+v, want start 101 cursor 102", s.Current)
	}
}

func TestBatchAcrossBoundary(t *testing.T) {
	st := newMemStore(t, tagmodel.Tag{Name: "a", MaxID: 1, Step: 10}, tagmodel.Tag{Name: "b", MaxID: 1, Step: 10})
	a := newAllocator(t, Settings{Store: st, MaxStep: 10, PrefetchRatio: 0.5})
	take(t, a, "a", 1) // fetches 1..10; half of it not yet used: no prefetch
	// Another worker fetches 11..20, so a's next segment is not contiguous.
	if _, err := st.Fetch(context.Background(), "a", 0); err != nil {
		t.Fatal(err)
	}
	take(t, a, "a", 6) // 7 used: prefetches 21..30
	wait.For(t, 10*time.Second, "prefetch", func() bool { return a.Stats()[0].NextReady })
	runs, err := a.Take(context.Background(), "a", 5, nil)
	if err != nil {
		t.Fatal(err)
	}
	if want := []Run{{First: 8, Last: 10}, {First: 21, Last: 22}}; !slices.Equal(runs, want) {
		t.Fatalf("runs = %v, want %v", runs, want)
	}
	// A batch larger than both segments waits for further fetches.
	got := take(t, a, "a", 45)
	if len(got) != 45 || got[0] != 23 {
		t.Fatalf("got %d IDs starting %d, want 45 starting 23", len(got), got[0])
	}
	if !slices.IsSorted(got) {
		t.Fatalf("IDs not increasing: %v", got)
	}
}

func TestSingleLoaderAndUniqueness(t *testing.T) {
	st := newMemStore(t, tagmodel.Tag{Name: "a", MaxID: 1, Step: 50}, tagmodel.Tag{Name: "b", MaxID: 1, Step: 7})
	a := newAllocator(t, Settings{Store: st, MaxStep: 200, MaxWait: 5 * time.Second})
	const workers, per = 16, 2000
	var mu sync.Mutex
	seen := map[string]map[int64]bool{"a": {}, "b": {}}
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			tag := []string{"a", "b"}[w%2]
			var mine []int64
			for i := range per {
				runs, err := a.Take(context.Background(), tag, 1+i%3, nil)
				if err != nil {
					t.Error(err)
					return
				}
				mine = append(mine, expand(runs)...)
			}
			if !slices.IsSorted(mine) {
				t.Errorf("tag %s: one goroutine's IDs are not increasing", tag)
			}
			mu.Lock()
			defer mu.Unlock()
			for _, id := range mine {
				if seen[tag][id] {
					t.Errorf("tag %s: duplicate ID %d", tag, id)
				}
				seen[tag][id] = true
			}
		}()
	}
	wg.Wait()
	st.mu.Lock()
	maxIn := st.maxIn
	st.mu.Unlock()
	if maxIn != 1 {
		t.Errorf("most concurrent fetches of one tag = %d, want 1", maxIn)
	}
	want := 0
	for i := range per {
		want += workers / 2 * (1 + i%3)
	}
	if len(seen["a"]) != want {
		t.Errorf("tag a: %d distinct IDs, want %d", len(seen["a"]), want)
	}
}

func TestWaitThenUnavailable(t *testing.T) {
	st := newMemStore(t, tagmodel.Tag{Name: "a", MaxID: 1, Step: 10})
	gate := make(chan struct{})
	st.set(func(s *memStore) { s.gate = gate })
	a := newAllocator(t, Settings{Store: st, MaxWait: 20 * time.Millisecond})
	_, err := a.Take(context.Background(), "a", 1, nil)
	if !errors.Is(err, ErrUnavailable) {
		t.Fatalf("err = %v, want ErrUnavailable", err)
	}
	// The same fetch still runs; once it completes the tag is served.
	st.set(func(s *memStore) { s.gate = nil })
	close(gate)
	if got := take(t, a, "a", 1); got[0] != 1 {
		t.Fatalf("got %v, want [1]", got)
	}
	if n := st.fetchCount("a"); n != 1 {
		t.Errorf("fetches = %d, want 1 (the parked fetch, not a second)", n)
	}
	if s := a.Stats()[0]; s.WaitTimeouts != 1 {
		t.Errorf("wait timeouts = %d, want 1", s.WaitTimeouts)
	}
}

func TestFailedFetchNeverReady(t *testing.T) {
	st := newMemStore(t, tagmodel.Tag{Name: "a", MaxID: 1, Step: 10})
	// PrefetchRatio 1: the next segment is fetched only once this one is spent.
	a := newAllocator(t, Settings{Store: st, MaxStep: 10, PrefetchRatio: 1, MaxWait: 20 * time.Millisecond, RetryMin: time.Millisecond, RetryMax: 2 * time.Millisecond})
	take(t, a, "a", 10)
	boom := errors.New("database is down")
	st.set(func(s *memStore) { s.fail = boom })
	_, err := a.Take(context.Background(), "a", 1, nil)
	if !errors.Is(err, ErrUnavailable) || !errors.Is(err, boom) {
		t.Fatalf("err = %v, want ErrUnavailable wrapping the store's error", err)
	}
	wait.For(t, 10*time.Second, "a few failed fetches", func() bool { return st.fetchCount("a") >= 4 })
	if s := a.Stats()[0]; s.NextReady || s.LastError == "" || s.Current.Cursor != s.Current.End {
		t.Fatalf("after failed fetches: next ready %v, last error %q, current %+v; want not ready, an error, spent", s.NextReady, s.LastError, s.Current)
	}
	// The store comes back: the retrying loader recovers by itself.
	st.set(func(s *memStore) { s.fail = nil })
	wait.For(t, 10*time.Second, "recovery", func() bool { return a.Stats()[0].NextReady })
	if got := take(t, a, "a", 1); got[0] != 11 {
		t.Fatalf("got %v, want [11]", got)
	}
}

// A batch that cannot be had while the store is down must not drain the
// buffer that keeps serving smaller requests.
func TestFailedBatchKeepsTheBuffer(t *testing.T) {
	st := newMemStore(t, tagmodel.Tag{Name: "a", MaxID: 1, Step: 100})
	a := newAllocator(t, Settings{Store: st, MaxStep: 100, PrefetchRatio: 1, MaxWait: 20 * time.Millisecond, RetryMin: time.Millisecond, RetryMax: 2 * time.Millisecond})
	take(t, a, "a", 10)
	st.set(func(s *memStore) { s.fail = errors.New("database is down") })
	if _, err := a.Take(context.Background(), "a", 500, nil); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("batch of 500: err = %v, want ErrUnavailable", err)
	}
	// The 90 IDs left still serve small requests, from where they were.
	if got := take(t, a, "a", 90); got[0] != 11 || got[89] != 100 {
		t.Fatalf("after the failed batch: got %d..%d, want 11..100", got[0], got[89])
	}
	if !a.Known("a") || a.Known("b") {
		t.Fatal("Known: want a known and b not")
	}
}

func TestDynamicStep(t *testing.T) {
	var mu sync.Mutex
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	advance := func(d time.Duration) { mu.Lock(); now = now.Add(d); mu.Unlock() }
	st := newMemStore(t, tagmodel.Tag{Name: "a", MaxID: 1, Step: 100})
	a := newAllocator(t, Settings{Store: st, Now: clock, MaxStep: 800, PrefetchRatio: 1})
	spend := func() {
		t.Helper()
		s := a.Stats()[0]
		take(t, a, "a", int(s.Current.End-s.Current.Cursor))
		take(t, a, "a", 1) // forces the next fetch
	}
	take(t, a, "a", 1)
	tests := []struct {
		name    string
		elapsed time.Duration
		want    int64
	}{
		{"fast doubles", time.Minute, 200},
		{"fast doubles again", time.Minute, 400},
		{"fast doubles to the cap", time.Minute, 800},
		{"cap holds", time.Minute, 800},
		{"between 15 and 30 minutes keeps", 20 * time.Minute, 800},
		{"slow halves", time.Hour, 400},
		{"slow halves", time.Hour, 200},
		{"slow halves to the tag's step", time.Hour, 100},
		{"never below the tag's step", time.Hour, 100},
	}
	for _, tt := range tests {
		advance(tt.elapsed)
		spend()
		if got := a.Stats()[0].Step; got != tt.want {
			t.Fatalf("%s: step = %d, want %d", tt.name, got, tt.want)
		}
	}
}

func TestUnknownTagNegativeCache(t *testing.T) {
	var mu sync.Mutex
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	st := newMemStore(t)
	a := newAllocator(t, Settings{Store: st, Now: clock, NegativeTTL: time.Second})
	wait.For(t, 10*time.Second, "tag list", a.Ready)
	for range 10 {
		if _, err := a.Take(context.Background(), "nope", 1, nil); !errors.Is(err, tagmodel.ErrUnknownTag) {
			t.Fatalf("err = %v, want ErrUnknownTag", err)
		}
	}
	if n := st.lookupCount(); n != 1 {
		t.Fatalf("lookups = %d, want 1 (the rest from the negative cache)", n)
	}
	// A tag created after start-up works at once...
	st.set(func(s *memStore) { s.tags["fresh"] = &tagmodel.Tag{Name: "fresh", MaxID: 1, Step: 10} })
	if got := take(t, a, "fresh", 1); got[0] != 1 {
		t.Fatalf("new tag: got %v, want [1]", got)
	}
	// ...and an unknown one is asked about again once the cache entry expired.
	st.set(func(s *memStore) { s.tags["nope"] = &tagmodel.Tag{Name: "nope", MaxID: 5, Step: 10} })
	if _, err := a.Take(context.Background(), "nope", 1, nil); !errors.Is(err, tagmodel.ErrUnknownTag) {
		t.Fatalf("within the TTL: err = %v, want ErrUnknownTag", err)
	}
	mu.Lock()
	now = now.Add(2 * time.Second)
	mu.Unlock()
	if got := take(t, a, "nope", 1); got[0] != 5 {
		t.Fatalf("after the TTL: got %v, want [5]", got)
	}
}

func TestRemovedTagStopsBeingServed(t *testing.T) {
	st := newMemStore(t, tagmodel.Tag{Name: "a", MaxID: 1, Step: 10}, tagmodel.Tag{Name: "b", MaxID: 1, Step: 10})
	a := newAllocator(t, Settings{Store: st})
	take(t, a, "a", 1)
	st.set(func(s *memStore) { delete(s.tags, "a") })
	if err := a.Refresh(context.Background()); err != nil {
		t.Fatal(err)
	}
	if _, err := a.Take(context.Background(), "a", 1, nil); !errors.Is(err, tagmodel.ErrUnknownTag) {
		t.Fatalf("err = %v, want ErrUnknownTag", err)
	}
	if got := take(t, a, "b", 1); got[0] != 1 {
		t.Fatalf("b: got %v, want [1]", got)
	}
}

func TestRefreshKeepsTagsLearnedMeanwhile(t *testing.T) {
	st := newMemStore(t, tagmodel.Tag{Name: "a", MaxID: 1, Step: 10})
	a := newAllocator(t, Settings{Store: st})
	wait.For(t, 10*time.Second, "tag list", a.Ready)
	gate, listed := make(chan struct{}), make(chan struct{})
	st.set(func(s *memStore) { s.tagsGate, s.listed = gate, listed })
	done := make(chan error, 1)
	go func() { done <- a.Refresh(context.Background()) }()
	<-listed // Refresh holds a listing without b
	// A tag created after the listing is looked up and served...
	st.set(func(s *memStore) { s.tags["b"] = &tagmodel.Tag{Name: "b", MaxID: 1, Step: 10} })
	take(t, a, "b", 1)
	close(gate)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	// ...and the stale listing does not remove it.
	if got := take(t, a, "b", 1); got[0] != 2 {
		t.Fatalf("got %v, want [2]", got)
	}
}

func TestBadInputChangesNothing(t *testing.T) {
	st := newMemStore(t, tagmodel.Tag{Name: "a", MaxID: 1, Step: 10})
	a := newAllocator(t, Settings{Store: st})
	wait.For(t, 10*time.Second, "tag list", a.Ready)
	tests := []struct {
		name string
		tag  string
		n    int
		want error
	}{
		{"zero count", "a", 0, ErrInvalidCount},
		{"negative count", "a", -3, ErrInvalidCount},
		{"empty tag", "", 1, tagmodel.ErrInvalidTag},
		{"dot in tag", "a.b", 1, tagmodel.ErrInvalidTag},
		{"wildcard", "*", 1, tagmodel.ErrInvalidTag},
		{"sql", "a';drop table leaf_alloc;--", 1, tagmodel.ErrInvalidTag},
		{"too long", string(make([]byte, 129)), 1, tagmodel.ErrInvalidTag},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if _, err := a.Take(context.Background(), tt.tag, tt.n, nil); !errors.Is(err, tt.want) {
				t.Fatalf("err = %v, want %v", err, tt.want)
			}
		})
	}
	if n, l := st.fetchCount("a"), st.lookupCount(); n != 0 || l != 0 {
		t.Fatalf("store saw %d fetches and %d lookups, want none", n, l)
	}
	if got := take(t, a, "a", 1); got[0] != 1 {
		t.Fatalf("got %v, want [1]: bad requests must consume no ID", got)
	}
}

func TestSlowTagDoesNotDelayOthers(t *testing.T) {
	st := newMemStore(t, tagmodel.Tag{Name: "slow", MaxID: 1, Step: 10}, tagmodel.Tag{Name: "fast", MaxID: 1, Step: 10})
	a := newAllocator(t, Settings{Store: st, MaxWait: time.Minute})
	take(t, a, "fast", 1)
	gate := make(chan struct{})
	st.set(func(s *memStore) { s.gate = gate })
	slowDone := make(chan error, 1)
	_, pending, err := a.TakeNow("slow", 1, nil)
	if err != nil || pending == nil {
		t.Fatalf("slow tag: pending %v, err %v; want a pending request", pending, err)
	}
	go func() {
		_, err := pending.Wait(context.Background())
		slowDone <- err
	}()
	// While slow's fetch is blocked, fast is served at once, without parking.
	runs, fastPending, err := a.TakeNow("fast", 1, nil)
	if err != nil || fastPending != nil || len(runs) != 1 || runs[0].First != 2 {
		t.Fatalf("fast tag: runs %v, pending %v, err %v; want ID 2 at once", runs, fastPending, err)
	}
	select {
	case err := <-slowDone:
		t.Fatalf("slow tag answered (%v) while its fetch is blocked", err)
	default:
	}
	close(gate)
	if err := <-slowDone; err != nil {
		t.Fatalf("slow tag after the fetch: %v", err)
	}
}

func TestCloseGivesBack(t *testing.T) {
	tests := []struct {
		name        string
		otherFetch  bool // another worker fetched after our last segment
		wantMaxID   int64
		wantGiveBak int
	}{
		{"last fetcher gives back", false, 4, 1},
		{"not last keeps max_id", true, 21, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			st := newMemStore(t, tagmodel.Tag{Name: "a", MaxID: 1, Step: 10})
			a, err := New(Settings{Store: st, PrefetchRatio: 1})
			if err != nil {
				t.Fatal(err)
			}
			take(t, a, "a", 3)
			if tt.otherFetch {
				st.Fetch(context.Background(), "a", 0)
			}
			if err := a.Close(context.Background()); err != nil {
				t.Fatal(err)
			}
			if got := st.maxID("a"); got != tt.wantMaxID {
				t.Errorf("max_id = %d, want %d", got, tt.wantMaxID)
			}
			st.mu.Lock()
			gb := st.giveBack
			st.mu.Unlock()
			if len(gb) != tt.wantGiveBak {
				t.Errorf("give-backs = %v, want %d", gb, tt.wantGiveBak)
			}
			if _, err := a.Take(context.Background(), "a", 1, nil); !errors.Is(err, ErrClosed) {
				t.Errorf("Take after Close: err = %v, want ErrClosed", err)
			}
		})
	}
}

// TestCloseUnderLoadNeverDuplicates closes allocators while takers run, five
// times over one store: no ID twice across the restarts, and every Close
// gives back exactly what was not handed out.
func TestCloseUnderLoadNeverDuplicates(t *testing.T) {
	st := newMemStore(t, tagmodel.Tag{Name: "a", MaxID: 1, Step: 20})
	var mu sync.Mutex // protects all
	all := map[int64]bool{}
	for round := range 5 {
		a, err := New(Settings{Store: st, MaxStep: 20, Logger: slog.New(slog.DiscardHandler)})
		if err != nil {
			t.Fatal(err)
		}
		var taken atomic.Int64
		var highest atomic.Int64
		errs := make(chan error, 4)
		var wg sync.WaitGroup
		for range 4 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for {
					runs, err := a.Take(context.Background(), "a", 3, nil)
					mu.Lock()
					for _, id := range expand(runs) {
						if all[id] {
							errs <- fmt.Errorf("round %d: ID %d handed out twice", round, id)
						}
						all[id] = true
						taken.Add(1)
						if id > highest.Load() {
							highest.Store(id)
						}
					}
					mu.Unlock()
					if errors.Is(err, ErrClosed) {
						return
					}
					if err != nil {
						errs <- fmt.Errorf("round %d: %w", round, err)
						return
					}
				}
			}()
		}
		// Close once the takers are well into the tag: more than two
		// segments handed out, so Close meets them mid-flight.
		wait.For(t, 10*time.Second, "IDs taken", func() bool { return taken.Load() > 50 })
		if err := a.Close(context.Background()); err != nil {
			t.Fatal(err)
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Fatal(err)
		}
		// One allocator, contiguous takes: everything above the highest
		// ID handed out went back to the store.
		if got, want := st.maxID("a"), highest.Load()+1; got != want {
			t.Fatalf("round %d: max_id after Close = %d, want %d (one past the highest ID handed out)", round, got, want)
		}
	}
	st.mu.Lock()
	gb := len(st.giveBack)
	st.mu.Unlock()
	if gb == 0 {
		t.Fatal("no Close gave anything back")
	}
}

func TestNewRejectsBadSettings(t *testing.T) {
	st := newMemStore(t)
	tests := []struct {
		name string
		s    Settings
	}{
		{"no store", Settings{}},
		{"ratio above 1", Settings{Store: st, PrefetchRatio: 1.5}},
		{"negative ratio", Settings{Store: st, PrefetchRatio: -0.1}},
		{"negative wait", Settings{Store: st, MaxWait: -time.Second}},
		{"retry max below min", Settings{Store: st, RetryMin: time.Second, RetryMax: time.Millisecond}},
		{"negative max step", Settings{Store: st, MaxStep: -1}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if a, err := New(tt.s); err == nil {
				a.Close(context.Background())
				t.Fatal("New accepted bad settings")
			}
		})
	}
}

func BenchmarkTakeOne(b *testing.B) {
	st := newMemStore(b, tagmodel.Tag{Name: "orders", MaxID: 1, Step: 1_000_000})
	a := newAllocator(b, Settings{Store: st})
	take(b, a, "orders", 1)
	ctx := context.Background()
	var runs [2]Run
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		if _, err := a.Take(ctx, "orders", 1, runs[:0]); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkTakeNow(b *testing.B) {
	st := newMemStore(b, tagmodel.Tag{Name: "orders", MaxID: 1, Step: 1_000_000})
	a := newAllocator(b, Settings{Store: st})
	take(b, a, "orders", 1)
	var runs [2]Run
	b.ReportAllocs()
	for b.Loop() {
		if _, p, err := a.TakeNow("orders", 1, runs[:0]); err != nil || p != nil {
			b.Fatal(p, err)
		}
	}
}

func BenchmarkTakeOneParallel(b *testing.B) {
	st := newMemStore(b, tagmodel.Tag{Name: "orders", MaxID: 1, Step: 1_000_000})
	a := newAllocator(b, Settings{Store: st})
	take(b, a, "orders", 1)
	ctx := context.Background()
	b.ReportAllocs()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		var runs [2]Run
		for pb.Next() {
			if _, err := a.Take(ctx, "orders", 1, runs[:0]); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// adminStore is a memStore that can create tags.
type adminStore struct{ *memStore }

func (s adminStore) CreateTag(ctx context.Context, t tagmodel.Tag) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.tags[t.Name] != nil {
		return tagmodel.ErrTagExists
	}
	s.tags[t.Name] = &t
	return nil
}

func (s adminStore) UpdateTag(ctx context.Context, name string, u tagmodel.Update) error {
	return errors.New("not used")
}

func TestAutoCreateTags(t *testing.T) {
	st := adminStore{newMemStore(t)}
	if _, err := New(Settings{Store: st.memStore, AutoCreateStep: 10}); err == nil {
		t.Fatal("New accepted AutoCreateStep with a store that cannot create tags")
	}
	a := newAllocator(t, Settings{Store: st, AutoCreateStep: 10, PrefetchRatio: 1})
	if got := take(t, a, "fresh", 3); !slices.Equal(got, []int64{1, 2, 3}) {
		t.Fatalf("got %v, want [1 2 3]", got)
	}
	if got := st.maxID("fresh"); got != 11 {
		t.Fatalf("max_id = %d, want 11 (one segment of the auto-create step)", got)
	}
	if _, err := a.Take(context.Background(), "bad.tag", 1, nil); !errors.Is(err, tagmodel.ErrInvalidTag) {
		t.Fatalf("invalid tag: err = %v, want ErrInvalidTag", err)
	}
}

// TestWarm: Warm waits for the first segment of each plain tag it can
// look up, so that the first request of each is served from memory; it
// skips unknown and ordered tags, and gives up when its context ends.
func TestWarm(t *testing.T) {
	st := newMemStore(t, tagmodel.Tag{Name: "a", Step: 10, MaxID: 1}, tagmodel.Tag{Name: "b", Step: 10, MaxID: 1},
		tagmodel.Tag{Name: "o", Step: 10, MaxID: 1, Ordered: true}, tagmodel.Tag{Name: "stuck", Step: 10, MaxID: 1})
	a := newAllocator(t, Settings{Store: st})
	gate := make(chan struct{})
	st.set(func(s *memStore) { s.gate = gate })
	done := make(chan int, 1)
	go func() { done <- a.Warm(context.Background(), []string{"a", "b", "o", "unknown", "bad tag"}) }()
	wait.For(t, 10*time.Second, "fetches of a and b to start", func() bool {
		st.mu.Lock()
		defer st.mu.Unlock()
		return st.inFlight["a"] == 1 && st.inFlight["b"] == 1
	})
	select {
	case n := <-done:
		t.Fatalf("Warm returned %d while the fetches were held, want it to wait for them", n)
	default:
	}
	close(gate)
	if got := <-done; got != 2 {
		t.Fatalf("Warm = %d tags, want 2 (a and b)", got)
	}
	for _, tag := range []string{"a", "b"} {
		if _, pending, err := a.TakeNow(tag, 1, nil); err != nil || pending != nil {
			t.Errorf("TakeNow(%s) after Warm: pending %v, err %v; want IDs from memory", tag, pending != nil, err)
		}
	}
	if a.Plain("o") || a.Known("unknown") {
		t.Errorf("ordered tag served as plain (%v) or unknown tag known (%v) after Warm", a.Plain("o"), a.Known("unknown"))
	}
	st.set(func(s *memStore) { s.gate = make(chan struct{}) }) // never opens
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	if got := a.Warm(ctx, []string{"stuck"}); got != 0 {
		t.Errorf("Warm of a tag whose fetch never ends = %d, want 0 once its context ended", got)
	}
}
