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

func TestFits(t *testing.T) {
	tests := []struct {
		name       string
		maxPayload int64
		format     protocol.Format
		want       int
	}{
		{"default server, list", 1 << 20, protocol.FormatList, (1<<20 - replyHeaderRoom) / 20},
		{"default server, range", 1 << 20, protocol.FormatRange, (1<<20 - replyHeaderRoom) / 40},
		{"tiny server", 512, protocol.FormatList, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := fits(tt.maxPayload, tt.format); got != tt.want {
				t.Fatalf("fits(%d, %v) = %d, want %d", tt.maxPayload, tt.format, got, tt.want)
			}
			// The worst reply of that many IDs, with its headers, fits.
			n := fits(tt.maxPayload, tt.format)
			worst := 0
			for i := range n {
				id := int64(1<<63-1) - int64(i)
				if tt.format == protocol.FormatRange {
					worst += len(protocol.AppendRanges(nil, []protocol.Run{{First: id, Last: id}})) + 1
				} else {
					worst += len(protocol.AppendIDs(nil, []int64{id})) + 1
				}
			}
			if worst+replyHeaderRoom > int(tt.maxPayload) && n > 0 {
				t.Fatalf("the worst reply of %d IDs is %d bytes: does not fit in %d with headers", n, worst, tt.maxPayload)
			}
		})
	}
}

// TestProtocolHeadersAreMicros: the protocol's error headers are those of
// NATS micro services, which the service sets through req.Error.
func TestProtocolHeadersAreMicros(t *testing.T) {
	if protocol.ErrorCodeHeader != micro.ErrorCodeHeader || protocol.ErrorHeader != micro.ErrorHeader {
		t.Fatalf("protocol headers %q, %q; micro's %q, %q", protocol.ErrorCodeHeader, protocol.ErrorHeader, micro.ErrorCodeHeader, micro.ErrorHeader)
	}
}
