package chaos

import (
	"bytes"
	"context"
	"fmt"
	"net/url"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/dispenser-dev/dispenser/internal/tests/testdb"
	"github.com/dispenser-dev/dispenser/internal/tests/wait"
	"github.com/dispenser-dev/dispenser/testenv"
)

// postgresPair starts a PostgreSQL primary and an asynchronous streaming
// replica of it (testenv.PostgresPair), creates a migrated database with
// tags (those in ordered ordered) on the primary, waits until the replica
// has replayed it, and returns both and the database's name.
func postgresPair(tb testing.TB, tags map[string]int64, ordered ...string) (primary, replica *testenv.PostgresCluster, db string) {
	tb.Helper()
	primary, replica = testenv.PostgresPair(tb)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	dbURL, err := primary.CreateDatabase(ctx)
	if err != nil {
		tb.Fatal(err)
	}
	u, err := url.Parse(dbURL)
	if err != nil {
		tb.Fatal(err)
	}
	db = strings.TrimPrefix(u.Path, "/")
	testdb.Setup(tb, dbURL, tags, ordered...)
	if err := replica.WaitReplayed(ctx, primary); err != nil {
		tb.Fatal(err)
	}
	return primary, replica, db
}

// maxIDs reads every tag's max_id from database db of cluster pg.
func maxIDs(ctx context.Context, pg *testenv.PostgresCluster, db string) (map[string]int64, error) {
	conn, err := pgx.Connect(ctx, pg.URL(db))
	if err != nil {
		return nil, err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	rows, err := conn.Query(ctx, "SELECT biz_tag, max_id FROM leaf_alloc")
	if err != nil {
		return nil, err
	}
	out := map[string]int64{}
	for rows.Next() {
		var tag string
		var v int64
		if err := rows.Scan(&tag, &v); err != nil {
			return nil, err
		}
		out[tag] = v
	}
	return out, rows.Err()
}

// streaming reports nil once the replica's WAL receiver streams.
func streaming(ctx context.Context, replica *testenv.PostgresCluster) error {
	conn, err := pgx.Connect(ctx, replica.URL("postgres"))
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	var status string
	if err := conn.QueryRow(ctx, "SELECT coalesce((SELECT status FROM pg_stat_wal_receiver), '')").Scan(&status); err != nil {
		return err
	}
	if status != "streaming" {
		return fmt.Errorf("replica on port %d: WAL receiver %q, want streaming", replica.Port(), status)
	}
	return nil
}

// failoverLag is how many IDs of tag small the replica must have missed
// when pg-failover stops the primary: four segments of the largest step.
const failoverLag = 4 * chaosMaxStep

// rollbackMsg is what the witness logs when it catches a store that lost
// writes.
const rollbackMsg = "the segment store lost writes"

// pgFailover fails PostgreSQL over to a replica that missed the last
// fetches: it cuts replication, makes the workers fetch segments from the
// primary (the test spends segments of tag small until the primary's
// max_id of small moved past the replica's), stops the primary at once
// (pg_ctl stop -m immediate) and promotes the replica, which the workers'
// multi-host URL then finds. The witness must catch the rollback: a worker
// logs that the segment store lost writes (the test spends segments until
// a worker fetches from the promoted replica). From then on the promoted
// replica is the primary that the other PostgreSQL faults break; there is
// no replica left, so the fault removes itself from c.faults and happens
// at most once per run.
//
// The effect to observe: after the cut, max_id of small on the primary
// moved more than failoverLag past the replica's, and then a worker logged
// the rollback.
func (c *chaos) pgFailover(name string) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	c.faults = slices.DeleteFunc(c.faults, func(f fault) bool { return f.name == name })
	// CutReplication needs a streaming replica; after another PostgreSQL
	// fault the WAL receiver comes back within wal_retrieve_retry_interval.
	if err := wait.Until(30*time.Second, func() error { return streaming(ctx, c.replica) }); err != nil {
		c.t.Fatalf("%s: %v within 30s", name, err)
	}
	rollbacks := func() (n int) {
		for _, p := range c.fleet.all() {
			b, _ := os.ReadFile(p.log)
			n += bytes.Count(b, []byte(rollbackMsg))
		}
		return n
	}
	before := rollbacks()
	w := c.log.begin(name)
	if err := c.replica.CutReplication(ctx); err != nil {
		c.t.Fatal(err)
	}
	atCut, err := maxIDs(ctx, c.pg, c.db)
	if err != nil {
		c.t.Fatal(err)
	}
	// Fetches the replica misses: more than a few segments of the
	// largest step, so that the fetches from the promoted replica that the
	// witness refuses cannot close the gap before a worker raises max_id
	// above the mark: the witness logs a rollback only if max_id is still
	// below the mark when it raises it.
	var primaryMax, replicaMax int64
	fetched := wait.Until(30*time.Second, func() error {
		c.spender.request(500)
		p, err := maxIDs(ctx, c.pg, c.db)
		if err != nil {
			return err
		}
		r, err := maxIDs(ctx, c.replica, c.db)
		if err != nil {
			return err
		}
		primaryMax, replicaMax = p["small"], r["small"]
		if primaryMax-replicaMax <= failoverLag {
			return fmt.Errorf("max_id of small: primary %d, replica %d", primaryMax, replicaMax)
		}
		return nil
	})
	if err := c.pg.Stop("immediate"); err != nil {
		c.t.Fatal(err)
	}
	if err := c.replica.Promote(ctx); err != nil {
		c.t.Fatal(err)
	}
	c.pg, c.replica = c.replica, nil
	// The rollback must be caught when a worker fetches from the new
	// primary.
	caught := wait.Until(30*time.Second, func() error {
		if rollbacks() > before {
			return nil
		}
		c.spender.request(500)
		return fmt.Errorf("no worker logged %q", rollbackMsg)
	})
	c.log.end(w)
	switch {
	case fetched != nil:
		c.t.Errorf("%s: the replica did not fall %d IDs of small behind the primary within 30s of the cut (max_id %d at the cut): %v",
			name, failoverLag, atCut["small"], fetched)
	case caught != nil:
		c.t.Errorf("%s: the promoted replica's rollback was not caught within 30s: %v", name, caught)
	default:
		c.log.observed(w, "max_id of small on the primary %d -> %d after the cut, replica at %d; promoted; %d rollback(s) logged",
			atCut["small"], primaryMax, replicaMax, rollbacks()-before)
	}
	c.logf("%s: the replica on port %d is the primary now", name, c.pg.Port())
}
