package dispenser_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

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
