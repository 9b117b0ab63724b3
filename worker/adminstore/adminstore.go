// Package adminstore opens the segment store of dispenser's admin
// commands (tags list, create, update and import) as a worker would,
// except that PostgreSQL must answer now and the witness is only read.
// It is the store-opening part of those commands, apart from their flags
// (cmd/dispenser).
package adminstore

import (
	"context"
	"errors"
	"fmt"
	"log/slog"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/dispenser-dev/dispenser/segment/mysql"
	"github.com/dispenser-dev/dispenser/segment/postgres"
	"github.com/dispenser-dev/dispenser/segment/witness"
	"github.com/dispenser-dev/dispenser/worker"
	"github.com/dispenser-dev/dispenser/worker/mysqlstore"
	"github.com/dispenser-dev/dispenser/worker/pgstore"
)

// Settings select the store of an admin command: the flags the admin
// commands share with serve.
type Settings struct {
	PostgresURL   string        // --postgres-url
	MySQLURL      string        // --mysql-url
	NATS          worker.NATS   // --nats-*
	Bucket        string        // --segment-bucket
	WitnessBucket string        // --witness-bucket
	Region        worker.Region // --region, --region-bits, --regions
	InboxPrefix   string        // --nats-inbox-prefix
}

// Marker reads the witness marks of tags.
type Marker interface {
	Mark(ctx context.Context, tag string) (mark int64, ok bool, err error)
}

// Open opens the selected store as a worker would, except that PostgreSQL
// must answer now and the witness is only read: with PostgreSQL and
// NATS.URL, w reads the marks of the existing witness bucket (else w is
// nil). close releases them. The caller has checked s.Region.
func Open(ctx context.Context, s Settings) (st *worker.Store, w Marker, close func(), err error) {
	f := &s
	if f.NATS, err = f.NATS.Resolve(); err != nil { // the context may give the URL
		return nil, nil, nil, err
	}
	var raiser witness.Raiser
	var closeDB func()
	switch {
	case f.PostgresURL != "" && f.MySQLURL != "":
		return nil, nil, nil, errors.New("--postgres-url and --mysql-url: give one segment store")
	case f.PostgresURL != "":
		pool, err := OpenPostgres(ctx, f.PostgresURL)
		if err != nil {
			return nil, nil, nil, err
		}
		pg := postgres.New(pool)
		st, raiser, closeDB = &worker.Store{Store: pg, Admin: pg, Name: pgstore.Name(pool)}, pg, pool.Close
	case f.MySQLURL != "":
		db, err := mysqlstore.Connect(ctx, f.MySQLURL)
		if err != nil {
			return nil, nil, nil, err
		}
		my := mysql.New(db)
		st, raiser, closeDB = &worker.Store{Store: my, Admin: my, Name: mysqlstore.Name(f.MySQLURL)}, my, func() { db.Close() }
	}
	if raiser != nil {
		if f.NATS.URL == "" {
			return st, nil, closeDB, nil
		}
		nc, js, err := f.connect()
		if err != nil {
			closeDB()
			return nil, nil, nil, err
		}
		bucket := f.Region.Name(f.WitnessBucket, witness.DefaultBucket, f.Region.PerRegionStores())
		kvb, err := js.KeyValue(ctx, bucket)
		if err != nil {
			nc.Close()
			closeDB()
			return nil, nil, nil, refused(nc, fmt.Errorf("witness bucket %q: %w", bucket, err))
		}
		return st, witness.New(kvb, raiser, witness.Settings{}), func() { nc.Close(); closeDB() }, nil
	}
	if f.NATS.URL == "" {
		return nil, nil, nil, errors.New("set --postgres-url (PostgreSQL store), --mysql-url (MySQL store) or --nats-url (JetStream KV store)")
	}
	nc, js, err := f.connect()
	if err != nil {
		return nil, nil, nil, err
	}
	env := worker.StoreEnv{Logger: slog.Default(), Region: f.Region}
	if f.Region.PerRegionStores() {
		env.Cluster = nc.ConnectedClusterName()
	}
	if st, err = (worker.KV{Bucket: f.Bucket}).OpenStore(ctx, js, env); err != nil {
		nc.Close()
		return nil, nil, nil, refused(nc, err)
	}
	return st, nil, nc.Close, nil
}

// refused adds to err, when the server refused nc a permission, how to
// get the rights on a worker's embedded nats-server, which gives them to
// the worker's key only (worker.KeyFile).
func refused(nc *nats.Conn, err error) error {
	if last := nc.LastError(); errors.Is(last, nats.ErrPermissionViolation) {
		return fmt.Errorf("%w (%v: a worker's embedded nats-server lets only the worker's key administer it: add --nats-nkey DATA-DIR/%s, e.g. --nats-nkey ./dispenser-data/%s)", err, last, worker.KeyFile, worker.KeyFile)
	}
	return err
}

// connect connects to --nats-url.
func (f *Settings) connect() (*nats.Conn, jetstream.JetStream, error) {
	if err := worker.CheckInboxPrefix(f.InboxPrefix, ""); err != nil {
		return nil, nil, fmt.Errorf("--nats-inbox-prefix: %w", err)
	}
	var opts []nats.Option
	if f.InboxPrefix != "" {
		opts = append(opts, nats.CustomInboxPrefix(f.InboxPrefix))
	}
	nc, err := f.NATS.Connect("dispenser-admin", false, opts...)
	if err != nil {
		return nil, nil, err
	}
	js, err := jetstream.New(nc)
	if err != nil {
		nc.Close()
		return nil, nil, err
	}
	return nc, js, nil
}

// OpenPostgres connects to url and checks that the server answers.
func OpenPostgres(ctx context.Context, url string) (*pgxpool.Pool, error) {
	if url == "" {
		return nil, errors.New("set --postgres-url (env DISPENSER_POSTGRES_URL) or --mysql-url (env DISPENSER_MYSQL_URL)")
	}
	return pgstore.Connect(ctx, url)
}
