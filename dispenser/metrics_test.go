package dispenser_test

import (
	"context"
	"encoding/json"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/micro"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/dispenser-dev/dispenser/dispenser"
	"github.com/dispenser-dev/dispenser/internal/tests/wait"
	"github.com/dispenser-dev/dispenser/segment"
	"github.com/dispenser-dev/dispenser/snowflake"
	"github.com/dispenser-dev/dispenser/testenv"
)

func TestMetrics(t *testing.T) {
	st := newStack(t, map[string]int64{"orders": 100})
	alloc, err := segment.New(segment.Settings{Store: st.store, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewPedanticRegistry()
	svc, err := dispenser.New(dispenser.Config{Conn: testenv.Connect(t, st.ns), Segments: alloc, Logger: quiet, Registerer: reg,
		MetricsTags: []string{"orders"}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { svc.Stop(context.Background()); alloc.Close(context.Background()) })
	nc := testenv.Connect(t, st.ns)
	request(t, nc, "id.segment.orders", "5", nil)
	request(t, nc, "id.segment.orders", "", nil)
	request(t, nc, "id.segment.nope", "", nil)
	request(t, nc, "id.segment.orders", "zero", nil)

	tests := []struct {
		name   string
		metric string
		labels map[string]string
		want   float64
	}{
		{"IDs issued", "dispenser_ids_total", map[string]string{"transport": "nats", "endpoint": "segment", "tag": "orders"}, 6},
		{"good requests", "dispenser_requests_total", map[string]string{"transport": "nats", "endpoint": "segment", "tag": "orders", "code": "200"}, 2},
		{"unknown tag", "dispenser_requests_total", map[string]string{"transport": "nats", "endpoint": "segment", "tag": "", "code": "404"}, 1},
		{"bad count of a named tag", "dispenser_requests_total", map[string]string{"transport": "nats", "endpoint": "segment", "tag": "orders", "code": "400"}, 1},
		{"fetches", "dispenser_segment_fetches_total", map[string]string{"tag": "orders"}, 1},
		{"step", "dispenser_segment_step", map[string]string{"tag": "orders"}, 100},
		{"latency samples", "dispenser_request_duration_seconds", map[string]string{"transport": "nats", "endpoint": "segment"}, 4},
	}
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, ok := metricValue(families, tt.metric, tt.labels)
			if !ok || got != tt.want {
				t.Fatalf("%s%v = %v (found %v), want %v", tt.metric, tt.labels, got, ok, tt.want)
			}
		})
	}
}

// TestRequestsDuringStartAreCounted: requests that arrive while New is
// still setting up (here: snowflake requests sent back to back from before
// it starts) are answered and counted; run under -race. Before, New set up
// its metrics after the snowflake endpoint took requests, a data race that
// a chaos worker's race detector caught.
func TestRequestsDuringStartAreCounted(t *testing.T) {
	ns := testenv.NATS(t)
	nc := testenv.Connect(t, ns)
	stop := make(chan struct{})
	answered := make(chan int)
	go func() {
		n := 0
		for {
			select {
			case <-stop:
				answered <- n
				return
			default:
			}
			if resp, err := nc.Request("id.snowflake", nil, time.Second); err == nil && resp.Header.Get("Nats-Service-Error-Code") == "" {
				n++
			}
		}
	}()
	reg := prometheus.NewPedanticRegistry()
	svc, err := dispenser.New(dispenser.Config{Conn: testenv.Connect(t, ns), Snowflake: countingSnowflake{}, Logger: quiet, Registerer: reg})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { svc.Stop(context.Background()) })
	wait.For(t, 30*time.Second, "a snowflake request counted", func() bool {
		fams, err := reg.Gather()
		v, ok := metricValue(fams, "dispenser_requests_total", map[string]string{"transport": "nats", "endpoint": "snowflake", "tag": "", "code": "200"})
		return err == nil && ok && v > 0
	})
	close(stop)
	if n := <-answered; n == 0 {
		t.Fatal("no snowflake request answered")
	}
}

