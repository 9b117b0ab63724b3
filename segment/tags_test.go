package segment

import (
	"context"
	"errors"
	"fmt"
	"github.com/dispenser-dev/dispenser/tagmodel"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/dispenser-dev/dispenser/internal/tests/wait"
)

// TestTagMapAgainstAMap drives a tagMap and a plain map with the same random
// adds and drops across several rebuilds.
func TestTagMapAgainstAMap(t *testing.T) {
	m := newTagMap()
	want := map[string]*buffer{}
	rng := rand.New(rand.NewPCG(1, 2))
	for i := range 20000 {
		tag := fmt.Sprint("t", rng.IntN(3000))
		if rng.IntN(3) == 0 {
			if b := want[tag]; b != nil {
				if !m.drop(tag, b) {
					t.Fatalf("step %d: drop(%s) of its buffer = false", i, tag)
				}
				delete(want, tag)
			}
			if m.drop(tag, &buffer{}) {
				t.Fatalf("step %d: drop(%s) of another buffer = true", i, tag)
			}
		} else {
			b, added := m.add(tag, func() *buffer { return &buffer{tag: tag} })
			if added != (want[tag] == nil) {
				t.Fatalf("step %d: add(%s) added = %v with the tag present %v", i, tag, added, want[tag] != nil)
			}
			if !added && b != want[tag] {
				t.Fatalf("step %d: add(%s) returned another buffer", i, tag)
			}
			want[tag] = b
		}
		if i%1000 == 0 || i == 19999 {
			for tag, b := range want {
				if got := m.get(tag); got != b {
					t.Fatalf("step %d: get(%s) = %p, want %p", i, tag, got, b)
				}
			}
			if got := m.len(); got != len(want) {
				t.Fatalf("step %d: len = %d, want %d", i, got, len(want))
			}
			if got := len(m.all()); got != len(want) {
				t.Fatalf("step %d: all has %d, want %d", i, got, len(want))
			}
		}
	}
}

// TestTagMapTagsInUseInTheSnapshot: with few tags (far fewer than the
// changes that rebuild the snapshot), tags that are looked up still end
// up in the read snapshot, where a lookup takes no lock, and stay found;
// one dropped and added again too.
func TestTagMapTagsInUseInTheSnapshot(t *testing.T) {
	m := newTagMap()
	bufs := map[string]*buffer{}
	for _, tag := range []string{"a", "b", "c"} {
		bufs[tag], _ = m.add(tag, func() *buffer { return &buffer{tag: tag} })
	}
	lookups := func() {
		t.Helper()
		for range 10 {
			for tag, b := range bufs {
				if got := m.get(tag); got != b {
					t.Fatalf("get(%s) = %p, want %p", tag, got, b)
				}
			}
		}
	}
	inSnapshot := func() {
		t.Helper()
		read := *m.read.Load()
		for tag, b := range bufs {
			if read[tag] != b {
				t.Errorf("%s: %p in the snapshot after 10 lookups, want %p (its buffer)", tag, read[tag], b)
			}
		}
	}
	lookups()
	inSnapshot()
	if !m.drop("b", bufs["b"]) {
		t.Fatal("drop(b) = false")
	}
	bufs["b"], _ = m.add("b", func() *buffer { return &buffer{tag: "b"} })
	lookups()
	inSnapshot()
	if n := m.len(); n != 3 {
		t.Errorf("len = %d, want 3", n)
	}
}

// changeStore is a memStore that also lists what changed (ChangeLister),
// and counts full listings.
type changeStore struct {
	*memStore
	cmu     sync.Mutex // protects the fields below
	log     []tagmodel.Change
	listing int // calls of Tags
}

func (s *changeStore) Changes(ctx context.Context, cursor int64) ([]tagmodel.Change, int64, error) {
	s.cmu.Lock()
	defer s.cmu.Unlock()
	if cursor == 0 {
		return nil, int64(len(s.log)) + 1, nil
	}
	return append([]tagmodel.Change(nil), s.log[cursor-1:]...), int64(len(s.log)) + 1, nil
}

func (s *changeStore) Tags(ctx context.Context) ([]string, error) {
	s.cmu.Lock()
	s.listing++
	s.cmu.Unlock()
	return s.memStore.Tags(ctx)
}

