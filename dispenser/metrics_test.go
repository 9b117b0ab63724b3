package dispenser_test

import (
	"context"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/dispenser-dev/dispenser/dispenser"
	"github.com/dispenser-dev/dispenser/segment"
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
		{"IDs issued", "dispenser_ids_total", map[string]string{"endpoint": "segment", "tag": "orders"}, 6},
		{"good requests", "dispenser_requests_total", map[string]string{"endpoint": "segment", "tag": "orders", "code": "200"}, 2},
		{"unknown tag", "dispenser_requests_total", map[string]string{"endpoint": "segment", "tag": "", "code": "404"}, 1},
		{"bad count of a named tag", "dispenser_requests_total", map[string]string{"endpoint": "segment", "tag": "orders", "code": "400"}, 1},
		{"fetches", "dispenser_segment_fetches_total", map[string]string{"tag": "orders"}, 1},
		{"step", "dispenser_segment_step", map[string]string{"tag": "orders"}, 100},
		{"latency samples", "dispenser_request_duration_seconds", map[string]string{"endpoint": "segment"}, 4},
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
