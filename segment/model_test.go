package segment

import (
	"context"
	"errors"
	"fmt"
	"github.com/dispenser-dev/dispenser/tagmodel"
	"math"
	"math/rand/v2"
	"os"
	"strconv"
	"sync"
	"testing"
	"time"
)

// The model-based test drives several Allocators sharing one store with
// random schedules of takes (single, batch, Take or TakeNow), fetch failures
// and delays, step changes, tag removal and re-creation, exhaustion near
// 2^63-1, refreshes, and Close with give-back followed by a restart, and
// checks after every step what the package promises:
//   - no ID is handed out twice, across all allocators and restarts;
//   - every ID lies in a segment the store allocated for its tag;
//   - one allocator's IDs of a tag increase from request to request;
//   - ErrExhausted only when the store really cannot fetch the tag's step;
//   - no request waits beyond MaxWait (it fails by itself, never by the
//     caller's context, which allows MaxWait plus a wide margin).
//
// DISPENSER_PROPERTY_SEED=N replays schedule N; DISPENSER_PROPERTY_LONG=1
// runs many more and longer schedules.
const (
	envModelSeed = "DISPENSER_PROPERTY_SEED"
	envModelLong = "DISPENSER_PROPERTY_LONG"
)

// modelStore is a Store and Admin over a map that records every allocation,
// fails and delays fetches on demand, and reports exhaustion exactly.
type modelStore struct {
	mu     sync.Mutex // protects the fields below
	tags   map[string]*tagmodel.Tag
	allocs map[string][][2]int64 // per tag, every [start, end) ever allocated
	fails  int                   // the next fails fetches fail
	delay  time.Duration         // each fetch sleeps this long
	// exhausted holds the tags for which a fetch failed with ErrExhausted.
	exhausted map[string]bool
}

var errModelDown = errors.New("model: store down")

func (s *modelStore) Fetch(ctx context.Context, tag string, step int64) (tagmodel.Allocation, error) {
	s.mu.Lock()
	delay := s.delay
	fail := s.fails > 0
	if fail {
		s.fails--
	}
	s.mu.Unlock()
	if delay > 0 {
		select {
		case <-time.After(delay):
		case <-ctx.Done():
			return tagmodel.Allocation{}, ctx.Err()
		}
	}
	if fail {
		return tagmodel.Allocation{}, errModelDown
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	t := s.tags[tag]
	if t == nil {
		return tagmodel.Allocation{}, fmt.Errorf("model: %w", tagmodel.ErrUnknownTag)
	}
	if step <= 0 {
		step = t.Step
	}
	if t.MaxID > math.MaxInt64-step {
		s.exhausted[tag] = true
		return tagmodel.Allocation{}, fmt.Errorf("model: %w", tagmodel.ErrExhausted)
	}
	a := tagmodel.Allocation{Start: t.MaxID, End: t.MaxID + step, TagStep: t.Step}
	t.MaxID = a.End
	s.allocs[tag] = append(s.allocs[tag], [2]int64{a.Start, a.End})
	return a, nil
}

func (s *modelStore) Tags(ctx context.Context) ([]string, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	names := make([]string, 0, len(s.tags))
	for n := range s.tags {
		names = append(names, n)
	}
	return names, nil
}

func (s *modelStore) Tag(ctx context.Context, name string) (tagmodel.Tag, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	t := s.tags[name]
	if t == nil {
		return tagmodel.Tag{}, fmt.Errorf("model: %w", tagmodel.ErrUnknownTag)
	}
	return *t, nil
}

func (s *modelStore) GiveBack(ctx context.Context, tag string, end, first int64) (bool, error) {
	if err := tagmodel.CheckGiveBack(end, first); err != nil {
		return false, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	t := s.tags[tag]
	if t == nil || t.MaxID != end {
		return false, nil
	}
	t.MaxID = first
	return true, nil
}

// allocated reports whether id lies in a segment allocated for tag.
func (s *modelStore) allocated(tag string, id int64) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, a := range s.allocs[tag] {
		if a[0] <= id && id < a[1] {
			return true
		}
	}
	return false
}

// spent reports whether a fetch of tag failed with ErrExhausted.
func (s *modelStore) spent(tag string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.exhausted[tag]
}

// modelRun is one schedule.
type modelRun struct {
	tb      testing.TB
	rng     *rand.Rand
	st      *modelStore
	maxWait time.Duration
	allocs  []*Allocator
	// last[i][tag] is the highest ID allocator i handed out for tag.
	last    []map[string]int64
	seen    map[string]map[int64]bool // per tag, every ID handed out
	names   []string
	removed map[string]tagmodel.Tag // tags removed from the store, as they were
	issued  int
}

func TestModel(t *testing.T) {
	seeds, steps := 8, 300
	if os.Getenv(envModelLong) != "" {
		seeds, steps = 300, 3000
	}
	first := uint64(time.Now().UnixNano())
	if v := os.Getenv(envModelSeed); v != "" {
		n, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			t.Fatalf("%s=%q: %v", envModelSeed, v, err)
		}
		first, seeds = n, 1
	}
	for i := range seeds {
		seed := first + uint64(i)
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			t.Logf("replay with %s=%d", envModelSeed, seed)
			runModel(t, seed, steps)
		})
	}
}

