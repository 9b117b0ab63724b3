package segment

import (
	"context"
	"errors"
	"fmt"
	"github.com/dispenser-dev/dispenser/tagmodel"
	"sync"
	"testing"
	"time"
)

// TestAutoCreateBounded: requests for random tag names create at most
// AutoCreateMax tags; beyond it an unknown tag is ErrUnknownTag and the
// store is left as it was, while the tags created go on serving.
func TestAutoCreateBounded(t *testing.T) {
	st := adminStore{newMemStore(t)}
	a := newAllocator(t, Settings{Store: st, AutoCreateStep: 10, AutoCreateMax: 3})
	for i := range 3 {
		if got := take(t, a, fmt.Sprintf("t%d", i), 1); got[0] != 1 {
			t.Fatalf("t%d: %v, want 1", i, got)
		}
	}
	for i := 3; i < 10; i++ {
		if _, err := a.Take(context.Background(), fmt.Sprintf("t%d", i), 1, nil); !errors.Is(err, tagmodel.ErrUnknownTag) {
			t.Fatalf("t%d, beyond the bound: err = %v, want ErrUnknownTag", i, err)
		}
	}
	st.mu.Lock()
	n := len(st.tags)
	st.mu.Unlock()
	if n != 3 {
		t.Fatalf("tags in the store = %d, want 3", n)
	}
	if got := take(t, a, "t0", 1); got[0] != 2 {
		t.Fatalf("t0 after the bound: %v, want 2", got)
	}
}

// TestNegativeCacheEvictsOne: a full negative cache makes room for a new
// unknown tag by dropping one entry, not all of them.
func TestNegativeCacheEvictsOne(t *testing.T) {
	st := newMemStore(t)
	// MaxWait a minute: 10,001 lookups on a busy machine (the race
	// detector, other tests) may take longer than the default 100 ms.
	a := newAllocator(t, Settings{Store: st, NegativeTTL: time.Hour, MaxWait: time.Minute})
	ctx := context.Background()
	for i := range negativeCacheMax + 1 {
		if _, err := a.Take(ctx, fmt.Sprintf("u%d", i), 1, nil); !errors.Is(err, tagmodel.ErrUnknownTag) {
			t.Fatalf("u%d: err = %v, want ErrUnknownTag", i, err)
		}
	}
	a.mu.Lock()
	n := len(a.negative)
	a.mu.Unlock()
	if n != negativeCacheMax {
		t.Fatalf("negative cache holds %d tags, want %d", n, negativeCacheMax)
	}
}

// blockingTags is a store whose Tag calls block until released, counting
// how many run at once.
type blockingTags struct {
	*memStore
	release chan struct{}
	mu      sync.Mutex // protects running and most
	running int
	most    int
	started chan struct{}
}

func (s *blockingTags) Tag(ctx context.Context, name string) (tagmodel.Tag, error) {
	s.mu.Lock()
	s.running++
	s.most = max(s.most, s.running)
	s.mu.Unlock()
	s.started <- struct{}{}
	defer func() {
		s.mu.Lock()
		s.running--
		s.mu.Unlock()
	}()
	select {
	case <-s.release:
	case <-ctx.Done():
	}
	return s.memStore.Tag(ctx, name)
}

// TestLookupsBounded: requests for many distinct unknown tags at once run
// at most maxLookups store lookups at a time.
func TestLookupsBounded(t *testing.T) {
	st := &blockingTags{memStore: newMemStore(t), release: make(chan struct{}), started: make(chan struct{}, 100)}
	a := newAllocator(t, Settings{Store: st, MaxWait: 5 * time.Second, FetchTimeout: 5 * time.Second})
	var wg sync.WaitGroup
	for i := range 40 {
		wg.Go(func() { _, _ = a.Take(context.Background(), fmt.Sprintf("r%d", i), 1, nil) })
	}
	for range maxLookups { // the first maxLookups lookups start...
		<-st.started
	}
	select { // ...and no more while they block
	case <-st.started:
		t.Fatalf("a lookup beyond the %d allowed at once started", maxLookups)
	case <-time.After(200 * time.Millisecond):
	}
	close(st.release)
	wg.Wait()
	if st.most > maxLookups {
		t.Fatalf("%d lookups ran at once, want at most %d", st.most, maxLookups)
	}
}
