package leafhttp_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/dispenser-dev/dispenser/leafhttp"
	"github.com/dispenser-dev/dispenser/protocol"
	"github.com/dispenser-dev/dispenser/segment"
	"github.com/dispenser-dev/dispenser/snowflake"
)

// fakeSegments fails every Take with err and shows stats. A fake of the
// package's own interface: unit tests only.
type fakeSegments struct {
	err   error
	ready bool
	stats []segment.TagStats
}

func (f *fakeSegments) Take(context.Context, string, int, []segment.Run) ([]segment.Run, error) {
	return nil, f.err
}

func (f *fakeSegments) TakeNowNumbered(string, int, []segment.Run) ([]segment.Run, segment.Numbering, *segment.Pending, error) {
	return nil, segment.Numbering{}, nil, f.err
}
func (f *fakeSegments) Stats() []segment.TagStats { return f.stats }
func (f *fakeSegments) Ready() bool               { return f.ready }

// codeError carries the reply code a fake Classify gives it.
type codeError struct{ code string }

func (e codeError) Error() string { return "failed with " + e.code }

func classifyCode(err error) (string, string) {
	var ce codeError
	if errors.As(err, &ce) {
		return ce.code, ce.Error()
	}
	return protocol.CodeInternal, "internal error"
}

func newHandler(tb testing.TB, f *fakeSegments) *leafhttp.Handler {
	tb.Helper()
	h, err := leafhttp.New(leafhttp.Settings{Segments: f, Classify: classifyCode})
	if err != nil {
		tb.Fatal(err)
	}
	return h
}

// TestErrorMapping: each reply code of Classify answers its HTTP status
// and the Leaf code of the documented table (docs/leaf-http.md); a 503
// before the tag list loaded is Leaf's -1, "not initialised".
func TestErrorMapping(t *testing.T) {
	for _, tt := range []struct {
		name   string
		code   string
		ready  bool
		status int
		leaf   int
	}{
		{"bad request", protocol.CodeBadRequest, true, 400, -2},
		{"unknown tag", protocol.CodeNotFound, true, 404, -2},
		{"exhausted", protocol.CodeGone, true, 410, -3},
		{"unavailable", protocol.CodeUnavailable, true, 503, -3},
		{"unavailable before the tag list loaded", protocol.CodeUnavailable, false, 503, -1},
		{"internal", protocol.CodeInternal, true, 500, -3},
		{"a code outside the table", "418", true, 418, -3},
		{"not a code", "x", true, 500, -3},
	} {
		t.Run(tt.name, func(t *testing.T) {
			h := newHandler(t, &fakeSegments{err: codeError{tt.code}, ready: tt.ready})
			rec := httptest.NewRecorder()
			h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/api/segment/get/orders", nil))
			if rec.Code != tt.status {
				t.Errorf("status %d, want %d", rec.Code, tt.status)
			}
			e := leafError(t, rec.Body.String())
			if e.Code != tt.leaf || e.Status != tt.status || e.Path != "/api/segment/get/orders" || e.Description != (codeError{tt.code}).Error() {
				t.Errorf("body %+v: want Leaf code %d, status %d, the path and the description", e, tt.leaf, tt.status)
			}
		})
	}
}

// TestCacheEscapes: /cache's HTML escapes what it shows and lists at most
// the status page's limit of tags, saying how many more there are.
func TestCacheEscapes(t *testing.T) {
	hostile := `<script>alert("x")</script>`
	stats := []segment.TagStats{{Tag: hostile}, {Tag: "a=20261124", Current: &segment.SegmentStats{Start: 1, Cursor: 2, End: 11, Step: 10}}}
	for range 300 {
		stats = append(stats, segment.TagStats{Tag: "t"})
	}
	h := newHandler(t, &fakeSegments{ready: true, stats: stats})
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/cache", nil))
	page := rec.Body.String()
	for _, want := range []string{`&lt;script&gt;alert(&#34;x&#34;)&lt;/script&gt;`,
		`<td class="name">a=20261124</td><td>true</td><td>false</td><td>0</td><td>2</td><td>11</td><td>10</td>`,
		"302 tags in memory; the first 200 by name", "… and 102 more tags not shown"} {
		if !strings.Contains(page, want) {
			t.Errorf("/cache lacks %q", want)
		}
	}
	if strings.Contains(page, hostile) {
		t.Errorf("/cache shows %q unescaped", hostile)
	}
	if got := rec.Header().Get(leafhttp.TotalHeader); got != "302" {
		t.Errorf("%s %q, want 302", leafhttp.TotalHeader, got)
	}
}

