package segment

import (
	"context"
	"errors"
	"fmt"
	"github.com/dispenser-dev/dispenser/tagmodel"
	"runtime"
	"sync"
	"testing"
	"time"
)

// TestOrderedTagsOnlyForTheOwner: an ordered tag is refused by Take and
// TakeNow (known or looked up), served by TakeOwned, and Reset makes the
// next TakeOwned start from a segment fetched after it.
func TestOrderedTagsOnlyForTheOwner(t *testing.T) {
	ctx := context.Background()
	st := newMemStore(t, tagmodel.Tag{Name: "o", MaxID: 1, Step: 10, Ordered: true}, tagmodel.Tag{Name: "plain", MaxID: 1, Step: 10})
	a := newAllocator(t, Settings{Store: st, MaxStep: 10})
	_, p, err := a.TakeNow("o", 1, nil)
	if err == nil && p != nil {
		_, err = p.Wait(ctx)
	}
	if !errors.Is(err, ErrOrdered) {
		t.Fatalf("TakeNow of an unknown ordered tag: %v, want ErrOrdered", err)
	}
	if _, err := a.Take(ctx, "o", 1, nil); !errors.Is(err, ErrOrdered) {
		t.Fatalf("Take of a known ordered tag: %v, want ErrOrdered", err)
	}
	if _, _, err := a.TakeNow("o", 1, nil); !errors.Is(err, ErrOrdered) {
		t.Fatalf("TakeNow of a known ordered tag: %v, want ErrOrdered", err)
	}
	if !a.Ordered("o") || a.Ordered("plain") {
		t.Fatalf("Ordered: o %v, plain %v", a.Ordered("o"), a.Ordered("plain"))
	}
	if a.Plain("o") || a.Plain("plain") || a.Plain("never-asked") {
		t.Fatalf("Plain before the plain tag's first request: o %v, plain %v, never-asked %v; want all false",
			a.Plain("o"), a.Plain("plain"), a.Plain("never-asked"))
	}
	owned := func(n int) []int64 {
		t.Helper()
		runs, _, p, err := a.TakeOwned("o", n, nil)
		if err == nil && p != nil {
			runs, err = p.Wait(ctx)
		}
		if err != nil {
			t.Fatalf("TakeOwned: %v", err)
		}
		return expand(runs)
	}
	if got := owned(3); got[0] != 1 || got[2] != 3 {
		t.Fatalf("TakeOwned: %v, want 1..3", got)
	}
	// Now its buffer holds 4..10: a plain request still gets none of them.
	if runs, err := a.Take(ctx, "o", 1, nil); !errors.Is(err, ErrOrdered) {
		t.Fatalf("Take of an ordered tag with IDs in memory: %v, %v; want ErrOrdered", runs, err)
	}
	if runs, _, err := a.TakeNow("o", 1, nil); !errors.Is(err, ErrOrdered) {
		t.Fatalf("TakeNow of an ordered tag with IDs in memory: %v, %v; want ErrOrdered", runs, err)
	}
	if runs, _, _, err := a.TakeNowNumbered("o", 1, nil); !errors.Is(err, ErrOrdered) {
		t.Fatalf("TakeNowNumbered of an ordered tag with IDs in memory: %v, %v; want ErrOrdered", runs, err)
	}
	// Another owner meanwhile took segments; this worker owns the tag
	// again and resets it: it must not serve 4..10 any more.
	st.Fetch(ctx, "o", 0)
	a.Reset("o")
	if got := owned(2); got[0] <= 10 {
		t.Fatalf("after Reset: %v, want IDs from a segment fetched after it (above 20)", got)
	}
	if got := take(t, a, "plain", 1); got[0] != 1 {
		t.Fatalf("plain tag: %v", got)
	}
	if a.Plain("o") || !a.Plain("plain") {
		t.Fatalf("Plain: o %v, plain %v; want false, true", a.Plain("o"), a.Plain("plain"))
	}
	a.Reset("o")
	if a.Plain("o") || a.Ordered("o") {
		t.Fatalf("after Reset: Plain %v, Ordered %v; want neither known", a.Plain("o"), a.Ordered("o"))
	}
}

