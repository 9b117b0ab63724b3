package dispenser_test

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/dispenser-dev/dispenser/dispenser"
	"github.com/dispenser-dev/dispenser/segment"
	"github.com/dispenser-dev/dispenser/segment/kv"
	"github.com/dispenser-dev/dispenser/tagmodel"
	"github.com/dispenser-dev/dispenser/testenv"
)

// peerSetup starts workers on one embedded nats-server; each is named by
// its store and queue group only (the store behind is the same KV bucket).
type peerSetup struct {
	ns    *server.Server
	store tagmodel.Store
}

func newPeerSetup(t *testing.T) *peerSetup {
	t.Helper()
	ns := testenv.NATS(t)
	js, err := jetstream.New(testenv.Connect(t, ns))
	if err != nil {
		t.Fatal(err)
	}
	st, err := kv.New(context.Background(), js, kv.Settings{})
	if err != nil {
		t.Fatal(err)
	}
	return &peerSetup{ns: ns, store: st}
}

// start starts a worker that says it uses store, in queue group, on subject
// prefix ("": the default); it returns New's error. store is a name, or a
// name and an ID: "name|id".
func (p *peerSetup) start(t *testing.T, store, group, prefix string) error {
	store, id, _ := strings.Cut(store, "|")
	return p.startWith(t, dispenser.Config{Store: store, StoreID: id, QueueGroup: group, Prefix: prefix})
}

// startWith starts a worker with cfg's store, queue group and region over
// the setup's store and server; it returns New's error.
func (p *peerSetup) startWith(t *testing.T, cfg dispenser.Config) error {
	alloc, err := segment.New(segment.Settings{Store: p.store, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		return err
	}
	cfg.Conn, cfg.Segments, cfg.PeerCheck, cfg.Logger = testenv.Connect(t, p.ns), alloc, time.Second, slog.New(slog.DiscardHandler)
	svc, err := dispenser.New(cfg)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if svc != nil {
			_ = svc.Stop(ctx)
		}
		_ = alloc.Close(ctx)
	})
	return err
}

// TestPeerOfAnotherStoreRefused: a worker does not join a queue group whose
// workers use another store (both would hand out the same IDs), also when
// both start at the same instant; the same store is fine. Nor does it start
// in another queue group on the same prefix, whatever its store: NATS hands
// every request to a worker of each group, so both answer it, each with
// IDs of its own (from two stores, the same IDs). Another prefix is fine.
func TestPeerOfAnotherStoreRefused(t *testing.T) {
	tests := []struct {
		name         string
		first, other string // stores
		group        string // the other's queue group
		prefix       string // the other's subject prefix ("": the default)
		together     bool   // started at the same instant
		wantRefused  bool
	}{
		{name: "another store", first: "kv:a", other: "kv:b", wantRefused: true},
		{name: "another store, started together", first: "kv:a", other: "kv:b", together: true, wantRefused: true},
		{name: "same store", first: "kv:a", other: "kv:a"},
		{name: "same store, started together", first: "kv:a", other: "kv:a", together: true},
		{name: "another queue group", first: "kv:a", other: "kv:b", group: "others", wantRefused: true},
		{name: "another queue group, started together", first: "kv:a", other: "kv:b", group: "others", together: true, wantRefused: true},
		{name: "another queue group, same store", first: "kv:a", other: "kv:a", group: "others", wantRefused: true},
		{name: "another queue group and prefix", first: "kv:a", other: "kv:b", group: "others", prefix: "other"},
		{name: "another prefix", first: "kv:a", other: "kv:b", prefix: "other"},
		// With both IDs known, the IDs decide; else the names do (a peer
		// of an earlier version publishes no ID).
		{name: "same ID, other name", first: "pg:host-a|db1", other: "pg:host-b|db1"},
		{name: "same ID, other name, started together", first: "pg:host-a|db1", other: "pg:host-b|db1", together: true},
		{name: "other ID, same name", first: "pg:host-a|db1", other: "pg:host-a|db2", wantRefused: true},
		{name: "one ID unknown, other name", first: "pg:host-a|db1", other: "pg:host-b", wantRefused: true},
		{name: "one ID unknown, same name", first: "pg:host-a", other: "pg:host-a|db1"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel() // each case on servers of its own
			// Starting together is a race: run it a few times. The rounds
			// run at the same time, each on a server of its own: a round
			// mostly waits (a worker that is not refused waits PeerCheck
			// twice, for its peers' info and for their tags).
			const rounds = 5
			setups := make([]*peerSetup, rounds)
			for round := range setups {
				setups[round] = newPeerSetup(t)
			}
			errs := make([][2]error, rounds)
			var wg sync.WaitGroup
			for round, p := range setups {
				wg.Go(func() {
					group := fmt.Sprintf("g%d", round)
					otherGroup := group
					if tt.group != "" {
						otherGroup = tt.group
					}
					if tt.together {
						var wg sync.WaitGroup
						ready := make(chan struct{})
						for i, st := range []string{tt.first, tt.other} {
							g, pf := []string{group, otherGroup}[i], []string{"", tt.prefix}[i]
							wg.Go(func() {
								<-ready
								errs[round][i] = p.start(t, st, g, pf)
							})
						}
						close(ready)
						wg.Wait()
					} else {
						errs[round][0] = p.start(t, tt.first, group, "")
						errs[round][1] = p.start(t, tt.other, otherGroup, tt.prefix)
					}
				})
			}
			wg.Wait()
			for round := range rounds {
				refused := 0
				for _, err := range errs[round] {
					switch {
					case errors.Is(err, dispenser.ErrPeerMismatch):
						refused++
					case err != nil:
						t.Fatalf("round %d: unexpected error %v", round, err)
					}
				}
				if got := refused > 0; got != tt.wantRefused {
					t.Fatalf("round %d: errors %v; want a refusal: %v", round, errs[round], tt.wantRefused)
				}
				if !tt.together && errs[round][0] != nil {
					t.Fatalf("round %d: the worker that ran first was refused: %v", round, errs[round][0])
				}
			}
		})
	}
}