// change records t as changed (created or updated) in the store.
func (s *changeStore) change(t tagmodel.Tag) {
	s.memStore.set(func(m *memStore) {
		if cur := m.tags[t.Name]; cur != nil {
			cur.Step = t.Step
		} else {
			m.tags[t.Name] = &t
		}
	})
	s.cmu.Lock()
	s.log = append(s.log, tagmodel.Change{Tag: t})
	s.cmu.Unlock()
}

func TestIncrementalRefresh(t *testing.T) {
	ctx := context.Background()
	st := &changeStore{memStore: newMemStore(t, tagmodel.Tag{Name: "a", MaxID: 1, Step: 10})}
	a := newAllocator(t, Settings{Store: st, NegativeTTL: time.Hour, RefreshInterval: time.Hour})
	wait.For(t, 10*time.Second, "the first refresh", a.Ready)
	if got := take(t, a, "a", 1); got[0] != 1 {
		t.Fatalf("a: %v, want 1", got)
	}
	// Unknown now, and remembered as unknown for an hour...
	if _, err := a.Take(ctx, "new", 1, nil); !errors.Is(err, tagmodel.ErrUnknownTag) {
		t.Fatalf("new before creation: %v, want ErrUnknownTag", err)
	}
	// ...unless a refresh sees it created.
	st.change(tagmodel.Tag{Name: "new", MaxID: 1, Step: 10})
	if err := a.Refresh(ctx); err != nil {
		t.Fatal(err)
	}
	if got := take(t, a, "new", 1); got[0] != 1 {
		t.Fatalf("new after the refresh: %v, want 1", got)
	}
	// A step raised by an operator takes effect at the next fetch.
	st.change(tagmodel.Tag{Name: "a", Step: 500})
	if err := a.Refresh(ctx); err != nil {
		t.Fatal(err)
	}
	take(t, a, "a", 9) // spends 1..10, fetching the next segment
	wait.For(t, 10*time.Second, "a fetch with the new step", func() bool {
		st.mu.Lock()
		defer st.mu.Unlock()
		last := st.fetches[len(st.fetches)-1]
		return last.tag == "a" && last.step >= 500
	})
	st.cmu.Lock()
	listing := st.listing
	st.cmu.Unlock()
	if listing != 0 {
		t.Errorf("the allocator listed all tags %d times; a ChangeLister should spare it", listing)
	}
	if n := a.tags.len(); n != 2 {
		t.Errorf("tags in memory = %d, want 2 (only those requested)", n)
	}
}

// TestIdleTagReleased: a tag without requests gives its unused IDs back and
// drops its buffers; its next request brings it back from where it gave
// back, and a tag in use is kept.
func TestIdleTagReleased(t *testing.T) {
	st := newMemStore(t, tagmodel.Tag{Name: "idle", MaxID: 1, Step: 100}, tagmodel.Tag{Name: "busy", MaxID: 1, Step: 100})
	// The event is the give-back itself: the tag leaves the tag map (Known)
	// before its IDs are offered back, so waiting for !Known and then
	// reading max_id raced with the give-back.
	gaveBack := make(chan struct{})
	var once sync.Once
	st.set(func(s *memStore) {
		s.onGiveBack = func(tag string) {
			if tag == "idle" {
				once.Do(func() { close(gaveBack) })
			}
		}
	})
	a := newAllocator(t, Settings{Store: st, IdleTimeout: 40 * time.Millisecond, PrefetchRatio: 1})
	take(t, a, "idle", 3)
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() { // keeps busy busy
		defer close(done)
		for {
			select {
			case <-stop:
				return
			case <-time.After(5 * time.Millisecond):
				a.Take(context.Background(), "busy", 1, nil)
			}
		}
	}()
	select {
	case <-gaveBack:
	case <-time.After(10 * time.Second):
		t.Fatal("the idle tag's IDs were not given back within 10s")
	}
	close(stop)
	<-done
	if a.Known("idle") {
		t.Errorf("the idle tag is still known after its IDs were given back")
	}
	if !a.Known("busy") {
		t.Errorf("the busy tag was released")
	}
	if got := st.maxID("idle"); got != 4 {
		t.Fatalf("max_id of the idle tag = %d, want 4 (IDs 4..100 given back)", got)
	}
	if a.Released() == 0 {
		t.Fatal("Released() = 0")
	}
	if got := take(t, a, "idle", 2); got[0] != 4 || got[1] != 5 {
		t.Fatalf("idle tag after release: %v, want 4 5", got)
	}
}

