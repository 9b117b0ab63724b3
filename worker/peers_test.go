package worker_test

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"testing"

	"github.com/dispenser-dev/dispenser/dispenser"
	"github.com/dispenser-dev/dispenser/snowflake"
	"github.com/dispenser-dev/dispenser/testenv"
	"github.com/dispenser-dev/dispenser/worker"
)

// TestWorkersOfOtherOwnersRefused: a worker does not join a queue group
// whose workers record the owners of ordered tags in another bucket: each
// would own an ordered tag at once and serve it, from its own segments,
// out of order. With the same bucket, or in another queue group and
// prefix, it starts.
func TestWorkersOfOtherOwnersRefused(t *testing.T) {
	ns := testenv.NATS(t)
	start := func(group, owners string) error {
		prefix := ""
		if group != "" {
			prefix = group
		}
		w, err := worker.New(context.Background(), worker.Config{
			NATS: worker.NATS{URL: ns.ClientURL()}, Prefix: prefix, QueueGroup: group, Owners: worker.Owners{Bucket: owners},
			Logger: slog.New(slog.DiscardHandler),
		})
		if err == nil {
			t.Cleanup(func() { w.Close() })
		}
		return err
	}
	if err := start("", ""); err != nil {
		t.Fatalf("first worker: %v", err)
	}
	err := start("", "other_owners")
	if !errors.Is(err, dispenser.ErrPeerMismatch) || !strings.Contains(err.Error(), "--ordered-bucket") {
		t.Fatalf("a worker with another --ordered-bucket: %v, want %v naming --ordered-bucket", err, dispenser.ErrPeerMismatch)
	}
	if err := start("", ""); err != nil {
		t.Fatalf("a second worker with the same bucket: %v", err)
	}
	if err := start("others", "other_owners"); err != nil {
		t.Fatalf("another queue group and prefix with another bucket: %v", err)
	}
}

// TestRegionBitsBesideWorkersWithout: a worker with --region-bits leases
// from its region's bucket, whose worker IDs the bucket without region
// bits holds too; beside a running worker without region bits (another
// queue group and prefix, which the peer check does not compare) it is
// refused, for the two could hold the same worker ID at once. (Before,
// it started: both held worker ID candidates of 0..511, leased from
// buckets that know nothing of each other.)
func TestRegionBitsBesideWorkersWithout(t *testing.T) {
	ns := testenv.NATS(t)
	w, err := worker.New(context.Background(), worker.Config{NATS: worker.NATS{URL: ns.ClientURL()}, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatalf("worker without regions: %v", err)
	}
	t.Cleanup(func() { w.Close() })
	r, err := worker.New(context.Background(), worker.Config{NATS: worker.NATS{URL: ns.ClientURL()}, Prefix: "r", QueueGroup: "r",
		Region: worker.Region{Bits: 1}, Logger: slog.New(slog.DiscardHandler)})
	if err == nil {
		r.Close()
	}
	if !errors.Is(err, snowflake.ErrPredecessorInUse) {
		t.Fatalf("worker with --region-bits 1 beside one without: %v, want %v", err, snowflake.ErrPredecessorInUse)
	}
}

// TestRegionBitsDifferBetweenRegions: region 1's first worker with other
// region bits than region 0's is refused, although the peer check does
// not see region 0's workers (another queue group and prefix here; a cut
// between the regions, or region 0 stopped, in a supercluster).
func TestRegionBitsDifferBetweenRegions(t *testing.T) {
	ns := testenv.NATS(t)
	start := func(prefix string, r worker.Region) error {
		w, err := worker.New(context.Background(), worker.Config{NATS: worker.NATS{URL: ns.ClientURL()}, Prefix: prefix, QueueGroup: prefix,
			Region: r, Logger: slog.New(slog.DiscardHandler)})
		if err == nil {
			t.Cleanup(func() { w.Close() })
		}
		return err
	}
	if err := start("r0", worker.Region{N: 0, Bits: 1}); err != nil {
		t.Fatalf("region 0: %v", err)
	}
	if err := start("r1", worker.Region{N: 1, Bits: 2}); !errors.Is(err, snowflake.ErrLayoutMismatch) {
		t.Fatalf("region 1 with --region-bits 2 beside region 0 with 1: %v, want %v", err, snowflake.ErrLayoutMismatch)
	}
}

// TestNoRegionBitsBesideRegions: the other way round from
// TestRegionBitsBesideWorkersWithout: once region 0 leases from its
// bucket, a worker without region bits (another queue group and prefix)
// is refused: it would lease worker IDs of region 0 from a bucket that
// knows nothing of region 0's leases.
func TestNoRegionBitsBesideRegions(t *testing.T) {
	ns := testenv.NATS(t)
	r, err := worker.New(context.Background(), worker.Config{NATS: worker.NATS{URL: ns.ClientURL()}, Prefix: "r", QueueGroup: "r",
		Region: worker.Region{Bits: 1}, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatalf("region 0: %v", err)
	}
	t.Cleanup(func() { r.Close() })
	w, err := worker.New(context.Background(), worker.Config{NATS: worker.NATS{URL: ns.ClientURL()}, Logger: slog.New(slog.DiscardHandler)})
	if err == nil {
		w.Close()
	}
	if !errors.Is(err, snowflake.ErrRegionBuckets) {
		t.Fatalf("worker without region bits beside region 0: %v, want %v", err, snowflake.ErrRegionBuckets)
	}
}
