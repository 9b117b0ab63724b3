package segment

import (
	"context"
	"github.com/dispenser-dev/dispenser/tagmodel"
	"runtime"
	"strconv"
	"testing"
	"time"
)

// tagBytesBudget is the most Go heap one warm tag may hold in the
// allocator (its buffer, both segments, its share of the tag map and its
// name), measured after a garbage collection. The target is under
// 1 KB of resident memory per warm tag for the whole worker (100,000 warm
// tags under 160 MB); with the default GOGC the heap grows to twice what
// is live before it is collected, so everything live per tag must stay
// near 512 bytes, of which the store keeps a part (about 100-150 bytes
// with the KV store): this leaves the allocator 384. It holds about 290
// (buffer 176, segments 2x32, name and map entry).
const tagBytesBudget = 384

// statelessStore knows every tag and answers every fetch of a tag with the
// same small segment, keeping nothing per tag, so that the heap an
// allocator on it grows by is the allocator's own.
type statelessStore struct{}

const statelessStep = 10

func (statelessStore) Fetch(ctx context.Context, tag string, step int64) (tagmodel.Allocation, error) {
	return tagmodel.Allocation{Start: 1, End: 1 + statelessStep, TagStep: statelessStep}, nil
}

func (statelessStore) Tags(ctx context.Context) ([]string, error) { return nil, nil }

func (statelessStore) Tag(ctx context.Context, name string) (tagmodel.Tag, error) {
	return tagmodel.Tag{Name: name, MaxID: 1, Step: statelessStep}, nil
}

func (statelessStore) GiveBack(ctx context.Context, tag string, end, first int64) (bool, error) {
	return false, nil
}

func (statelessStore) Changes(ctx context.Context, cursor int64) ([]tagmodel.Change, int64, error) {
	return nil, 1, nil
}

// heapInUse returns the live heap after a full garbage collection.
func heapInUse() int64 {
	var ms runtime.MemStats
	runtime.GC()
	runtime.GC() // a second cycle frees what the first one's finalizers let go
	runtime.ReadMemStats(&ms)
	return int64(ms.HeapAlloc)
}

// TestMemoryPerTag warms many tags and checks that the allocator's heap
// grows by at most tagBytesBudget per warm tag: first with one request
// per tag (its first segment in memory, as for a tag asked once), then
// with both segments of each tag in memory (its current one and the
// next). A field added to buffer or segment without care, or a per-tag
// allocation that outlives the requests, fails it.
func TestMemoryPerTag(t *testing.T) {
	const tags = 30_000
	a := newAllocator(t, Settings{Store: statelessStore{}, RefreshInterval: time.Hour, IdleTimeout: -1, MaxWait: time.Minute})
	<-a.Loaded()
	before := heapInUse()
	ctx := context.Background()
	check := func(what string) {
		t.Helper()
		// Wait for the fetches the requests started.
		deadline := time.Now().Add(time.Minute)
		for _, b := range a.tags.all() {
			for b.loading.Load() {
				if time.Now().After(deadline) {
					t.Fatalf("tag %q: a fetch still runs after a minute", b.tag)
				}
				time.Sleep(time.Millisecond)
			}
		}
		after := heapInUse()
		if n := a.tags.len(); n != tags {
			t.Fatalf("%d tags in memory, want %d", n, tags)
		}
		per := float64(after-before) / tags
		t.Logf("%d warm tags, %s: heap %d -> %d bytes, %.1f bytes per tag (budget %d)", tags, what, before, after, per, tagBytesBudget)
		if per > tagBytesBudget {
			t.Errorf("a warm tag with %s holds %.1f bytes of heap, want at most %d", what, per, tagBytesBudget)
		}
	}
	for i := range tags {
		// The name is made here, as a request's subject is, so that
		// whatever the allocator keeps of it counts.
		tag := "memory_tag_" + strconv.Itoa(i)
		if _, err := a.Take(ctx, tag, 1, nil); err != nil {
			t.Fatalf("Take(%q): %v", tag, err)
		}
	}
	check("one segment")
	for i := range tags {
		// Two more IDs of a segment of ten pass the prefetch threshold:
		// the next segment is fetched.
		tag := "memory_tag_" + strconv.Itoa(i)
		if _, err := a.Take(ctx, tag, 2, nil); err != nil {
			t.Fatalf("Take(%q): %v", tag, err)
		}
		// One fetch at a time, as in phase one (each request waited):
		// thousands of loaders at once would leave the runtime that
		// many goroutine descriptors, which it keeps for reuse.
		for b := a.tags.get(tag); b.loading.Load(); {
			runtime.Gosched()
		}
	}
	check("two segments")
	for _, b := range a.tags.all() {
		if b.next.Load() == nil {
			t.Fatalf("tag %q: no next segment", b.tag)
		}
	}
	runtime.KeepAlive(a)
}
