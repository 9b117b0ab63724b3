package dispenser_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/dispenser-dev/dispenser/dispenser"
	"github.com/dispenser-dev/dispenser/segment"
	"github.com/dispenser-dev/dispenser/testenv"
)

// createTags inserts n tags t0000.. with step 10 in one statement.
func (st *stack) createTags(tb testing.TB, n int) {
	tb.Helper()
	_, err := st.pool.Exec(context.Background(), `INSERT INTO leaf_alloc (biz_tag, max_id, step)
SELECT 't' || lpad(i::text, 4, '0'), 1, 10 FROM generate_series(0, $1 - 1) AS i`, n)
	if err != nil {
		tb.Fatal(err)
	}
}

// TestMetricSeriesBounded: requests for many tags add no series beyond the
// tags named in MetricsTags; the totals cover every tag.
func TestMetricSeriesBounded(t *testing.T) {
	st := newStack(t, nil)
	st.createTags(t, 300)
	alloc, err := segment.New(segment.Settings{Store: st.store, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewPedanticRegistry()
	svc, err := dispenser.New(dispenser.Config{Conn: testenv.Connect(t, st.ns), Segments: alloc, Logger: quiet,
		Registerer: reg, MetricsTags: []string{"t0007"}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { svc.Stop(context.Background()); alloc.Close(context.Background()) })
	nc := testenv.Connect(t, st.ns)
	for i := range 300 {
		if body, code := request(t, nc, fmt.Sprintf("id.segment.t%04d", i), "", nil); code != "" {
			t.Fatalf("t%04d: %q code %s", i, body, code)
		}
	}
	// A reply is published before its request is counted: wait until
	// the last one is.
	var families []*dto.MetricFamily
	deadline := time.Now().Add(10 * time.Second)
	for {
		var err error
		if families, err = reg.Gather(); err != nil {
			t.Fatal(err)
		}
		if n, _ := metricValue(families, "dispenser_requests_total", map[string]string{"transport": "nats", "endpoint": "segment", "tag": "", "code": "200"}); n >= 299 || time.Now().After(deadline) {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	series := 0
	for _, f := range families {
		for _, m := range f.GetMetric() {
			series++
			for _, l := range m.GetLabel() {
				if l.GetName() == "tag" && l.GetValue() != "" && l.GetValue() != "t0007" {
					t.Fatalf("%s has a series for tag %q, not named in MetricsTags", f.GetName(), l.GetValue())
				}
			}
		}
	}
	if series > 60 {
		t.Errorf("%d series for 300 tags; want a bounded set", series)
	}
	for _, tt := range []struct {
		metric   string
		labels   map[string]string
		min, max float64 // a prefetch may add a fetch
	}{
		{"dispenser_segment_tags", map[string]string{}, 300, 300},
		{"dispenser_segment_all_fetches_total", map[string]string{}, 300, 600},
		{"dispenser_requests_total", map[string]string{"transport": "nats", "endpoint": "segment", "tag": "", "code": "200"}, 299, 299},
		{"dispenser_requests_total", map[string]string{"transport": "nats", "endpoint": "segment", "tag": "t0007", "code": "200"}, 1, 1},
		{"dispenser_segment_fetches_total", map[string]string{"tag": "t0007"}, 1, 2},
	} {
		if got, ok := metricValue(families, tt.metric, tt.labels); !ok || got < tt.min || got > tt.max {
			t.Errorf("%s%v = %v (found %v), want %v..%v", tt.metric, tt.labels, got, ok, tt.min, tt.max)
		}
	}
}

// TestMicroStatsBounded: with more tags in memory than StatsTags, micro
// stats shows the totals and the most recently fetched StatsTags tags, and
// the reply fits in a NATS message.
func TestMicroStatsBounded(t *testing.T) {
	st := newStack(t, nil)
	n := dispenser.StatsTags + 50
	st.createTags(t, n+1)
	w := st.worker(t, segment.Settings{MaxWait: 3 * time.Second}) // a cold tag on a busy machine
	var mu sync.Mutex                                             // protects now
	now := time.Now()
	dispenser.SetClock(w.svc, func() time.Time { mu.Lock(); defer mu.Unlock(); return now })
	nc := testenv.Connect(t, st.ns)
	for i := range n {
		if body, code := request(t, nc, fmt.Sprintf("id.segment.t%04d", i), "", nil); code != "" {
			t.Fatalf("t%04d: %q code %s", i, body, code)
		}
	}
	stats := func() (totalTags, shown int, tags []segment.TagStats) {
		t.Helper()
		var data struct {
			Totals segment.Totals     `json:"totals"`
			Shown  int                `json:"shown"`
			Tags   []segment.TagStats `json:"tags"`
		}
		endpointData(t, nc, "$SRV.STATS.dispenser."+w.svc.ID(), "segment", &data)
		return data.Totals.Tags, data.Shown, data.Tags
	}
	last := fmt.Sprintf("t%04d", n-1) // fetched last
	total, shown, tags := stats()
	if total != n || shown != dispenser.StatsTags || len(tags) != dispenser.StatsTags {
		t.Fatalf("totals.tags %d, shown %d, %d tags; want %d, %d, %d", total, shown, len(tags), n, dispenser.StatsTags, dispenser.StatsTags)
	}
	if tags[0].Tag != last {
		t.Errorf("first tag shown %s, want the one fetched last, %s", tags[0].Tag, last)
	}
	// With that many tags, stats are walked at most once a second,
	// however many requests ask for them.
	newest := fmt.Sprintf("t%04d", n)
	if body, code := request(t, nc, "id.segment."+newest, "", nil); code != "" {
		t.Fatalf("%s: %q code %s", newest, body, code)
	}
	if total, _, tags := stats(); total != n || tags[0].Tag != last {
		t.Errorf("stats within a second: %d tags, first %s; want the cached %d, %s", total, tags[0].Tag, n, last)
	}
	mu.Lock()
	now = now.Add(time.Second)
	mu.Unlock()
	if total, _, tags := stats(); total != n+1 || tags[0].Tag != newest {
		t.Errorf("stats a second later: %d tags, first %s; want %d, %s", total, tags[0].Tag, n+1, newest)
	}
}
