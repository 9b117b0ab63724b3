package leafhttp_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/url"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/dispenser-dev/dispenser/leafhttp"
	"github.com/dispenser-dev/dispenser/segment"
	"github.com/dispenser-dev/dispenser/tagmodel"
)

// fakeRows is a store of tags for /db.
type fakeRows struct{ names []string }

func (f fakeRows) Tags(context.Context) ([]string, error) { return f.names, nil }
func (f fakeRows) Tag(_ context.Context, name string) (tagmodel.Tag, error) {
	return tagmodel.Tag{Name: name, MaxID: 1, Step: 1}, nil
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
	// /db serves one request at a time and answers 503 to one that waited
	// RowsTimeout: 200 concurrent /db under -race on a busy machine took
	// longer than the default 10 s. Here it only bounds a hang.
	h, err := leafhttp.New(leafhttp.Settings{Segments: &fakeSegments{stats: stats}, Rows: fakeRows{names},
		Classify: classifyCode, OnSnapshot: onSnapshot, RowsTimeout: 2 * time.Minute})
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

// TestViewPaging: walking every page of /cache and /db, in JSON by the
// header NextHeader and in HTML by the page's "next page" link (as a
// browser does), yields every tag exactly once, in order; bad paging
// parameters are 400.
func TestViewPaging(t *testing.T) {
	const n = 2345
	h := newViewHandler(t, n, nil)
	for _, tt := range []struct {
		name, path, limit string
		html              bool
	}{
		{name: "cache json default", path: "/cache?format=json"},
		{name: "cache json 100", path: "/cache?format=json", limit: "100"},
		{name: "cache json 1", path: "/cache?format=json", limit: "7"},
		{name: "db json 333", path: "/db?format=json", limit: "333"},
		{name: "db json default", path: "/db?format=json"},
		{name: "cache html default", path: "/cache", html: true},
		{name: "cache html 500", path: "/cache", limit: "500", html: true},
		{name: "db html default", path: "/db", html: true},
		{name: "db html 7", path: "/db", limit: "7", html: true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			got, pages := walkView(t, h, tt.path, tt.limit, tt.html, n)
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
	for _, q := range []string{"limit=0", "limit=-1", "limit=abc", "limit=", "limit=1e3", "limit=10001", "limit=1&limit=2", "after=a&after=b", "limit=%zz", "after=%zz"} {
		for _, view := range []string{"/cache", "/db"} {
			rec := httptest.NewRecorder()
			h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, view+"?"+q, nil))
			if rec.Code != http.StatusBadRequest {
				t.Errorf("%s?%s: %d, want 400", view, q, rec.Code)
			}
		}
	}
}

// dataKey finds the tags of an HTML view's rows, and nextLink the query
// of its "next page" link.
var (
	dataKey  = regexp.MustCompile(`<tr data-key="([^"]*)">`)
	nextLink = regexp.MustCompile(`<a href="\?([^"]*)">next page</a>`)
)

// walkView reads every page of the view at path (with &limit=limit if
// not empty): JSON pages through NextHeader, HTML pages through their
// "next page" link, which must name the same after as the header. It
// returns the tags in the order seen, and the pages read; more than
// bound pages fail the test.
func walkView(tb testing.TB, h http.Handler, path, limit string, html bool, bound int) ([]string, int) {
	tb.Helper()
	var got []string
	after, pages := "", 0
	for {
		q := path
		sep := "?"
		if strings.Contains(q, "?") {
			sep = "&"
		}
		if limit != "" {
			q += sep + "limit=" + limit
			sep = "&"
		}
		if after != "" {
			q += sep + "after=" + url.QueryEscape(after)
		}
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, q, nil))
		if rec.Code != http.StatusOK {
			tb.Fatalf("%s: %d %s", q, rec.Code, rec.Body)
		}
		header := rec.Header().Get(leafhttp.NextHeader)
		if html {
			for _, m := range dataKey.FindAllStringSubmatch(rec.Body.String(), -1) {
				got = append(got, m[1])
			}
			after = ""
			if m := nextLink.FindStringSubmatch(rec.Body.String()); m != nil {
				v, err := url.ParseQuery(strings.ReplaceAll(m[1], "&amp;", "&"))
				if err != nil {
					tb.Fatalf("%s: next page link %q: %v", q, m[1], err)
				}
				after = v.Get("after")
			}
			if after != header {
				tb.Fatalf("%s: the next page link names after=%q, the header %s %q", q, after, leafhttp.NextHeader, header)
			}
		} else {
			var rows []struct{ Key string }
			if err := json.Unmarshal(rec.Body.Bytes(), &rows); err != nil {
				tb.Fatal(err)
			}
			for _, r := range rows {
				got = append(got, r.Key)
			}
			after = header
		}
		pages++
		if after == "" {
			return got, pages
		}
		if pages > bound {
			tb.Fatal("paging does not end")
		}
	}
}