// lateStore hands out a fetched segment late: its next Fetch takes the
// segment from the store, says so on fetched, and returns it only once
// hold is closed, as a reply delayed in the network would.
type lateStore struct {
	*memStore
	mu      sync.Mutex // protects fetched and hold
	fetched chan tagmodel.Allocation
	hold    chan struct{}
}

func (s *lateStore) Fetch(ctx context.Context, tag string, step int64) (tagmodel.Allocation, error) {
	alloc, err := s.memStore.Fetch(ctx, tag, step)
	s.mu.Lock()
	fetched, hold := s.fetched, s.hold
	s.fetched, s.hold = nil, nil
	s.mu.Unlock()
	if fetched != nil {
		fetched <- alloc
		<-hold
	}
	return alloc, err
}

// TestResetDiscardsSegmentFetchedBefore: a segment whose fetch began before
// Reset, under the previous ownership, is never installed, so never handed
// out, not even to a request that held the old buffer across the Reset (a
// straggler that passed the ownership check just before a loss). The old
// code installed it into the dropped buffer, from which that request took
// 1 after another owner's segment had started at 11.
func TestResetDiscardsSegmentFetchedBefore(t *testing.T) {
	// The deadline bounds a hang (a request that waits across the Reset
	// for a segment that never comes), nothing else.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	mem := newMemStore(t, tagmodel.Tag{Name: "o", MaxID: 1, Step: 10, Ordered: true})
	fetched, hold := make(chan tagmodel.Allocation, 1), make(chan struct{})
	st := &lateStore{memStore: mem, fetched: fetched, hold: hold}
	a := newAllocator(t, Settings{Store: st, MaxStep: 10, MaxWait: time.Minute})
	var once sync.Once
	release := func() { once.Do(func() { close(hold) }) }
	t.Cleanup(release) // before the allocator's Close, which waits for the loader
	_, _, p, err := a.TakeOwned("o", 1, nil)
	if err != nil || p == nil {
		t.Fatalf("TakeOwned of a new tag: pending %v, err %v; want a pending request", p, err)
	}
	waited := make(chan error, 1)
	go func() { _, err := p.Wait(ctx); waited <- err }()
	stale := <-fetched   // fetched [1,11), not yet installed
	b := a.tags.get("o") // the buffer a straggler holds
	if b == nil {
		t.Fatal("no buffer for the tag while its first segment is fetched")
	}
	a.Reset("o") // ownership lost, perhaps regained
	if other, err := mem.Fetch(ctx, "o", 0); err != nil || other.Start <= stale.Start {
		t.Fatalf("another owner's fetch: %+v, %v", other, err)
	}
	if err := <-waited; !errors.Is(err, ErrOrdered) {
		t.Fatalf("the request waiting across the Reset: %v, want ErrOrdered (to be routed again)", err)
	}
	runs, _, p, err := a.TakeOwned("o", 1, nil)
	if err == nil && p != nil {
		runs, err = p.Wait(ctx)
	}
	if err != nil || expand(runs)[0] <= 20 {
		t.Fatalf("after Reset: %v, %v; want an ID of a segment fetched after it (above 20)", expand(runs), err)
	}
	release()                            // the stale segment arrives
	if err := a.Close(ctx); err != nil { // waits for the loader
		t.Fatal(err)
	}
	if got, rest := b.take(1, nil); rest == 0 {
		t.Fatalf("the straggler took %v from a segment fetched before Reset", expand(got))
	}
}

// fakeNow is a settable wall clock for the allocator.
type fakeNow struct {
	mu sync.Mutex // protects t
	t  time.Time
}

func (c *fakeNow) Now() time.Time      { c.mu.Lock(); defer c.mu.Unlock(); return c.t }
func (c *fakeNow) Add(d time.Duration) { c.mu.Lock(); c.t = c.t.Add(d); c.mu.Unlock() }

