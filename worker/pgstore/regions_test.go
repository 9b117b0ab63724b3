package pgstore_test

import (
	"context"
	"errors"
	"log/slog"
	"testing"

	"github.com/nats-io/nats.go"

	"github.com/dispenser-dev/dispenser/client"
	"github.com/dispenser-dev/dispenser/dispenser"
	"github.com/dispenser-dev/dispenser/internal/tests/testdb"
	"github.com/dispenser-dev/dispenser/tagmodel"
	"github.com/dispenser-dev/dispenser/testenv"
	"github.com/dispenser-dev/dispenser/worker"
	"github.com/dispenser-dev/dispenser/worker/pgstore"
)

// TestSharedModeRollbackCaughtInEveryRegion: in shared region mode (one
// database for every region) a rollback of the database is caught before
// any region serves a segment again, whichever region served it first.
// Region 0 hands out IDs, the database loses its writes (max_id lowered,
// as a failover to a replica that missed them would), then region 1, whose
// worker never fetched the tag, asks for IDs: none may be one of region
// 0's. Before shared mode had one witness for all regions, region 1's
// witness (dispenser_witness_r1) had no mark and region 1 handed out 1..25
// again.
func TestSharedModeRollbackCaughtInEveryRegion(t *testing.T) {
	ns := testenv.NATS(t)
	db := testdb.New(t, map[string]int64{"orders": 10})
	ctx := context.Background()
	take := func(r int, prefix string) []int64 {
		t.Helper()
		if err := startRegion(t, ns.ClientURL(), db.URL, worker.Config{Prefix: prefix, Region: worker.Region{N: r, Bits: 1}}); err != nil {
			t.Fatalf("region %d: %v", r, err)
		}
		nc, err := nats.Connect(ns.ClientURL())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(nc.Close)
		cl, err := client.New(nc, client.WithPrefix(prefix), client.WithoutRetries())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(cl.Close)
		got, err := cl.SegmentN(ctx, "orders", 25)
		if err != nil {
			t.Fatalf("region %d: %v", r, err)
		}
		return got
	}
	// Two prefixes, so that each region's client reaches its own region's
	// worker on the one NATS server (in a supercluster the queue group
	// does that by itself).
	first := take(0, "r0")
	if _, err := db.Pool.Exec(ctx, "UPDATE leaf_alloc SET max_id = 1 WHERE biz_tag = 'orders'"); err != nil {
		t.Fatal(err)
	}
	second := take(1, "r1")
	seen := map[int64]bool{}
	for _, id := range first {
		seen[id] = true
	}
	var twice []int64
	for _, id := range second {
		if seen[id] {
			twice = append(twice, id)
		}
	}
	if len(twice) > 0 {
		t.Fatalf("region 1 handed out %d of region 0's IDs again after the rollback (%v): its witness never saw them", len(twice), twice)
	}
}

// TestSharedModeRegionWitnessRefused: in shared mode a worker whose witness
// bucket is not its peers' (here one named for its region by hand) is
// refused by the peer check, whatever its region: a witness that sees only
// one region's segments lets another region serve them again after a
// rollback. Before, the witness part of the store's name was not compared
// between regions and the worker served.
func TestSharedModeRegionWitnessRefused(t *testing.T) {
	ns := testenv.NATS(t)
	db := testdb.New(t, map[string]int64{"orders": 10})
	if err := startRegion(t, ns.ClientURL(), db.URL, worker.Config{Region: worker.Region{N: 0, Bits: 1}}); err != nil {
		t.Fatalf("region 0: %v", err)
	}
	cfg := worker.Config{Region: worker.Region{N: 1, Bits: 1}}
	cfg.Store = pgstore.Postgres{URL: db.URL, WitnessBucket: "dispenser_witness_r1"}
	if err := startRegion(t, ns.ClientURL(), db.URL, cfg); !errors.Is(err, dispenser.ErrPeerMismatch) {
		t.Fatalf("region 1 with a witness of its own: %v, want %v", err, dispenser.ErrPeerMismatch)
	}
	if err := startRegion(t, ns.ClientURL(), db.URL, worker.Config{Region: worker.Region{N: 1, Bits: 1}}); err != nil {
		t.Fatalf("region 1 with the default witness: %v, want it to serve", err)
	}
}

