package dispenser

import (
	"testing"
	"time"

	"github.com/nats-io/nats.go/micro"

	"github.com/dispenser-dev/dispenser/protocol"
)

func TestRateLimit(t *testing.T) {
	var l rateLimit
	t0 := time.Unix(1_000_000, 0)
	if ok, n := l.allow(t0); !ok || n != 0 {
		t.Fatalf("first event: got %v, %d; want logged, 0 suppressed", ok, n)
	}
	for i := range 5 {
		if ok, _ := l.allow(t0.Add(time.Duration(i) * time.Second)); ok {
			t.Fatalf("event %d within %v logged", i, refuseLogEvery)
		}
	}
	if ok, n := l.allow(t0.Add(refuseLogEvery)); !ok || n != 5 {
		t.Fatalf("event after %v: got %v, %d; want logged, 5 suppressed", refuseLogEvery, ok, n)
	}
}

// TestProtocolHeadersAreMicros: the protocol's error headers are those of
// NATS micro services, which the service sets on the error replies it
// publishes (replier.fail).
func TestProtocolHeadersAreMicros(t *testing.T) {
	if protocol.ErrorCodeHeader != micro.ErrorCodeHeader || protocol.ErrorHeader != micro.ErrorHeader {
		t.Fatalf("protocol headers %q, %q; micro's %q, %q", protocol.ErrorCodeHeader, protocol.ErrorHeader, micro.ErrorCodeHeader, micro.ErrorHeader)
	}
}