// TestSwitchWindowRefetch: a tag made ordered may be served as plain by
// workers that have not seen the change yet, from segments fetched after
// the owner's. Once the switch window has passed, the owner serves only
// from a segment fetched after it, above all of those; the old code went
// on serving its segment from before, below what the plain workers handed
// out.
func TestSwitchWindowRefetch(t *testing.T) {
	ctx := context.Background()
	clk := &fakeNow{t: time.Date(2026, 6, 1, 12, 0, 0, 0, time.UTC)}
	mem := newMemStore(t, tagmodel.Tag{Name: "o", MaxID: 1, Step: 1000})
	a := newAllocator(t, Settings{Store: mem, MaxStep: 1000, Now: clk.Now, RefreshInterval: time.Hour})
	if got := take(t, a, "o", 1); got[0] != 1 {
		t.Fatalf("plain: %v, want [1]", got)
	}
	mem.mu.Lock()
	mem.tags["o"].Ordered = true
	mem.mu.Unlock()
	a.apply(tagmodel.Change{Tag: tagmodel.Tag{Name: "o", Step: 1000, Ordered: true}}) // this worker's refresh
	owned := func() int64 {
		t.Helper()
		runs, _, p, err := a.TakeOwned("o", 1, nil)
		if err == nil && p != nil {
			runs, err = p.Wait(ctx)
		}
		if err != nil {
			t.Fatalf("TakeOwned: %v", err)
		}
		return expand(runs)[0]
	}
	a.Reset("o") // it claims the tag
	first := owned()
	// A worker that has not refreshed yet fetches a plain segment above.
	plain, err := mem.Fetch(ctx, "o", 0)
	if err != nil || plain.Start <= first {
		t.Fatalf("plain fetch %+v, %v; want above %d", plain, err, first)
	}
	clk.Add(a.SwitchWindow() - time.Millisecond)
	if got := owned(); got != first+1 {
		t.Fatalf("within the window: %d, want %d (the owner's segment)", got, first+1)
	}
	clk.Add(time.Millisecond)
	if got := owned(); got < plain.End {
		t.Fatalf("after the switch window the owner served %d, below the plain segment %d..%d", got, plain.Start, plain.End-1)
	}
}

// TestOrderedTagNeverServedAsPlainWhileLookedUp: requests that are not the
// owner's race the first lookup of a tag created ordered; none of them may
// get an ID, and none may make the allocator fetch a segment. The old code
// put the tag's buffer into the tag map before marking it ordered, so a
// request that found it in between took it for a plain tag, started a fetch
// and waited for it; the CI run of 2026-11-25 saw a non-owner hand out an
// ordered tag's IDs below ones its owner had already handed out. (Seen
// failing on that code in a few hundred rounds.)
func TestOrderedTagNeverServedAsPlainWhileLookedUp(t *testing.T) {
	ctx := context.Background()
	for round := range 300 {
		mem := newMemStore(t, tagmodel.Tag{Name: "o", MaxID: 1, Step: 10, Ordered: true})
		a := newAllocator(t, Settings{Store: mem, MaxStep: 10, MaxWait: time.Second, RefreshInterval: time.Hour})
		var wg sync.WaitGroup
		var mu sync.Mutex // protects got
		var got []string
		wg.Go(func() { a.Take(ctx, "o", 1, nil) }) // looks the tag up
		for range 2 {
			wg.Go(func() {
				for a.tags.get("o") == nil { // in the map: the lookup ends
					runtime.Gosched()
				}
				for {
					runs, p, err := a.TakeNow("o", 1, nil)
					if err == nil && p != nil {
						runs, err = p.Wait(ctx)
					}
					if errors.Is(err, ErrOrdered) {
						return
					}
					mu.Lock()
					got = append(got, fmt.Sprintf("IDs %v, err %v", expand(runs), err))
					mu.Unlock()
					return
				}
			})
		}
		wg.Wait()
		if len(got) > 0 {
			t.Fatalf("round %d: a request that is not the owner's: %v; want ErrOrdered", round, got)
		}
		if n := mem.fetchCount("o"); n != 0 {
			t.Fatalf("round %d: %d fetches of an ordered tag nobody owns, want 0", round, n)
		}
		a.Close(ctx)
	}
}

