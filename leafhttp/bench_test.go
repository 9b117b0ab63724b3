package leafhttp_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync/atomic"
	"testing"

	"github.com/dispenser-dev/dispenser/leafhttp"
	"github.com/dispenser-dev/dispenser/segment"
)

// counterSegments hands out IDs from an atomic counter: the handler's own
// cost, without the allocator's (BenchmarkTakeOne in package segment).
type counterSegments struct {
	fakeSegments
	n atomic.Int64
}

func (c *counterSegments) Take(_ context.Context, _ string, n int, dst []segment.Run) ([]segment.Run, error) {
	v := c.n.Add(int64(n))
	return append(dst, segment.Run{First: v - int64(n) + 1, Last: v}), nil
}

// BenchmarkHandler: Leaf's segment path against a bare handler answering
// an atomic counter, both through one ResponseRecorder per request; the
// end-to-end measurement with wrk is internal/tests/wrkbench.
func BenchmarkHandler(b *testing.B) {
	var c atomic.Int64
	bare := http.HandlerFunc(func(rw http.ResponseWriter, _ *http.Request) {
		rw.Header()["Content-Type"] = []string{"text/plain; charset=utf-8"}
		rw.Write(strconv.AppendInt(make([]byte, 0, 20), c.Add(1), 10))
	})
	leaf, err := leafhttp.New(leafhttp.Settings{Segments: &counterSegments{}, Classify: classifyCode})
	if err != nil {
		b.Fatal(err)
	}
	for _, bb := range []struct {
		name string
		h    http.Handler
	}{{"bare", bare}, {"segment", leaf}} {
		b.Run(bb.name, func(b *testing.B) {
			req := httptest.NewRequest(http.MethodGet, "/api/segment/get/orders", nil)
			b.ReportAllocs()
			for b.Loop() {
				rec := httptest.NewRecorder()
				bb.h.ServeHTTP(rec, req)
				if rec.Code != http.StatusOK {
					b.Fatalf("%d %s", rec.Code, rec.Body)
				}
			}
		})
	}
}

// BenchmarkViewPage: one page of /cache and /db from a warm snapshot of
// 100,000 tags (a recomputation a second falls in the loop too), as a
// client looping a view gets it; the end-to-end measurement beside the
// single-ID load is `go run ./internal/tests/wrkbench views`.
func BenchmarkViewPage(b *testing.B) {
	h := newViewHandler(b, 100_000, nil)
	for _, path := range []string{"/cache", "/cache?format=json", "/db", "/db?format=json"} {
		b.Run(path, func(b *testing.B) {
			req := httptest.NewRequest(http.MethodGet, path, nil)
			b.ReportAllocs()
			for b.Loop() {
				rec := httptest.NewRecorder()
				h.ServeHTTP(rec, req)
				if rec.Code != http.StatusOK {
					b.Fatalf("%d %s", rec.Code, rec.Body)
				}
			}
		})
	}
}
