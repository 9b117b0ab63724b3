package worker_test

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"testing"

	"github.com/dispenser-dev/dispenser/dispenser"
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