// TestPeersOfRegions: workers of other regions may use their own stores
// (per-region mode), but never other region settings, and in shared mode
// never a witness of their own (a region's witness would not know what
// other regions served from the shared store); within a region, the rules
// of one region hold.
func TestPeersOfRegions(t *testing.T) {
	perRegion := func(n int) dispenser.Region {
		return dispenser.Region{N: n, Bits: 1, Count: 2} // "1 region bits, 2 regions": own stores, own leases
	}
	shared := func(n int) dispenser.Region {
		return dispenser.Region{N: n, Bits: 1} // "1 region bits, 1 regions": own leases
	}
	type peer struct {
		store, id string
		region    dispenser.Region
	}
	tests := []struct {
		name        string
		first, next peer
		wantRefused bool
	}{
		{"per-region stores of two regions", peer{"kv:segments_r0", "", perRegion(0)}, peer{"kv:segments_r1", "", perRegion(1)}, false},
		{"per-region: two stores in one region", peer{"kv:segments_r0", "", perRegion(0)}, peer{"kv:segments_r1", "", perRegion(0)}, true},
		{"shared store, one witness", peer{"pg:db witness:w", "pg-id witness:w", shared(0)}, peer{"pg:db witness:w", "pg-id witness:w", shared(1)}, false},
		{"shared store, own witnesses", peer{"pg:db witness:w_r0", "pg-id witness:w_r0", shared(0)}, peer{"pg:db witness:w_r1", "pg-id witness:w_r1", shared(1)}, true},
		{"shared mode, two stores", peer{"pg:db witness:w", "pg-id witness:w", shared(0)}, peer{"pg:other witness:w", "other-id witness:w", shared(1)}, true},
		{"shared mode, one region, two witnesses", peer{"pg:db witness:w_r0", "pg-id witness:w_r0", shared(0)}, peer{"pg:db witness:w_r1", "pg-id witness:w_r1", shared(0)}, true},
		{"other region settings", peer{"kv:segments_r0", "", perRegion(0)}, peer{"kv:segments_r1", "", dispenser.Region{N: 1, Bits: 2, Count: 2}}, true},
		{"regions and none", peer{"kv:segments", "", dispenser.Region{}}, peer{"kv:segments_r1", "", perRegion(1)}, true},
	}
	// The cases run at the same time, each on a server of its own: a case
	// mostly waits (a worker that is not refused waits PeerCheck twice).
	// Then each case's subtest checks what its workers' New returned.
	errs := make([][2]error, len(tests))
	var wg sync.WaitGroup
	for i, tt := range tests {
		p := newPeerSetup(t)
		wg.Go(func() {
			for j, pr := range []peer{tt.first, tt.next} {
				errs[i][j] = p.startWith(t, dispenser.Config{Store: pr.store, StoreID: pr.id, Region: pr.region})
			}
		})
	}
	wg.Wait()
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if errs[i][0] != nil {
				t.Fatalf("the first worker was refused: %v", errs[i][0])
			}
			if refused := errors.Is(errs[i][1], dispenser.ErrPeerMismatch); refused != tt.wantRefused {
				t.Fatalf("second worker: %v; want refused %v", errs[i][1], tt.wantRefused)
			}
		})
	}
}

