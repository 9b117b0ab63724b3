package dispenser_test

import (
	"context"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/dispenser-dev/dispenser/ownership"
	"github.com/dispenser-dev/dispenser/segment"
	"github.com/dispenser-dev/dispenser/testenv"
)

// resets records the allocator's resets and whether the worker owned the
// tag at each.
type resets struct {
	mu     sync.Mutex // protects owned
	owned  []bool
	leases *ownership.Leases
}

func (r *resets) TakeOwned(string, int, []segment.Run) ([]segment.Run, segment.Source, *segment.Pending, error) {
	return nil, segment.Source{}, nil, nil
}
func (r *resets) Plain(string) bool      { return false }
func (r *resets) MaxWait() time.Duration { return time.Second }
func (r *resets) Reset(tag string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.owned = append(r.owned, r.leases != nil && r.leases.Owns(tag))
}

// TestOpenLeasesResetsOnAcquireAndLoss: the leases ownership.Open opens reset
// the tag's buffers when this worker gains the tag, before it owns it, and
// when it loses it, after it stopped owning it. Seen failing with
// the reset on claiming left unwired and with the reset moved
// after the lease became visible (Owns true at the reset).
func TestOpenLeasesResetsOnAcquireAndLoss(t *testing.T) {
	ns := testenv.NATS(t)
	js, err := jetstream.New(testenv.Connect(t, ns))
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	alloc := &resets{}
	leases, err := ownership.Open(ctx, js, alloc, ownership.Settings{Owner: "w1", Subject: "id.owner.w1",
		Lease: time.Second, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(leases.Close)
	alloc.mu.Lock()
	alloc.leases = leases
	alloc.mu.Unlock()
	if rt, err := leases.Claim(ctx, "seq"); err != nil || !rt.Self {
		t.Fatalf("Claim: %+v, %v; want Self", rt, err)
	}
	leases.Release("seq")
	alloc.mu.Lock()
	defer alloc.mu.Unlock()
	if want := []bool{false, false}; len(alloc.owned) != len(want) || alloc.owned[0] || alloc.owned[1] {
		t.Fatalf("resets, and whether the tag was owned at each: %v, want %v (one on the claim before it shows, one on the release after)", alloc.owned, want)
	}
}
