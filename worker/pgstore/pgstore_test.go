package pgstore_test

import (
	"context"
	"errors"
	"log/slog"
	"net/url"
	"os"
	"testing"

	"github.com/dispenser-dev/dispenser/dispenser"
	"github.com/dispenser-dev/dispenser/internal/tests/faultnet"
	"github.com/dispenser-dev/dispenser/internal/tests/testdb"
	"github.com/dispenser-dev/dispenser/testenv"
	"github.com/dispenser-dev/dispenser/worker"
	"github.com/dispenser-dev/dispenser/worker/pgstore"
)

func TestMain(m *testing.M) { os.Exit(testenv.Run(m)) }

// TestPeersByDatabaseNotAddress: workers of one queue group that reach one
// database by different addresses (here directly and through a proxy)
// serve together; a worker of another database is refused, as before.
// Before the database's identity (its system identifier) was published,
// the second worker was refused: the peer check compared addresses.
func TestPeersByDatabaseNotAddress(t *testing.T) {
	ns := testenv.NATS(t)
	db := testdb.New(t, map[string]int64{"a": 100})
	direct, err := url.Parse(db.URL)
	if err != nil {
		t.Fatal(err)
	}
	proxied := *direct
	proxied.Host = faultnet.New(t).Link(t, "pg", direct.Host).Addr()
	start := func(pgURL string) error {
		t.Helper()
		w, err := worker.New(context.Background(), worker.Config{
			NATS:        worker.NATS{URL: ns.ClientURL()},
			Store:       pgstore.Postgres{URL: pgURL},
			NoSnowflake: true,
			Logger:      slog.New(slog.DiscardHandler),
		})
		if err == nil {
			t.Cleanup(func() { w.Close() })
		}
		return err
	}
	if err := start(direct.String()); err != nil {
		t.Fatalf("first worker: %v", err)
	}
	if err := start(proxied.String()); err != nil {
		t.Fatalf("worker reaching the same database through a proxy: %v, want it to serve", err)
	}
	other := testdb.New(t, map[string]int64{"a": 100})
	if err := start(other.URL); !errors.Is(err, dispenser.ErrPeerMismatch) {
		t.Fatalf("worker of another database: %v, want %v", err, dispenser.ErrPeerMismatch)
	}
}

// TestID: a database's identity is the same by every address and differs
// between databases.
func TestID(t *testing.T) {
	a, b := testdb.New(t, nil), testdb.New(t, nil)
	idA, err := pgstore.ID(context.Background(), a.Pool)
	if err != nil {
		t.Fatal(err)
	}
	idB, err := pgstore.ID(context.Background(), b.Pool)
	if err != nil {
		t.Fatal(err)
	}
	if idA == idB || idA == "" {
		t.Fatalf("IDs of two databases: %q and %q, want two different ones", idA, idB)
	}
}
