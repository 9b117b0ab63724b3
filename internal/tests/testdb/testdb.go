// Package testdb is the PostgreSQL fixture of dispenser's tests: a database
// with the schema (postgres.Migrate) and the tags a test names.
//
// It lives apart from testenv because it imports schema and
// segment/postgres, whose own tests import testenv: testenv importing them
// would be an import cycle. Tests of schema itself test Migrate and do not
// use it.
package testdb

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/dispenser-dev/dispenser/segment/postgres"
	"github.com/dispenser-dev/dispenser/tagmodel"
	"github.com/dispenser-dev/dispenser/testenv"
)

// setupTimeout bounds migrating a database and creating its tags.
const setupTimeout = time.Minute

// DB is a migrated database of testenv's shared PostgreSQL server.
type DB struct {
	URL   string          // connection URL of the database
	Pool  *pgxpool.Pool   // closed in Cleanup
	Store *postgres.Store // a segment store over Pool
}

// New creates a new database on the server testenv.Postgres uses, brings its
// schema up to date and creates tags, name → step, each starting at ID 1;
// those named in ordered are ordered tags. The package's TestMain must call
// testenv.Run. The pool closes and the database is dropped in Cleanup.
func New(tb testing.TB, tags map[string]int64, ordered ...string) *DB {
	tb.Helper()
	url := testenv.Postgres(tb)
	pool, err := pgxpool.New(context.Background(), url)
	if err != nil {
		tb.Fatalf("testdb: pgxpool.New: %v", err)
	}
	tb.Cleanup(pool.Close)
	db := &DB{URL: url, Pool: pool, Store: postgres.New(pool)}
	setUp(tb, db.Store, tags, ordered)
	return db
}

// Setup does what New does to the existing database at url, for a test that
// runs its own server (testenv.StartPostgresCluster): it migrates it and
// creates tags. It closes its connections before it returns, so that the
// test may stop the server in any shutdown mode.
func Setup(tb testing.TB, url string, tags map[string]int64, ordered ...string) {
	tb.Helper()
	pool, err := pgxpool.New(context.Background(), url)
	if err != nil {
		tb.Fatalf("testdb: pgxpool.New: %v", err)
	}
	defer pool.Close()
	setUp(tb, postgres.New(pool), tags, ordered)
}

// setUp migrates st's database and creates tags in it.
func setUp(tb testing.TB, st *postgres.Store, tags map[string]int64, ordered []string) {
	tb.Helper()
	for _, name := range ordered {
		if _, ok := tags[name]; !ok {
			tb.Fatalf("testdb: ordered tag %q is not among the tags", name)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), setupTimeout)
	defer cancel()
	if _, err := postgres.Migrate(ctx, st.Pool()); err != nil {
		tb.Fatalf("testdb: postgres.Migrate: %v", err)
	}
	for name, step := range tags {
		t := tagmodel.Tag{Name: name, Step: step, MaxID: 1, Ordered: slices.Contains(ordered, name)}
		if err := st.CreateTag(ctx, t); err != nil {
			tb.Fatalf("testdb: CreateTag(%+v): %v", t, err)
		}
	}
}