// countingSnowflake hands out 1, 2, 3, ...
type countingSnowflake struct{}

var countingSeq atomic.Int64

func (countingSnowflake) AppendIDs(dst []int64, n int) ([]int64, error) {
	for range n {
		dst = append(dst, countingSeq.Add(1))
	}
	return dst, nil
}
func (countingSnowflake) Unavailable(error) bool   { return false }
func (countingSnowflake) Epoch() time.Time         { return snowflake.DefaultEpoch }
func (countingSnowflake) Layout() snowflake.Layout { return snowflake.DefaultLayout }
func (countingSnowflake) Stats() any               { return nil }

// TestTimesWithinTheRequests: the processing time in $SRV.STATS and the
// request durations of the metrics are those of the requests: more than
// zero, and no more than the time the test took to send them and get
// every reply, within which all of it happened. The requests are counted,
// the bad one as an error with its last error. There are more of them than
// a subscription times one by one when the service has no metrics
// (afterwards it times a sample): with metrics every request is timed,
// its latency from its own start.
func TestTimesWithinTheRequests(t *testing.T) {
	ns := testenv.NATS(t)
	reg := prometheus.NewPedanticRegistry()
	svc, err := dispenser.New(dispenser.Config{Conn: testenv.Connect(t, ns), Snowflake: countingSnowflake{}, Logger: quiet, Registerer: reg})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { svc.Stop(context.Background()) })
	nc := testenv.Connect(t, ns)
	const requests = 2000
	began := time.Now()
	for range requests - 1 {
		if _, code := request(t, nc, "id.snowflake", "3", nil); code != "" {
			t.Fatalf("code %s", code)
		}
	}
	if _, code := request(t, nc, "id.snowflake", "zero", nil); code != "400" {
		t.Fatalf("a bad count: code %q, want 400", code)
	}
	window := time.Since(began)

	resp, err := nc.Request("$SRV.STATS."+dispenser.Name, nil, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	var st micro.Stats
	if err := json.Unmarshal(resp.Data, &st); err != nil {
		t.Fatal(err)
	}
	var ep *micro.EndpointStats
	for _, e := range st.Endpoints {
		if e.Name == "snowflake" {
			ep = e
		}
	}
	if ep == nil {
		t.Fatalf("no snowflake endpoint in %s", resp.Data)
	}
	if ep.NumRequests != requests || ep.NumErrors != 1 || !strings.HasPrefix(ep.LastError, "400:") {
		t.Errorf("requests %d, errors %d, last error %q; want %d, 1, 400:...", ep.NumRequests, ep.NumErrors, ep.LastError, requests)
	}
	if ep.ProcessingTime <= 0 || ep.ProcessingTime > window {
		t.Errorf("processing time %v, want more than 0 and at most the %v the requests took", ep.ProcessingTime, window)
	}
	if want := ep.ProcessingTime / requests; ep.AverageProcessingTime != want {
		t.Errorf("average processing time %v, want %v", ep.AverageProcessingTime, want)
	}

	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var h *dto.Histogram
	for _, f := range families {
		for _, m := range f.GetMetric() {
			if f.GetName() == "dispenser_request_duration_seconds" && m.GetHistogram() != nil &&
				slices.ContainsFunc(m.GetLabel(), func(l *dto.LabelPair) bool { return l.GetName() == "endpoint" && l.GetValue() == "snowflake" }) {
				h = m.GetHistogram()
			}
		}
	}
	if h == nil {
		t.Fatal("no request duration of the snowflake endpoint")
	}
	if sum := time.Duration(h.GetSampleSum() * float64(time.Second)); h.GetSampleCount() != requests || sum <= 0 || sum > window {
		t.Errorf("request durations: %d samples summing to %v, want %d summing to more than 0 and at most %v", h.GetSampleCount(), sum, requests, window)
	}
}
