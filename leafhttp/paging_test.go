package leafhttp_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/url"
	"sync"
	"testing"
	"time"

	"github.com/dispenser-dev/dispenser/leafhttp"
	"github.com/dispenser-dev/dispenser/segment"
)

// fakeRows is a store of tags for /db.
type fakeRows struct{ names []string }

func (f fakeRows) Tags(context.Context) ([]string, error) { return f.names, nil }
func (f fakeRows) Tag(_ context.Context, name string) (segment.Tag, error) {
	return segment.Tag{Name: name, MaxID: 1, Step: 1}, nil
}

// manyTags returns n tags, not in order.
func manyTags(n int) ([]segment.TagStats, []string) {
	stats := make([]segment.TagStats, n)
	names := make([]string, n)
	for i := range n {
		name := fmt.Sprintf("t%05d", (i*7919)%n) // a permutation: 7919 is prime
		stats[i], names[i] = segment.TagStats{Tag: name}, name
	}
	return stats, names
}

func newViewHandler(tb testing.TB, n int, onSnapshot func(string)) *leafhttp.Handler {
	tb.Helper()
	stats, names := manyTags(n)
	h, err := leafhttp.New(leafhttp.Settings{Segments: &fakeSegments{stats: stats}, Rows: fakeRows{names},
		Classify: classifyCode, OnSnapshot: onSnapshot})
	if err != nil {
		tb.Fatal(err)
	}
	return h
}

// TestViewSnapshotsOncePerSecond: many concurrent viewers of /cache and
// /db share snapshots computed at most once a second.
func TestViewSnapshotsOncePerSecond(t *testing.T) {
	var mu sync.Mutex // protects computed
	computed := map[string]int{}
	h := newViewHandler(t, 3000, func(view string) {
		mu.Lock()
		defer mu.Unlock()
		computed[view]++
	})
	start := time.Now()
	var wg sync.WaitGroup
	for i := range 400 {
		wg.Go(func() {
			path := "/cache?format=json"
			if i%2 == 1 {
				path = "/db?format=json"
			}
			rec := httptest.NewRecorder()
			h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, path, nil))
			if rec.Code != http.StatusOK {
				t.Errorf("%s: %d %s", path, rec.Code, rec.Body)
			}
		})
	}
	wg.Wait()
	// A computation may start at most once per started second of the run.
	allowed := int(time.Since(start)/time.Second) + 1
	mu.Lock()
	defer mu.Unlock()
	for _, view := range []string{"cache", "db"} {
		if got := computed[view]; got < 1 || got > allowed {
			t.Errorf("400 concurrent requests in %v: %s computed %d times, want 1..%d", time.Since(start), view, got, allowed)
		}
	}
}

// TestViewPaging: walking every page of /cache and /db (JSON and HTML
// sizes) yields every tag exactly once, in order; bad paging parameters
// are 400.
func TestViewPaging(t *testing.T) {
	const n = 2345
	h := newViewHandler(t, n, nil)
	for _, tt := range []struct{ name, path, limit string }{
		{name: "cache json default", path: "/cache?format=json"},
		{name: "cache json 100", path: "/cache?format=json", limit: "100"},
		{name: "cache json 1", path: "/cache?format=json", limit: "7"},
		{name: "db json 333", path: "/db?format=json", limit: "333"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			var got []string
			after, pages := "", 0
			for {
				q := tt.path
				if tt.limit != "" {
					q += "&limit=" + tt.limit
				}
				if after != "" {
					q += "&after=" + url.QueryEscape(after)
				}
				rec := httptest.NewRecorder()
				h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, q, nil))
				if rec.Code != http.StatusOK {
					t.Fatalf("%s: %d %s", q, rec.Code, rec.Body)
				}
				var rows []struct{ Key string }
				if err := json.Unmarshal(rec.Body.Bytes(), &rows); err != nil {
					t.Fatal(err)
				}
				for _, r := range rows {
					got = append(got, r.Key)
				}
				pages++
				if after = rec.Header().Get(leafhttp.NextHeader); after == "" {
					break
				}
				if pages > n {
					t.Fatal("paging does not end")
				}
			}
			if len(got) != n {
				t.Fatalf("%d pages gave %d tags, want %d", pages, len(got), n)
			}
			for i, k := range got {
				if want := fmt.Sprintf("t%05d", i); k != want {
					t.Fatalf("tag %d = %q, want %q (each tag once, in order)", i, k, want)
				}
			}
		})
	}
	for _, q := range []string{"limit=0", "limit=-1", "limit=abc", "limit=10001", "limit=1&limit=2", "after=a&after=b", "limit=%zz"} {
		for _, view := range []string{"/cache", "/db"} {
			rec := httptest.NewRecorder()
			h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, view+"?"+q, nil))
			if rec.Code != http.StatusBadRequest {
				t.Errorf("%s?%s: %d, want 400", view, q, rec.Code)
			}
		}
	}
}
