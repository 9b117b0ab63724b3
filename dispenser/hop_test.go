package dispenser_test

import (
	"testing"

	"github.com/nats-io/nats.go"

	"github.com/dispenser-dev/dispenser/dispenser"
	"github.com/dispenser-dev/dispenser/protocol"
	"github.com/dispenser-dev/dispenser/segment"
	"github.com/dispenser-dev/dispenser/testenv"
)

// TestForgedHopIgnored: Id-Hop is the workers' own. A requester that puts
// a worker's service ID in it (which $SRV.INFO and Id-Worker tell anyone),
// or anything else, gets its IDs from a worker that can serve it, as any
// request: the worker neither hands it on nor leaves a queue group. Before,
// a worker took a request naming its ID for one it had handed on itself
// and could not serve: a segment request bounced through the queue group
// up to 16 times and got 503; a snowflake request made the worker leave
// the snowflake queue group and got 503.
func TestForgedHopIgnored(t *testing.T) {
	st := newStack(t, map[string]int64{"orders": 10})
	seg := st.worker(t, segment.Settings{}).svc
	sf := startSnowflakeService(t, st.ns, &servableSnowflake{downSnowflake: newDownSnowflake(t, 1)})
	nc := testenv.Connect(t, st.ns)
	for _, tt := range []struct {
		endpoint, subject string
		svc               *dispenser.Service
	}{
		{"segment", "id.segment.orders", seg},
		{"snowflake", "id.snowflake", sf},
	} {
		t.Run(tt.endpoint, func(t *testing.T) {
			id := tt.svc.ID()
			for _, hops := range []string{id, id + "," + id, "a,b", "a,b,c", id + ",x,y,z"} {
				body, code := request(t, nc, tt.subject, "", nats.Header{protocol.HopHeader: []string{hops}})
				if code != "" {
					t.Fatalf("Id-Hop %q: code %s (%s), want IDs", hops, code, body)
				}
				parseIDs(t, body)
			}
			if n := dispenser.HandedOff(tt.svc); n != 0 {
				t.Errorf("handed on %d requests, want 0", n)
			}
			if !tt.svc.Serving()[tt.endpoint] {
				t.Errorf("the worker left the %s queue group", tt.endpoint)
			}
		})
	}
}