func runModel(tb testing.TB, seed uint64, steps int) {
	rng := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	st := &modelStore{tags: map[string]*tagmodel.Tag{}, allocs: map[string][][2]int64{}, exhausted: map[string]bool{}}
	m := &modelRun{tb: tb, rng: rng, st: st, maxWait: 20 * time.Millisecond, seen: map[string]map[int64]bool{}, removed: map[string]tagmodel.Tag{}}
	for i := range 3 {
		name := fmt.Sprintf("t%d", i)
		step := int64(1 + rng.IntN(20))
		start := int64(1 + rng.IntN(5))
		if i > 0 && rng.IntN(2) == 0 { // near 2^63-1
			start = math.MaxInt64 - step*int64(rng.IntN(6)) - int64(rng.IntN(int(step)))
		}
		st.tags[name] = &tagmodel.Tag{Name: name, MaxID: start, Step: step}
		m.names = append(m.names, name)
	}
	for range 1 + rng.IntN(3) {
		m.start()
	}
	defer func() {
		for _, a := range m.allocs {
			a.Close(context.Background())
		}
	}()
	for range steps {
		m.step()
		if tb.Failed() {
			return
		}
	}
	if m.issued == 0 {
		tb.Fatalf("the schedule handed out no ID")
	}
}

// start adds an allocator.
func (m *modelRun) start() {
	a, err := New(Settings{
		Store: m.st, MaxWait: m.maxWait, MaxStep: 64, PrefetchRatio: 0.1 + 0.9*m.rng.Float64(),
		RetryMin: time.Millisecond, RetryMax: 5 * time.Millisecond, NegativeTTL: time.Millisecond,
		RefreshInterval: time.Hour, Logger: discard,
	})
	if err != nil {
		m.tb.Fatal(err)
	}
	m.allocs = append(m.allocs, a)
	m.last = append(m.last, map[string]int64{})
}

func (m *modelRun) step() {
	r := m.rng
	tag := m.names[r.IntN(len(m.names))]
	switch p := r.IntN(100); {
	case p < 60:
		n := 1
		if r.IntN(3) == 0 {
			n = 1 + r.IntN(50)
		}
		m.take(r.IntN(len(m.allocs)), tag, n, r.IntN(2) == 0)
	case p < 68:
		m.burst(tag)
	case p < 74:
		m.st.mu.Lock()
		m.st.fails = r.IntN(4)
		m.st.mu.Unlock()
	case p < 78:
		m.st.mu.Lock()
		m.st.delay = time.Duration(r.IntN(3)) * time.Duration(r.IntN(int(m.maxWait))) // sometimes beyond MaxWait
		m.st.mu.Unlock()
	case p < 83:
		m.st.mu.Lock()
		if t := m.st.tags[tag]; t != nil {
			t.Step = int64(1 + r.IntN(20))
		}
		m.st.mu.Unlock()
	case p < 86:
		// Remove the tag, or bring it back where the store left it.
		m.st.mu.Lock()
		if t := m.st.tags[tag]; t != nil {
			m.removed[tag] = *t
			delete(m.st.tags, tag)
		} else if t, ok := m.removed[tag]; ok {
			m.st.tags[tag] = &t
		}
		m.st.mu.Unlock()
	case p < 90:
		a := m.allocs[r.IntN(len(m.allocs))]
		if err := a.Refresh(context.Background()); err != nil {
			m.tb.Fatalf("Refresh: %v", err)
		}
	default:
		// Close one allocator (giving back) and start another.
		i := r.IntN(len(m.allocs))
		if err := m.allocs[i].Close(context.Background()); err != nil {
			m.tb.Fatalf("Close: %v", err)
		}
		if _, err := m.allocs[i].Take(context.Background(), tag, 1, nil); !errors.Is(err, ErrClosed) {
			m.tb.Fatalf("Take after Close: %v, want ErrClosed", err)
		}
		m.allocs = append(m.allocs[:i], m.allocs[i+1:]...)
		m.last = append(m.last[:i], m.last[i+1:]...)
		m.start()
	}
}