// TestTakeRacingWithRelease: requests racing with the release of their tag
// never get an ID twice and never fail.
func TestTakeRacingWithRelease(t *testing.T) {
	st := newMemStore(t, tagmodel.Tag{Name: "a", MaxID: 1, Step: 7})
	a := newAllocator(t, Settings{Store: st, MaxStep: 7})
	seen := map[int64]bool{}
	for round := range 200 {
		var wg sync.WaitGroup
		results := make(chan []Run, 4)
		errs := make(chan error, 4)
		for range 4 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				runs, err := a.Take(context.Background(), "a", 2, nil)
				if err != nil {
					errs <- err
					return
				}
				results <- runs
			}()
		}
		if b := a.tags.get("a"); b != nil && round%2 == 0 {
			a.release(b)
		}
		wg.Wait()
		close(results)
		close(errs)
		for err := range errs {
			t.Fatalf("round %d: %v", round, err)
		}
		for runs := range results {
			for _, id := range expand(runs) {
				if seen[id] {
					t.Fatalf("round %d: ID %d twice", round, id)
				}
				seen[id] = true
			}
		}
	}
	if a.Released() == 0 {
		t.Fatal("no release happened: the race was not exercised")
	}
	// Everything handed out lies below max_id: give-backs never went below
	// an issued ID.
	maxID := st.maxID("a")
	for id := range seen {
		if id >= maxID {
			t.Fatalf("ID %d handed out, max_id %d", id, maxID)
		}
	}
}

// BenchmarkNewTag adds tags to maps of 100 and 100,000: the cost per tag
// must not grow with the number of tags.
func BenchmarkNewTag(b *testing.B) {
	for _, n := range []int{100, 100_000} {
		b.Run(fmt.Sprint(n), func(b *testing.B) {
			m := newTagMap()
			for i := range n {
				m.add(fmt.Sprint("base", i), func() *buffer { return &buffer{} })
			}
			names := make([]string, b.N)
			for i := range names {
				names[i] = fmt.Sprint("new", i)
			}
			b.ResetTimer()
			for i := range b.N {
				m.add(names[i], func() *buffer { return &buffer{} })
			}
		})
	}
}

// TestRefreshAppliesANewFormat: a refresh that sees a tag's format (or
// reset period, or time zone) changed drops the tag's buffer, so that its
// next request is looked up again and numbered by the new format.
func TestRefreshAppliesANewFormat(t *testing.T) {
	ctx := context.Background()
	st := &changeStore{memStore: newMemStore(t, tagmodel.Tag{Name: "f", MaxID: 1, Step: 10, Format: "ORD-{seq}"})}
	a := newAllocator(t, Settings{Store: st, MaxStep: 10, RefreshInterval: time.Hour})
	wait.For(t, 10*time.Second, "the first refresh", a.Ready)
	numbered := func() string {
		t.Helper()
		runs, num, p, err := a.TakeNowNumbered("f", 1, nil)
		if err == nil && p != nil {
			runs, err = p.Wait(ctx)
			num = p.Numbering()
		}
		if err != nil {
			t.Fatalf("TakeNowNumbered: %v", err)
		}
		return string(num.Append(nil, runs))
	}
	if got := numbered(); got != "ORD-1" {
		t.Fatalf("before the change: %q, want ORD-1", got)
	}
	st.memStore.set(func(m *memStore) { m.tags["f"].Format = "INV-{seq}" })
	st.change(tagmodel.Tag{Name: "f", Step: 10, Format: "INV-{seq}"})
	if err := a.Refresh(ctx); err != nil {
		t.Fatal(err)
	}
	if got := numbered(); !strings.HasPrefix(got, "INV-") {
		t.Fatalf("after the format changed: %q, want INV-…", got)
	}
}
