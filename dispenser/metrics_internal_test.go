package dispenser

import (
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// TestObserveAllocatesNothing: once a request's series are resolved,
// recording a request looks no labels up and allocates nothing, over
// NATS and HTTP, for a named tag and for all others.
func TestObserveAllocatesNothing(t *testing.T) {
	m, err := newMetrics(prometheus.NewRegistry(), &Service{cfg: Config{MetricsTags: []string{"orders"}}})
	if err != nil {
		t.Fatal(err)
	}
	start := mono()
	record := func() {
		m.observe("segment", "orders", "200", 5, start)
		m.observe("segment", "other-tag", "503", 0, start)
		m.record(1, "snowflake", "", "200", 1, time.Millisecond)
		m.record(1, "cache", "", "200", 0, time.Millisecond)
	}
	record() // resolves the series
	if n := testing.AllocsPerRun(100, record); n != 0 {
		t.Errorf("recording 4 requests allocates %v times, want 0", n)
	}
}

// BenchmarkObserve is one request's recording on the hot path.
func BenchmarkObserve(b *testing.B) {
	m, err := newMetrics(prometheus.NewRegistry(), &Service{cfg: Config{MetricsTags: []string{"orders"}}})
	if err != nil {
		b.Fatal(err)
	}
	start := mono()
	for b.Loop() {
		m.observe("segment", "orders", "200", 1, start)
	}
}

// BenchmarkObserveByLabels is the baseline: the same recording with a
// label lookup per series, as before the series were resolved once.
func BenchmarkObserveByLabels(b *testing.B) {
	m, err := newMetrics(prometheus.NewRegistry(), &Service{cfg: Config{MetricsTags: []string{"orders"}}})
	if err != nil {
		b.Fatal(err)
	}
	start := time.Now()
	for b.Loop() {
		m.requests.WithLabelValues(TransportNATS, "segment", "orders", "200").Inc()
		m.ids.WithLabelValues(TransportNATS, "segment", "orders").Add(1)
		m.latency.WithLabelValues(TransportNATS, "segment").Observe(time.Since(start).Seconds())
	}
}