// TestWaitingPlainRequestOfTagTurnedOrdered: a request admitted while its
// tag was plain and waiting for a segment when the tag turns out to be
// ordered gets ErrOrdered (to be routed to the owner), not IDs of that
// segment. The old code served it from the segment when it arrived.
func TestWaitingPlainRequestOfTagTurnedOrdered(t *testing.T) {
	ctx := context.Background()
	mem := newMemStore(t, tagmodel.Tag{Name: "o", MaxID: 1, Step: 10})
	fetched, hold := make(chan tagmodel.Allocation, 1), make(chan struct{})
	st := &lateStore{memStore: mem, fetched: fetched, hold: hold}
	a := newAllocator(t, Settings{Store: st, MaxStep: 10, MaxWait: time.Minute, RefreshInterval: time.Hour})
	_, p, err := a.TakeNow("o", 1, nil)
	if err != nil || p == nil {
		t.Fatalf("TakeNow of a new tag: pending %v, err %v; want a pending request", p, err)
	}
	waited := make(chan error, 1)
	go func() {
		runs, err := p.Wait(ctx)
		if err == nil {
			err = fmt.Errorf("got IDs %v", expand(runs))
		}
		waited <- err
	}()
	<-fetched
	a.apply(tagmodel.Change{Tag: tagmodel.Tag{Name: "o", Step: 10, Ordered: true}})
	close(hold)
	if err := <-waited; !errors.Is(err, ErrOrdered) {
		t.Fatalf("a plain request waiting when its tag turned ordered: %v, want ErrOrdered", err)
	}
}

// TestSourceCurrent: the IDs TakeOwned (or its Pending) hands out carry
// their buffer, which is no longer current once a Reset dropped it, so
// that an owner can tell IDs of an ownership that ended from IDs of the
// one it checked.
func TestSourceCurrent(t *testing.T) {
	ctx := context.Background()
	a := newAllocator(t, Settings{Store: newMemStore(t, tagmodel.Tag{Name: "o", MaxID: 1, Step: 10, Ordered: true}), MaxStep: 10})
	_, src, p, err := a.TakeOwned("o", 1, nil) // a new tag: it waits for its first segment
	if err != nil || p == nil {
		t.Fatalf("TakeOwned of a new tag: pending %v, err %v; want a pending request", p, err)
	}
	if src.Current() {
		t.Fatal("IDs of no buffer yet are current")
	}
	if _, err := p.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	waited := p.Source()
	_, taken, p, err := a.TakeOwned("o", 1, nil)
	if err != nil || p != nil {
		t.Fatalf("TakeOwned from memory: pending %v, err %v", p, err)
	}
	if !waited.Current() || !taken.Current() {
		t.Fatalf("before a Reset: current after waiting %v, from memory %v; want both", waited.Current(), taken.Current())
	}
	a.Reset("o")
	if waited.Current() || taken.Current() {
		t.Fatalf("after a Reset: current after waiting %v, from memory %v; want neither", waited.Current(), taken.Current())
	}
}

// TestResetFreezesTheOldGeneration: a request that got the tag's buffer
// just before a Reset and takes from it just after (a race the tag map
// cannot close) gets no ID of the old generation: Reset froze its
// segments. (An owner's IDs would also fail Source.Current; a plain
// request has no such check.)
func TestResetFreezesTheOldGeneration(t *testing.T) {
	a := newAllocator(t, Settings{Store: newMemStore(t, tagmodel.Tag{Name: "t", MaxID: 1, Step: 10}), MaxStep: 10})
	if got := take(t, a, "t", 1); got[0] != 1 {
		t.Fatalf("first ID %v, want 1", got)
	}
	b := a.tags.get("t") // the request looked the buffer up...
	a.Reset("t")         // ...and the tag was reset before it took
	if runs, rest := b.take(1, nil); len(runs) != 0 || rest != 1 {
		t.Fatalf("take from the buffer of before the Reset = %v (%d missing), want no ID", runs, rest)
	}
}
