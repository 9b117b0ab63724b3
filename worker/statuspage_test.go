package worker

import (
	"context"
	"fmt"
	"net/http"
	"net/url"
	"regexp"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/micro"

	"github.com/dispenser-dev/dispenser/segment"
	"github.com/dispenser-dev/dispenser/testenv"
)

// TestStatusSnapshot: many concurrent viewers of /status share a snapshot
// computed at most once a second, and bad paging parameters are 400.
func TestStatusSnapshot(t *testing.T) {
	var computed atomic.Int64
	testStatusComputed = func() { computed.Add(1) }
	t.Cleanup(func() { testStatusComputed = nil })
	ns := testenv.StartNATS(t, testenv.NATSOptions(t.TempDir()))
	t.Cleanup(ns.Shutdown)
	w, err := New(context.Background(), Config{NATS: NATS{URL: ns.ClientURL()}, Logger: (&testenv.LogBuffer{}).Logger(),
		NoSnowflake: true, MetricsAddr: "127.0.0.1:0", ShutdownTimeout: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { w.Close() })
	base := "http://" + w.httpAddr
	start := time.Now()
	var wg sync.WaitGroup
	for range 200 {
		wg.Go(func() {
			if code, body := testenv.HTTPGet(t, base+"/status"); code != http.StatusOK {
				t.Errorf("/status: %d %s", code, body)
			}
		})
	}
	wg.Wait()
	allowed := int64(time.Since(start)/time.Second) + 1
	if got := computed.Load(); got < 1 || got > allowed {
		t.Errorf("200 concurrent /status in %v: computed %d times, want 1..%d", time.Since(start), got, allowed)
	}
	for _, q := range []string{"limit=0", "limit=x", "limit=10001", "after=a&after=b"} {
		if code, _ := testenv.HTTPGet(t, base+"/status?"+q); code != http.StatusBadRequest {
			t.Errorf("/status?%s: %d, want 400", q, code)
		}
	}
}

// statusNames are n tag names over the whole alphabet of tags, so that
// their order is the bytes' ('-' < digits < capitals < '_' < small
// letters), not in the order made.
func statusNames(n int) []string {
	const first = "-09AZ_az"
	names := make([]string, n)
	for i := range names {
		names[i] = fmt.Sprintf("%c%04d", first[(i*5)%len(first)], n-i)
	}
	return names
}

// TestStatusPaging: walking every page of /status through its "next
// page" link, as a browser does, with the default and other limits,
// yields every tag in memory exactly once, in order; bad paging
// parameters are 400.
func TestStatusPaging(t *testing.T) {
	ns := testenv.StartNATS(t, testenv.NATSOptions(t.TempDir()))
	t.Cleanup(ns.Shutdown)
	w, err := New(context.Background(), Config{NATS: NATS{URL: ns.ClientURL()}, Logger: (&testenv.LogBuffer{}).Logger(),
		NoSnowflake: true, MetricsAddr: "127.0.0.1:0", ShutdownTimeout: 2 * time.Second,
		Segment: segment.Settings{AutoCreateStep: 10, AutoCreateMax: -1, ColdWait: time.Minute}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { w.Close() })
	const n = 450 // more than two default pages
	names := statusNames(n)
	// One ID of each tag brings it into memory (created on first use;
	// a busy machine may take longer than the default ColdWait).
	nc := testenv.Connect(t, ns)
	var wg sync.WaitGroup
	sem := make(chan struct{}, 16)
	for _, name := range names {
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			resp, err := nc.Request("id.segment."+name, nil, 2*time.Minute)
			if err != nil || resp.Header.Get(micro.ErrorCodeHeader) != "" {
				t.Errorf("%s: %v %v", name, err, resp)
			}
		})
	}
	wg.Wait()
	if t.Failed() {
		t.FailNow()
	}
	want := slices.Clone(names)
	slices.Sort(want)
	if got := len(w.SegmentStats()); got != n {
		t.Fatalf("%d tags in memory, want %d", got, n)
	}
	base := "http://" + w.httpAddr + "/status"
	row := regexp.MustCompile(`<tr class="tag" data-tag="([^"]*)">`)
	next := regexp.MustCompile(`<a href="\?([^"]*)">next page</a>`)
	for _, tt := range []struct{ name, limit string }{
		{name: "default"},
		{name: "7", limit: "7"},
		{name: "449", limit: "449"},
		{name: "450", limit: "450"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			var got []string
			after, pages := "", 0
			for {
				q := url.Values{}
				if tt.limit != "" {
					q.Set("limit", tt.limit)
				}
				if after != "" {
					q.Set("after", after)
				}
				code, body := testenv.HTTPGet(t, base+"?"+q.Encode())
				if code != http.StatusOK {
					t.Fatalf("/status?%s: %d %s", q.Encode(), code, body)
				}
				for _, m := range row.FindAllStringSubmatch(body, -1) {
					got = append(got, m[1])
				}
				pages++
				m := next.FindStringSubmatch(body)
				if m == nil {
					break
				}
				v, err := url.ParseQuery(strings.ReplaceAll(m[1], "&amp;", "&"))
				if err != nil {
					t.Fatalf("/status?%s: next page link %q: %v", q.Encode(), m[1], err)
				}
				if after = v.Get("after"); after == "" {
					t.Fatalf("/status?%s: next page link %q names no after", q.Encode(), m[1])
				}
				if pages > n {
					t.Fatal("paging does not end")
				}
			}
			if !slices.Equal(got, want) {
				t.Errorf("%d pages gave %d tags, want each of %d once, in order:\ngot  %v\nwant %v", pages, len(got), n, got, want)
			}
		})
	}
	for _, q := range []string{"limit=0", "limit=-1", "limit=x", "limit=", "limit=1e3", "limit=10001", "limit=1&limit=2",
		"after=a&after=b", "limit=%zz", "after=%zz"} {
		if code, body := testenv.HTTPGet(t, base+"?"+q); code != http.StatusBadRequest {
			t.Errorf("/status?%s: %d, want 400: %.200s", q, code, body)
		}
	}
}