// startRegion starts a worker of cfg on the NATS server at natsURL and the
// database at pgURL (unless cfg names a store), without snowflake.
func startRegion(tb testing.TB, natsURL, pgURL string, cfg worker.Config) error {
	tb.Helper()
	cfg.NATS = worker.NATS{URL: natsURL}
	if cfg.Store == nil {
		cfg.Store = pgstore.Postgres{URL: pgURL}
	}
	cfg.NoSnowflake = true
	cfg.Logger = slog.New(slog.DiscardHandler)
	w, err := worker.New(context.Background(), cfg)
	if err != nil {
		return err
	}
	tb.Cleanup(func() { w.Close() })
	return nil
}

// TestRegionSettingsOfOneStore: a worker without regions and a worker of
// per-region mode never serve one store together, whichever starts first,
// even under two prefixes (the peer check does not span them) and on a
// store that was empty when the first started. Both serving hands out the
// same IDs: the first hands out the store's values v, the second v×2+1.
// Before every worker recorded its region settings, the one without
// regions recorded nothing on the empty store, the per-region one then
// recorded its own and both served: the same IDs went to both.
func TestRegionSettingsOfOneStore(t *testing.T) {
	plain := worker.Region{}
	perRegion := worker.Region{N: 1, Count: 2}
	for _, tt := range []struct {
		name          string
		first, second worker.Region
	}{
		{"without regions first", plain, perRegion},
		{"per-region first", perRegion, plain},
	} {
		t.Run(tt.name, func(t *testing.T) {
			ns := testenv.NATS(t)
			db := testdb.New(t, nil)
			ctx := context.Background()
			if err := startRegion(t, ns.ClientURL(), db.URL, worker.Config{Prefix: "a", Region: tt.first}); err != nil {
				t.Fatalf("first worker: %v", err)
			}
			err := startRegion(t, ns.ClientURL(), db.URL, worker.Config{Prefix: "b", Region: tt.second})
			if errors.Is(err, tagmodel.ErrRegionMismatch) {
				return // refused at start: nothing served twice
			}
			if err != nil {
				t.Fatalf("second worker: %v, want it refused with %v", err, tagmodel.ErrRegionMismatch)
			}
			// Both serve: a tag created now is handed out by both.
			if err := db.Store.CreateTag(ctx, tagmodel.Tag{Name: "orders", Step: 10, MaxID: 1}); err != nil {
				t.Fatal(err)
			}
			clients := map[string]*client.Client{}
			for _, prefix := range []string{"a", "b"} {
				nc := testenv.Connect(t, ns)
				cl, err := client.New(nc, client.WithPrefix(prefix), client.WithoutRetries())
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(cl.Close)
				clients[prefix] = cl
			}
			// The per-region worker's IDs run at twice the store's
			// values: the other's catch up with them as it hands out more.
			owner := map[int64]string{}
			for range 20 {
				for _, take := range []struct {
					prefix string
					n      int
				}{{"b", 20}, {"a", 200}} {
					prefix := take.prefix
					ids, err := clients[prefix].SegmentN(ctx, "orders", take.n)
					if err != nil {
						t.Fatalf("worker %s: %v", prefix, err)
					}
					for _, id := range ids {
						if o, ok := owner[id]; ok {
							t.Fatalf("second worker started (%+v, then %+v) and ID %d went to worker %s and worker %s", tt.first, tt.second, id, o, prefix)
						}
						owner[id] = prefix
					}
				}
			}
			t.Fatalf("second worker started beside the first with other region settings (%+v, %+v); no ID twice in %d, but nothing keeps them apart", tt.first, tt.second, len(owner))
		})
	}
}
