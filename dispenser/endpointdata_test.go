package dispenser_test

import (
	"encoding/json"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"
)

// endpointData asks subject ($SRV.STATS...) for micro stats and decodes
// the data of the endpoint named endpoint into data; it fails the test if
// there is none.
func endpointData(tb testing.TB, nc *nats.Conn, subject, endpoint string, data any) {
	tb.Helper()
	resp, err := nc.Request(subject, nil, 10*time.Second)
	if err != nil {
		tb.Fatal(err)
	}
	var stats micro.Stats
	if err := json.Unmarshal(resp.Data, &stats); err != nil {
		tb.Fatal(err)
	}
	for _, e := range stats.Endpoints {
		if e.Name == endpoint {
			if err := json.Unmarshal(e.Data, data); err != nil {
				tb.Fatalf("%s stats %s: %v", endpoint, e.Data, err)
			}
			return
		}
	}
	tb.Fatalf("no %s endpoint in %s", endpoint, resp.Data)
}
