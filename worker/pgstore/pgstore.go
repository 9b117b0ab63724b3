// Package pgstore opens a worker's PostgreSQL segment store (package
// segment/postgres), behind the failover witness (package segment/witness)
// unless told otherwise. It is a package of its own so that the worker
// package, and with it dispensertest, does not depend on pgx.
package pgstore

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/dispenser-dev/dispenser/segment/postgres"
	"github.com/dispenser-dev/dispenser/worker"
)

// ErrNoURL means Postgres.URL is empty.
var ErrNoURL = errors.New("pgstore: no PostgreSQL URL")

// Postgres opens the PostgreSQL segment store (table leaf_alloc) at URL:
// a worker.StoreOpener.
type Postgres struct {
	// URL is the database's URL; several hosts with
	// target_session_attrs=read-write follow a failover. Required.
	URL string
	// Migrate applies the migrations before the store is used; without it
	// a database that lacks migrations of this version is refused.
	Migrate bool
	// NoWitness opens the store without the witness: a failover to a
	// replica that missed writes, or a restored backup, can then hand out
	// IDs twice. Default false: every segment is recorded in the witness
	// bucket before it is served.
	NoWitness bool
	// WitnessBucket is the witness's JetStream KV bucket. Default
	// witness.DefaultBucket.
	WitnessBucket string
	// WitnessReplicas are the replicas of the witness bucket when it is
	// created, and the fewest an existing one may have. Default 1.
	WitnessReplicas int
}

// Validate implements worker.StoreOpener.
func (p Postgres) Validate() error {
	switch {
	case p.URL == "":
		return ErrNoURL
	case p.WitnessReplicas < 0 || p.WitnessReplicas > 5:
		return fmt.Errorf("%w: --witness-replicas %d: want 1..5", worker.ErrConfig, p.WitnessReplicas)
	}
	return nil
}

// OpenStore implements worker.StoreOpener. A database that cannot be
// reached now is not an error: the worker starts without it, and its
// fetches fail until it is back.
func (p Postgres) OpenStore(ctx context.Context, js jetstream.JetStream, env worker.StoreEnv) (_ *worker.Store, err error) {
	if err := p.Validate(); err != nil {
		return nil, err
	}
	pool, err := pgxpool.New(ctx, p.URL)
	if err != nil {
		return nil, fmt.Errorf("postgres: %w", err)
	}
	defer func() {
		if err != nil {
			pool.Close()
		}
	}()
	if p.Migrate {
		applied, err := postgres.Migrate(ctx, pool)
		if err != nil {
			return nil, err
		}
		env.Logger.Info("migrations applied", "versions", applied)
	}
	// A worker of this version needs every migration it knows: refuse to
	// start (with what to run) rather than fail every fetch. A database
	// that cannot be reached now is not checked: the worker starts without
	// it, as always (its fetches fail until it is back).
	missing, err := postgres.Missing(ctx, pool)
	reachable := err == nil
	if err != nil {
		env.Logger.Warn("postgres: cannot check the schema version now; starting anyway", "err", err)
	} else if len(missing) > 0 {
		return nil, fmt.Errorf("postgres: the database lacks migrations %v of this version: run `dispenser migrate --postgres-url …` (or serve --migrate) first", missing)
	}
	pg := postgres.New(pool)
	st := &worker.Store{Store: pg, Admin: pg, Name: Name(pool), Close: pool.Close}
	if reachable { // else peers are told apart by address only (Name)
		if st.ID, err = ID(ctx, pool); err != nil {
			env.Logger.Warn("postgres: cannot read the database's identity; peers are compared by address", "err", err)
			st.ID, err = "", nil
		}
	}
	if p.NoWitness {
		env.Logger.Warn("--witness=false: a failover of PostgreSQL to a replica that missed writes, or a restored backup, can hand out IDs twice")
		return st, nil
	}
	if err := env.Witness(ctx, js, st, pg, p.WitnessBucket, p.WitnessReplicas); err != nil {
		return nil, err
	}
	return st, nil
}

// Name identifies the database of pool: its hosts and database name.
func Name(pool *pgxpool.Pool) string {
	pc := pool.Config().ConnConfig
	hosts := fmt.Sprintf("%s:%d", pc.Host, pc.Port)
	for _, fb := range pc.Fallbacks {
		if a := fmt.Sprintf("%s:%d", fb.Host, fb.Port); !strings.Contains(","+hosts+",", ","+a+",") {
			hosts += "," + a
		}
	}
	return fmt.Sprintf("postgres:%s/%s", hosts, pc.Database)
}

// ID identifies the database of pool whichever address reaches it: its
// cluster's system identifier, which a streaming replica shares with its
// primary (so a failover keeps it), and the database name.
func ID(ctx context.Context, pool *pgxpool.Pool) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	var system, db string
	err := pool.QueryRow(ctx, "SELECT system_identifier::text, current_database() FROM pg_control_system()").Scan(&system, &db)
	if err != nil {
		return "", fmt.Errorf("postgres: reading the system identifier: %w", err)
	}
	return "postgres-system:" + system + "/" + db, nil
}

// Connect connects to the database at url and checks that it answers: for
// the admin commands and the bench, which act at once, unlike a worker.
func Connect(ctx context.Context, url string) (*pgxpool.Pool, error) {
	if url == "" {
		return nil, ErrNoURL
	}
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		return nil, fmt.Errorf("postgres: %w", err)
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		return nil, fmt.Errorf("postgres: %w", err)
	}
	return pool, nil
}