// TestNewRefusesBadSettings: Settings that cannot work are refused with
// ErrConfig.
func TestNewRefusesBadSettings(t *testing.T) {
	for _, tt := range []struct {
		name string
		s    leafhttp.Settings
	}{
		{"no segments", leafhttp.Settings{Classify: classifyCode}},
		{"no classify", leafhttp.Settings{Segments: &fakeSegments{}}},
		{"max batch too large", leafhttp.Settings{Segments: &fakeSegments{}, Classify: classifyCode, MaxBatch: protocol.MaxCount + 1}},
		{"negative max batch", leafhttp.Settings{Segments: &fakeSegments{}, Classify: classifyCode, MaxBatch: -1}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			if _, err := leafhttp.New(tt.s); !errors.Is(err, leafhttp.ErrConfig) {
				t.Errorf("err = %v, want %v", err, leafhttp.ErrConfig)
			}
		})
	}
}

// TestAllowListsTheMethodsThatAnswer: a 405 on an ID path names in Allow
// exactly the methods that take IDs there (Leaf maps every method; HEAD,
// OPTIONS, TRACE and CONNECT take none).
func TestAllowListsTheMethodsThatAnswer(t *testing.T) {
	h := newHandler(t, &fakeSegments{ready: true})
	var answered []string
	allow := map[string]bool{}
	for _, m := range []string{"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS", "TRACE", "CONNECT"} {
		w := httptest.NewRecorder()
		h.ServeHTTP(w, httptest.NewRequest(m, "/api/segment/get/orders", nil))
		if w.Code != http.StatusMethodNotAllowed {
			answered = append(answered, m)
			continue
		}
		for a := range strings.SplitSeq(w.Header().Get("Allow"), ",") {
			allow[strings.TrimSpace(a)] = true
		}
	}
	for _, m := range answered {
		if !allow[m] {
			t.Errorf("%s answers, but 405's Allow %v does not list it", m, allow)
		}
		delete(allow, m)
	}
	for m := range allow {
		t.Errorf("405's Allow lists %s, which answers 405", m)
	}
}

// jsSnowflake is a Snowflake of snowflake.JSLayout (53 bits) that issues
// nothing: /decodeSnowflakeId alone is under test.
type jsSnowflake struct{}

func (jsSnowflake) AppendIDs(dst []int64, _ int) ([]int64, error) {
	return dst, errors.New("not issued")
}
func (jsSnowflake) Epoch() time.Time         { return snowflake.DefaultEpoch }
func (jsSnowflake) Layout() snowflake.Layout { return snowflake.JSLayout }

// TestDecodeAboveTheLayout: an ID above the largest of the worker's
// layout is not one of its IDs; /decodeSnowflakeId refuses it (400)
// rather than decode fields the layout never wrote. The default layout's
// largest ID is math.MaxInt64, so only a smaller layout can show it.
func TestDecodeAboveTheLayout(t *testing.T) {
	h, err := leafhttp.New(leafhttp.Settings{Segments: &fakeSegments{}, Snowflake: jsSnowflake{}, Classify: classifyCode})
	if err != nil {
		t.Fatal(err)
	}
	maxID := snowflake.JSLayout.MaxID()
	for _, tt := range []struct {
		name   string
		id     int64
		status int
		desc   string
	}{
		{"largest", maxID, http.StatusOK, `"workerId":"31"`},
		{"one above", maxID + 1, http.StatusBadRequest, fmt.Sprintf("at most %d", maxID)},
		{"int64 max", math.MaxInt64, http.StatusBadRequest, "is not a snowflake ID of layout"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			rec := httptest.NewRecorder()
			h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, fmt.Sprintf("/decodeSnowflakeId?snowflakeId=%d", tt.id), nil))
			if got := rec.Code; got != tt.status {
				t.Fatalf("decode %d: status %d, want %d; body %s", tt.id, got, tt.status, rec.Body)
			}
			if body := rec.Body.String(); !strings.Contains(body, tt.desc) {
				t.Errorf("decode %d: body %s lacks %q", tt.id, body, tt.desc)
			}
		})
	}
}
