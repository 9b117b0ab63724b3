package dispenser

import (
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/micro"

	"github.com/dispenser-dev/dispenser/testenv"
)

// reacquiringOwners owns every ordered tag; its Owns call number at (from
// when it was armed) first runs reset, as the loss and a new claim of the
// tag between a take and the check after it would (each Resets the tag's
// buffers).
type reacquiringOwners struct {
	fixedOwners
	calls atomic.Int32
	at    atomic.Int32 // 0: not armed
	reset func()
}

func (o *reacquiringOwners) Owns(string) bool {
	if n := o.calls.Add(1); n == o.at.Load() {
		o.reset()
	}
	return true
}

// arm makes call number at of Owns from now on run reset first.
func (o *reacquiringOwners) arm(at int32) { o.at.Store(o.calls.Load() + at) }

// TestOwnerReclaimedBetweenTakeAndCheck: the check after taking finds the
// tag owned, but by an ownership claimed after the IDs were taken (the tag
// was lost and claimed again in between: its buffers were Reset). The IDs
// came from a buffer of the ownership that ended, perhaps below IDs
// another owner handed out meanwhile: they are skipped and the request is
// served from a segment fetched after the Reset. Seen failing with
// takeOwned and park checking only Owns: "taken from memory: got 2" and
// "waited for a segment: got 1".
func TestOwnerReclaimedBetweenTakeAndCheck(t *testing.T) {
	tests := []struct {
		name string
		// before is how many requests come before the one whose
		// check finds the tag claimed anew; at is that check's
		// number among its Owns calls.
		before int
		at     int32
	}{
		// The first request's checks: reroute's before taking (1), and
		// the one after its wait for the first segment (2).
		{name: "waited for a segment", before: 0, at: 2},
		// Served from memory: the check after taking is its only one.
		{name: "taken from memory", before: 1, at: 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			owners := &reacquiringOwners{}
			ns, svc := orderedService(t, owners, 0)
			owners.reset = func() { svc.cfg.Segments.Reset("seq") }
			nc := testenv.Connect(t, ns)
			for i := range tt.before {
				if resp, err := nc.Request("id.segment.seq", nil, 10*time.Second); err != nil || string(resp.Data) != "1" {
					t.Fatalf("request %d: %v %v, want ID 1", i, resp, err)
				}
			}
			owners.arm(tt.at)
			resp, err := nc.Request("id.segment.seq", nil, 10*time.Second)
			if err != nil {
				t.Fatal(err)
			}
			if code := resp.Header.Get(micro.ErrorCodeHeader); code != "" {
				t.Fatalf("%s %s, want an ID", code, resp.Header.Get(micro.ErrorHeader))
			}
			if got := string(resp.Data); got != "1001" {
				t.Fatalf("got %s, want 1001: the first ID of a segment fetched after the Reset (1..1000 came before it)", got)
			}
		})
	}
}
