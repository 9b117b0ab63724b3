package postgres_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/dispenser-dev/dispenser/segment/postgres"
	"github.com/dispenser-dev/dispenser/segment/storetest"
	"github.com/dispenser-dev/dispenser/tagmodel"
)

// deletable adds the DeleteTag and PutLegacyTag that the conformance suite
// needs; the Store itself has neither.
type deletable struct{ *postgres.Store }

// PutLegacyTag inserts a row as Leaf does, naming only its own columns, so
// that ordered stays NULL.
func (s deletable) PutLegacyTag(ctx context.Context, name string, maxID, step int64) error {
	_, err := s.Pool().Exec(ctx, "INSERT INTO leaf_alloc (biz_tag, max_id, step, description) VALUES ($1, $2, $3, NULL)", name, maxID, step)
	return err
}

func (s deletable) DeleteTag(ctx context.Context, name string) error {
	if err := tagmodel.CheckTag(name); err != nil {
		return fmt.Errorf("postgres: delete tag: %w", err)
	}
	ct, err := s.Pool().Exec(ctx, "DELETE FROM leaf_alloc WHERE biz_tag = $1", name)
	if err != nil {
		return fmt.Errorf("postgres: delete tag %q: %w", name, err)
	}
	if ct.RowsAffected() == 0 {
		return fmt.Errorf("postgres: delete tag %q: %w", name, tagmodel.ErrUnknownTag)
	}
	return nil
}

func TestConformance(t *testing.T) {
	storetest.Run(t, storetest.Config{
		NewBackend: func(tb testing.TB) func(testing.TB) storetest.Store {
			tb.Helper()
			url := newDB(tb)
			// Each Store has a pool of its own, as another process would.
			return func(tb testing.TB) storetest.Store {
				tb.Helper()
				return deletable{postgres.New(newPool(tb, url))}
			}
		},
		Prefix: "postgres: ",
	})
}
