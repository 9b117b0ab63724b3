package dispenser_test

import (
	"context"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/micro"

	"github.com/dispenser-dev/dispenser/tagmodel"
	"github.com/dispenser-dev/dispenser/testenv"
)

// TestOwnerPastItsLeaseServesNothingFromIt: an owner whose lease ran out
// by its wall clock (as after a suspend), before any check noticed, still
// routes its own requests to itself (Owners.Cached reads no clock until a
// check finds the lease run out) and takes IDs for them, but serves none:
// Owns after taking fails, the IDs are skipped and the request is routed
// again (safety argument, 3). The request gets an error, or an ID of a
// segment fetched after the worker claimed the tag anew; never an ID of
// the segment it held when its lease ran out.
func TestOwnerPastItsLeaseServesNothingFromIt(t *testing.T) {
	st := newStack(t, nil)
	if err := st.store.CreateTag(context.Background(), tagmodel.Tag{Name: "seq", Step: 100, MaxID: 1, Ordered: true}); err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex // protects wall
	wall := time.Now()
	w := st.orderedWorker(t, "w0", func(o *orderedOptions) {
		o.owners.Now = func() time.Time { mu.Lock(); defer mu.Unlock(); return wall }
		// No renewal while the test runs.
		o.owners.Lease, o.owners.Heartbeat = 5*time.Minute, 4*time.Minute
	})
	nc := testenv.Connect(t, st.ns)
	if resp, err := nc.Request("id.segment.seq", nil, 10*time.Second); err != nil || string(resp.Data) != "1" {
		t.Fatalf("first request, as the owner: %v %v, want ID 1", resp, err)
	}
	held := w.rec.allocs["seq"][0]
	mu.Lock()
	wall = wall.Add(6 * time.Minute) // a suspend: the wall clock is past the lease
	mu.Unlock()
	resp, err := nc.Request("id.segment.seq", nil, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if code := resp.Header.Get(micro.ErrorCodeHeader); code != "" {
		t.Logf("answered %s %s", code, resp.Header.Get(micro.ErrorHeader))
		return
	}
	id, err := strconv.ParseInt(string(resp.Data), 10, 64)
	if err != nil {
		t.Fatalf("reply %q: %v", resp.Data, err)
	}
	if id >= held.Start && id < held.End {
		t.Fatalf("served ID %d of the segment [%d, %d) it held when its lease ran out", id, held.Start, held.End)
	}
	t.Logf("served ID %d after claiming the tag anew (claims %d)", id, w.owners.Stats().Claims)
}
