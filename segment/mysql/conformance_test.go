package mysql_test

import (
	"context"
	"database/sql"
	"fmt"
	"os"
	"testing"

	"github.com/dispenser-dev/dispenser/segment/mysql"
	"github.com/dispenser-dev/dispenser/segment/storetest"
	"github.com/dispenser-dev/dispenser/tagmodel"
	"github.com/dispenser-dev/dispenser/testenv"
)

func TestMain(m *testing.M) { os.Exit(testenv.Run(m)) }

var ctx = context.Background()

// newDB returns the DSN of a new database with the tables.
func newDB(tb testing.TB) string {
	tb.Helper()
	dsn := testenv.MySQL(tb)
	db := openDB(tb, dsn)
	if _, err := mysql.Migrate(ctx, db); err != nil {
		tb.Fatalf("Migrate: %v", err)
	}
	return dsn
}

// openDB opens a handle on dsn (mysql.OpenDB) and closes it in Cleanup.
func openDB(tb testing.TB, dsn string) *sql.DB {
	tb.Helper()
	db, err := mysql.OpenDB(dsn)
	if err != nil {
		tb.Fatalf("OpenDB: %v", err)
	}
	tb.Cleanup(func() { db.Close() })
	return db
}

// deletable adds the DeleteTag and PutLegacyTag that the conformance suite
// needs; the Store itself has neither.
type deletable struct{ *mysql.Store }

// PutLegacyTag inserts a row as Leaf's scripts do, naming only Leaf's
// columns of leaf_alloc, and nothing in dispenser's tables.
func (s deletable) PutLegacyTag(ctx context.Context, name string, maxID, step int64) error {
	_, err := s.DB().ExecContext(ctx, "INSERT INTO leaf_alloc (biz_tag, max_id, step, description) VALUES (?, ?, ?, NULL)", name, maxID, step)
	return err
}

// DeleteTag deletes Leaf's row only, as an operator of Leaf would: the
// store must cope with the dispenser_tag row left behind.
func (s deletable) DeleteTag(ctx context.Context, name string) error {
	if err := tagmodel.CheckTag(name); err != nil {
		return fmt.Errorf("mysql: delete tag: %w", err)
	}
	res, err := s.DB().ExecContext(ctx, "DELETE FROM leaf_alloc WHERE biz_tag = ? AND CAST(biz_tag AS BINARY) = ?", name, name)
	if err != nil {
		return fmt.Errorf("mysql: delete tag %q: %w", name, err)
	}
	if n, err := res.RowsAffected(); err != nil || n == 0 {
		return fmt.Errorf("mysql: delete tag %q: %w (%v)", name, tagmodel.ErrUnknownTag, err)
	}
	return nil
}

func TestConformance(t *testing.T) {
	storetest.Run(t, storetest.Config{
		NewBackend: func(tb testing.TB) func(testing.TB) storetest.Store {
			tb.Helper()
			dsn := newDB(tb)
			// Each Store has a handle of its own, as another process would.
			return func(tb testing.TB) storetest.Store {
				tb.Helper()
				return deletable{mysql.New(openDB(tb, dsn))}
			}
		},
		Prefix: "mysql: ",
		// Leaf may serve leaf_alloc (TestPerRegionRefusedBesideLeaf).
		NoPerRegion: true,
	})
}