// TestPeerOfOtherOwnersRefused: workers of one queue group that record the
// owners of ordered tags in different buckets would each own an ordered
// tag at once and serve it from their own segments, out of order; the
// second one refuses to start. Per-region mode has a bucket per region.
func TestPeerOfOtherOwnersRefused(t *testing.T) {
	perRegion := func(n int) dispenser.Region { return dispenser.Region{N: n, Bits: 1, Count: 2} }
	shared := func(n int) dispenser.Region { return dispenser.Region{N: n, Bits: 1} }
	type peer struct {
		owners, group, prefix, store string
		region                       dispenser.Region
	}
	tests := []struct {
		name        string
		first, next peer
		wantRefused bool
	}{
		{name: "another bucket", first: peer{owners: "owners@a"}, next: peer{owners: "owners@b"}, wantRefused: true},
		{name: "the bucket recreated", first: peer{owners: "owners@2026-11-28T10:00:00Z"}, next: peer{owners: "owners@2026-11-28T11:00:00Z"},
			wantRefused: true},
		{name: "same bucket", first: peer{owners: "owners@a"}, next: peer{owners: "owners@a"}},
		{name: "another queue group and prefix", first: peer{owners: "owners@a"}, next: peer{owners: "owners@b", group: "others", prefix: "others"}},
		{name: "a worker without ordered tags", first: peer{owners: "owners@a"}, next: peer{}},
		{name: "beside a worker without ordered tags", first: peer{}, next: peer{owners: "owners@b"}},
		{name: "shared mode, two regions", first: peer{owners: "owners@a", region: shared(0)},
			next: peer{owners: "owners@b", region: shared(1)}, wantRefused: true},
		{name: "per-region mode, two regions", first: peer{owners: "owners_r0@a", store: "kv:segments_r0", region: perRegion(0)},
			next: peer{owners: "owners_r1@b", store: "kv:segments_r1", region: perRegion(1)}},
		{name: "per-region mode, one region", first: peer{owners: "owners_r0@a", store: "kv:segments_r0", region: perRegion(0)},
			next: peer{owners: "owners_r1@b", store: "kv:segments_r0", region: perRegion(0)}, wantRefused: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel() // each case on a server of its own
			p := newPeerSetup(t)
			var errs []error
			for _, pr := range []peer{tt.first, tt.next} {
				errs = append(errs, p.startWith(t, dispenser.Config{Store: cmp.Or(pr.store, "kv:segments"), OwnersBucket: pr.owners,
					QueueGroup: pr.group, Prefix: pr.prefix, Region: pr.region}))
			}
			if errs[0] != nil {
				t.Fatalf("the first worker was refused: %v", errs[0])
			}
			refused := errors.Is(errs[1], dispenser.ErrPeerMismatch)
			if refused != tt.wantRefused {
				t.Fatalf("second worker: %v; want refused %v", errs[1], tt.wantRefused)
			}
			if refused && !strings.Contains(errs[1].Error(), "--ordered-bucket") {
				t.Errorf("refusal %q does not name --ordered-bucket", errs[1])
			}
		})
	}
}
