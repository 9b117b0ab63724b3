// Package mysqlstore opens a worker's MySQL/MariaDB segment store (package
// segment/mysql, on Leaf's leaf_alloc table), behind the failover witness
// (package segment/witness) unless told otherwise. It is a package of its
// own so that the worker package, and with it dispensertest, does not
// depend on the MySQL driver. It also reads Leaf's leaf_alloc for
// `dispenser tags import` and imports its rows into a store
// (ReadLeafRows, ImportLeafRow).
package mysqlstore

import (
	"context"
	"database/sql"
	"errors"
	"fmt"

	driver "github.com/go-sql-driver/mysql"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/dispenser-dev/dispenser/segment/mysql"
	"github.com/dispenser-dev/dispenser/worker"
)

// ErrNoDSN means MySQL.DSN is empty.
var ErrNoDSN = errors.New("mysqlstore: no MySQL DSN")

// MySQL opens the MySQL segment store (table leaf_alloc, and dispenser's
// dispenser_tag and dispenser_period) at DSN: a worker.StoreOpener.
type MySQL struct {
	// DSN is the go-sql-driver DSN of the database, such as
	// user:password@tcp(host:3306)/leaf. Required.
	DSN string
	// Migrate creates the missing tables (mysql.Migrate) before the store
	// is used; without it a database that lacks them is refused.
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
func (m MySQL) Validate() error {
	switch {
	case m.DSN == "":
		return ErrNoDSN
	case m.WitnessReplicas < 0 || m.WitnessReplicas > 5:
		return fmt.Errorf("%w: --witness-replicas %d: want 1..5", worker.ErrConfig, m.WitnessReplicas)
	}
	if _, err := mysql.OpenDB(m.DSN); err != nil {
		return fmt.Errorf("%w: --mysql-url: %w", worker.ErrConfig, err)
	}
	return nil
}

// OpenStore implements worker.StoreOpener. A database that cannot be
// reached now is not an error: the worker starts without it, and its
// fetches fail until it is back.
func (m MySQL) OpenStore(ctx context.Context, js jetstream.JetStream, env worker.StoreEnv) (_ *worker.Store, err error) {
	if err := m.Validate(); err != nil {
		return nil, err
	}
	db, err := mysql.OpenDB(m.DSN)
	if err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			db.Close()
		}
	}()
	if m.Migrate {
		created, err := mysql.Migrate(ctx, db)
		if err != nil {
			return nil, err
		}
		env.Logger.Info("mysql: tables created", "tables", created)
	}
	// Refuse to start (with what to run) rather than fail every fetch. A
	// database that cannot be reached now is not checked.
	if missing, err := mysql.Missing(ctx, db); err != nil {
		env.Logger.Warn("mysql: cannot check the tables now; starting anyway", "err", err)
	} else if len(missing) > 0 {
		return nil, fmt.Errorf("mysql: the database lacks the tables %v: run `dispenser migrate --mysql-url …` (or serve --migrate) first", missing)
	}
	my := mysql.New(db)
	st := &worker.Store{Store: my, Admin: my, Name: Name(m.DSN), Close: func() { db.Close() }}
	if m.NoWitness {
		env.Logger.Warn("--witness=false: a failover of MySQL to a replica that missed writes, or a restored backup, can hand out IDs twice")
		return st, nil
	}
	if err := env.Witness(ctx, js, st, my, m.WitnessBucket, m.WitnessReplicas); err != nil {
		return nil, err
	}
	return st, nil
}

// Name identifies the database of dsn: its address and database name
// (never the password).
func Name(dsn string) string {
	cfg, err := driver.ParseDSN(dsn)
	if err != nil {
		return "mysql:?"
	}
	return fmt.Sprintf("mysql:%s(%s)/%s", cfg.Net, cfg.Addr, cfg.DBName)
}

// Connect opens the database at dsn (mysql.OpenDB) and checks that it
// answers: for the admin commands, which act at once, unlike a worker.
func Connect(ctx context.Context, dsn string) (*sql.DB, error) {
	if dsn == "" {
		return nil, ErrNoDSN
	}
	db, err := mysql.OpenDB(dsn)
	if err != nil {
		return nil, err
	}
	if err := db.PingContext(ctx); err != nil {
		db.Close()
		return nil, fmt.Errorf("mysql: %w", err)
	}
	return db, nil
}