// take takes n IDs of tag from allocator i and checks them.
func (m *modelRun) take(i int, tag string, n int, now bool) {
	runs, err := m.request(m.allocs[i], tag, n, now)
	m.checkIDs(i, tag, n, runs, err)
}

// request runs one request with a context that allows MaxWait plus a wide
// margin: the allocator must give up by itself first.
func (m *modelRun) request(a *Allocator, tag string, n int, now bool) ([]Run, error) {
	ctx, cancel := context.WithTimeout(context.Background(), m.maxWait+5*time.Second)
	defer cancel()
	if !now {
		return a.Take(ctx, tag, n, nil)
	}
	runs, p, err := a.TakeNow(tag, n, nil)
	if err != nil || p == nil {
		return runs, err
	}
	return p.Wait(ctx)
}

// burst runs concurrent single-ID takes of tag on every allocator.
func (m *modelRun) burst(tag string) {
	type result struct {
		i    int
		runs [][]Run
		errs []error
	}
	results := make(chan result, len(m.allocs)*2)
	var wg sync.WaitGroup
	for i, a := range m.allocs {
		for range 2 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				var res result
				res.i = i
				for range 20 {
					runs, err := m.request(a, tag, 1, true)
					res.runs = append(res.runs, runs)
					res.errs = append(res.errs, err)
				}
				results <- res
			}()
		}
	}
	wg.Wait()
	close(results)
	for res := range results {
		for k, runs := range res.runs {
			// Concurrent requests of one allocator interleave: check
			// uniqueness and provenance, not order.
			m.checkIDs(-1, tag, 1, runs, res.errs[k])
		}
	}
}

// checkIDs checks one request's outcome; i >= 0 also checks that allocator
// i's IDs of tag increase.
func (m *modelRun) checkIDs(i int, tag string, n int, runs []Run, err error) {
	tb := m.tb
	tb.Helper()
	switch {
	case err == nil:
	case errors.Is(err, ErrUnavailable), errors.Is(err, tagmodel.ErrUnknownTag):
	case errors.Is(err, tagmodel.ErrExhausted):
		if !m.st.spent(tag) {
			tb.Fatalf("tag %s: ErrExhausted, but the store can still fetch its step", tag)
		}
	case errors.Is(err, context.DeadlineExceeded):
		tb.Fatalf("tag %s: waited past MaxWait %v plus the margin: %v", tag, m.maxWait, err)
	default:
		tb.Fatalf("tag %s: unexpected error %v", tag, err)
	}
	var got int
	for _, r := range runs {
		if r.First > r.Last || r.First < 1 {
			tb.Fatalf("tag %s: bad run %+v", tag, r)
		}
		for id := r.First; ; id++ {
			if m.seen[tag][id] {
				tb.Fatalf("tag %s: ID %d handed out twice", tag, id)
			}
			if m.seen[tag] == nil {
				m.seen[tag] = map[int64]bool{}
			}
			m.seen[tag][id] = true
			if !m.st.allocated(tag, id) {
				tb.Fatalf("tag %s: ID %d lies in no segment the store allocated", tag, id)
			}
			if i >= 0 {
				if last, ok := m.last[i][tag]; ok && id <= last {
					tb.Fatalf("tag %s: allocator %d handed out %d after %d", tag, i, id, last)
				}
				m.last[i][tag] = id
			}
			got++
			if id == r.Last {
				break
			}
		}
	}
	if err == nil && got != n {
		tb.Fatalf("tag %s: asked for %d IDs, got %d", tag, n, got)
	}
	if got > n {
		tb.Fatalf("tag %s: asked for %d IDs, got %d with error %v", tag, n, got, err)
	}
	m.issued += got
}
