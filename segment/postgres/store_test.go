package postgres_test

import (
	"cmp"
	"context"
	"errors"
	"math"
	"os"
	"slices"
	"strings"
	"testing"

	"github.com/dispenser-dev/dispenser/internal/tests/testdb"
	"github.com/dispenser-dev/dispenser/segment/postgres"
	"github.com/dispenser-dev/dispenser/tagmodel"
	"github.com/dispenser-dev/dispenser/testenv"
	"github.com/jackc/pgx/v5/pgxpool"
)

func TestMain(m *testing.M) { os.Exit(testenv.Run(m)) }

var ctx = context.Background()

// newDB returns the URL of a new database with the schema.
func newDB(tb testing.TB) string {
	tb.Helper()
	url := testenv.Postgres(tb)
	testdb.Setup(tb, url, nil)
	return url
}

// newPool opens a pool on url and closes it in Cleanup.
func newPool(tb testing.TB, url string) *pgxpool.Pool {
	tb.Helper()
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		tb.Fatalf("pgxpool.New: %v", err)
	}
	tb.Cleanup(pool.Close)
	return pool
}

// newStore returns a Store on a new database with the schema.
func newStore(tb testing.TB) *postgres.Store {
	tb.Helper()
	return testdb.New(tb, nil).Store
}

// createTag creates a tag and fails the test on error.
func createTag(tb testing.TB, s *postgres.Store, name string, step, start int64) {
	tb.Helper()
	if err := s.CreateTag(ctx, tagmodel.Tag{Name: name, Step: step, MaxID: start, Description: "test tag " + name}); err != nil {
		tb.Fatalf("CreateTag(%q, %d, %d): %v", name, step, start, err)
	}
}

// tag looks up a tag and fails the test on error.
func tag(tb testing.TB, s *postgres.Store, name string) tagmodel.Tag {
	tb.Helper()
	t, err := s.Tag(ctx, name)
	if err != nil {
		tb.Fatalf("Tag(%q): %v", name, err)
	}
	return t
}

// fetch fetches a segment and fails the test on error.
func fetch(tb testing.TB, s *postgres.Store, name string, step int64) tagmodel.Allocation {
	tb.Helper()
	a, err := s.Fetch(ctx, name, step)
	if err != nil {
		tb.Fatalf("Fetch(%q, %d): %v", name, step, err)
	}
	return a
}

// exec runs SQL directly on the Store's database.
func exec(tb testing.TB, s *postgres.Store, sql string, args ...any) {
	tb.Helper()
	if _, err := s.Pool().Exec(ctx, sql, args...); err != nil {
		tb.Fatalf("%s: %v", sql, err)
	}
}

// snapshot returns every row of leaf_alloc, every column, as text, so that
// tests can check that an operation changed nothing.
func snapshot(tb testing.TB, s *postgres.Store) string {
	tb.Helper()
	var rows []string
	err := s.Pool().QueryRow(ctx, `SELECT coalesce(array_agg(concat_ws('|', biz_tag, max_id, step, description, update_time) ORDER BY biz_tag), '{}') FROM leaf_alloc`).Scan(&rows)
	if err != nil {
		tb.Fatalf("snapshot: %v", err)
	}
	return strings.Join(rows, "\n")
}

// checkErr fails the test unless err wraps want and reads as a store error.
func checkErr(tb testing.TB, err, want error) {
	tb.Helper()
	if !errors.Is(err, want) {
		tb.Fatalf("got error %v, want %v", err, want)
	}
	if !strings.HasPrefix(err.Error(), "postgres: ") {
		tb.Errorf("error %q lacks the postgres: prefix", err)
	}
}

func TestFetchNonPositiveStoredStep(t *testing.T) {
	s := newStore(t)
	// A table inherited from Leaf may hold rows this store would not create.
	exec(t, s, "INSERT INTO leaf_alloc (biz_tag, max_id, step) VALUES ('zero', 100, 0), ('negative', 100, -5)")
	for _, name := range []string{"zero", "negative"} {
		before := snapshot(t, s)
		_, err := s.Fetch(ctx, name, 0)
		checkErr(t, err, tagmodel.ErrInvalidStep)
		if after := snapshot(t, s); after != before {
			t.Errorf("Fetch(%s, 0) changed the table:\nbefore:\n%s\nafter:\n%s", name, before, after)
		}
	}
	// An explicit step still works.
	if got, want := fetch(t, s, "zero", 5), (tagmodel.Allocation{Start: 100, End: 105, TagStep: 0}); got != want {
		t.Errorf("Fetch(zero, 5) = %+v, want %+v", got, want)
	}
}

// Leaf's segment mode may still run on the same table while a team moves
// off it. Leaf takes a segment with its own SQL, the tag's step or a custom
// one, and reads the row back in the same transaction: its segment is
// [max_id-step, max_id) of the row it read. The Store's segments and Leaf's
// must tile one range, and a give-back must not return what Leaf took.
func TestSharesTableWithLeaf(t *testing.T) {
	s := newStore(t)
	createTag(t, s, "orders", 10, 1)
	leafFetch := func(step int64) tagmodel.Allocation {
		t.Helper()
		tx, err := s.Pool().Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(ctx)
		update := "UPDATE leaf_alloc SET max_id = max_id + step WHERE biz_tag = $1"
		args := []any{"orders"}
		if step > 0 {
			update = "UPDATE leaf_alloc SET max_id = max_id + $2 WHERE biz_tag = $1"
			args = append(args, step)
		}
		if _, err := tx.Exec(ctx, update, args...); err != nil {
			t.Fatalf("Leaf's update: %v", err)
		}
		var maxID, tagStep int64
		if err := tx.QueryRow(ctx, "SELECT max_id, step FROM leaf_alloc WHERE biz_tag = $1", "orders").Scan(&maxID, &tagStep); err != nil {
			t.Fatalf("Leaf's select: %v", err)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		return tagmodel.Allocation{Start: maxID - cmp.Or(step, tagStep), End: maxID, TagStep: tagStep}
	}

	got := []tagmodel.Allocation{
		fetch(t, s, "orders", 0),
		leafFetch(0),
		fetch(t, s, "orders", 25),
		leafFetch(7),
		fetch(t, s, "orders", 0),
	}
	want := []tagmodel.Allocation{
		{Start: 1, End: 11, TagStep: 10},
		{Start: 11, End: 21, TagStep: 10},
		{Start: 21, End: 46, TagStep: 10},
		{Start: 46, End: 53, TagStep: 10},
		{Start: 53, End: 63, TagStep: 10},
	}
	if !slices.Equal(got, want) {
		t.Errorf("Store, Leaf, Store, Leaf, Store took %+v, want %+v", got, want)
	}

	a := fetch(t, s, "orders", 0)
	leafFetch(0)
	if ok, err := s.GiveBack(ctx, "orders", a.End, a.Start); ok || err != nil {
		t.Errorf("GiveBack after Leaf fetched = %v, %v, want false, nil", ok, err)
	}
	if got := tag(t, s, "orders").MaxID; got != a.End+10 {
		t.Errorf("max_id = %d, want %d, the end of Leaf's segment", got, a.End+10)
	}
}

// Leaf allows names that are no NATS subject token: the Store neither lists
// nor serves them, and leaves their rows alone.
func TestLeafNamesThatAreNoTags(t *testing.T) {
	s := newStore(t)
	createTag(t, s, "orders", 10, 1)
	exec(t, s, "INSERT INTO leaf_alloc (biz_tag, step) VALUES ('leaf.segment', 10), ('with space', 10), ('', 10)")
	if got, err := s.Tags(ctx); err != nil || !slices.Equal(got, []string{"orders"}) {
		t.Errorf("Tags() = %q, %v, want [orders]", got, err)
	}
	before := snapshot(t, s)
	for _, name := range []string{"leaf.segment", "with space", ""} {
		_, err := s.Fetch(ctx, name, 0)
		checkErr(t, err, tagmodel.ErrInvalidTag)
		_, err = s.Tag(ctx, name)
		checkErr(t, err, tagmodel.ErrInvalidTag)
		ok, err := s.GiveBack(ctx, name, 1, 1) // max_id is 1: would succeed
		checkErr(t, err, tagmodel.ErrInvalidTag)
		if ok {
			t.Errorf("GiveBack(%q) reported true with an error", name)
		}
		checkErr(t, s.UpdateTag(ctx, name, tagmodel.Update{}), tagmodel.ErrInvalidTag)
	}
	if after := snapshot(t, s); after != before {
		t.Errorf("operations on Leaf's names changed the table:\nbefore:\n%s\nafter:\n%s", before, after)
	}
}

// A row inherited from Leaf may have no description: it reads as "" and
// stays NULL until it is set, also when only the ordered flag is.
func TestNullDescription(t *testing.T) {
	s := newStore(t)
	exec(t, s, "INSERT INTO leaf_alloc (biz_tag, max_id, step, description) VALUES ('legacy', 77, 5, NULL)")
	if got := tag(t, s, "legacy"); got.Name != "legacy" || got.MaxID != 77 || got.Step != 5 || got.Description != "" || got.UpdateTime.IsZero() {
		t.Errorf("Tag(legacy) = %+v, want max_id 77, step 5, empty description, an update time", got)
	}
	if got, want := fetch(t, s, "legacy", 0), (tagmodel.Allocation{Start: 77, End: 82, TagStep: 5}); got != want {
		t.Errorf("Fetch(legacy, 0) = %+v, want %+v", got, want)
	}
	step := int64(8)
	if err := s.UpdateTag(ctx, "legacy", tagmodel.Update{Step: &step}); err != nil {
		t.Fatal(err)
	}
	var isNull bool
	if err := s.Pool().QueryRow(ctx, "SELECT description IS NULL FROM leaf_alloc WHERE biz_tag = 'legacy'").Scan(&isNull); err != nil || !isNull {
		t.Errorf("description after updating the step only: NULL %v, %v; want it still NULL", isNull, err)
	}
	ordered := true
	if err := s.UpdateTag(ctx, "legacy", tagmodel.Update{Ordered: &ordered}); err != nil {
		t.Fatal(err)
	}
	if got := tag(t, s, "legacy"); !got.Ordered || got.Step != 8 || got.Description != "" {
		t.Errorf("Tag(legacy) after setting ordered = %+v, want ordered, step 8, empty description", got)
	}
	if err := s.Pool().QueryRow(ctx, "SELECT description IS NULL FROM leaf_alloc WHERE biz_tag = 'legacy'").Scan(&isNull); err != nil || !isNull {
		t.Errorf("description after updating ordered only: NULL %v, %v; want it still NULL", isNull, err)
	}
}

func TestOpen(t *testing.T) {
	url := newDB(t)
	s, err := postgres.Open(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Ping(ctx); err != nil {
		t.Errorf("Ping: %v", err)
	}
	createTag(t, s, "orders", 10, 1)
	if got := fetch(t, s, "orders", 0); got.Start != 1 {
		t.Errorf("fetch through an opened store = %+v, want start 1", got)
	}
	s.Close()
	if err := s.Ping(ctx); err == nil {
		t.Error("Ping after Close succeeded")
	}

	// A Store from New leaves the pool to its owner.
	pool := newPool(t, url)
	postgres.New(pool).Close()
	if err := pool.Ping(ctx); err != nil {
		t.Errorf("pool after closing a Store from New: %v", err)
	}

	if _, err := postgres.Open(ctx, strings.Replace(url, "/dispenser_test_", "/nosuch_", 1)); err == nil || !strings.HasPrefix(err.Error(), "postgres: ") {
		t.Errorf("Open of a missing database: got error %v, want a postgres: error", err)
	}
}

func TestFetchAbove(t *testing.T) {
	ctx := context.Background()
	tests := []struct {
		name        string
		maxID       int64
		floor, step int64
		want        tagmodel.Allocation
		wantBefore  int64
		wantErr     error
	}{
		{name: "behind the floor", maxID: 11, floor: 31, want: tagmodel.Allocation{Start: 31, End: 41, TagStep: 10}, wantBefore: 11},
		{name: "ahead of the floor", maxID: 51, floor: 31, want: tagmodel.Allocation{Start: 51, End: 61, TagStep: 10}, wantBefore: 51},
		{name: "explicit step", maxID: 1, floor: 5, step: 3, want: tagmodel.Allocation{Start: 5, End: 8, TagStep: 10}, wantBefore: 1},
		{name: "past 2^63-1", maxID: 1, floor: math.MaxInt64 - 5, wantErr: tagmodel.ErrExhausted},
		{name: "negative floor", maxID: 1, floor: -1, wantErr: tagmodel.ErrInvalidArgument},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := newStore(t)
			createTag(t, s, "t", 10, tt.maxID)
			got, before, err := s.FetchAbove(ctx, "t", tt.floor, tt.step)
			if tt.wantErr != nil {
				checkErr(t, err, tt.wantErr)
				if m := tag(t, s, "t").MaxID; m != tt.maxID {
					t.Fatalf("max_id = %d after a failed fetch, want %d", m, tt.maxID)
				}
				return
			}
			if err != nil || got != tt.want || before != tt.wantBefore {
				t.Fatalf("FetchAbove = %+v, %d, %v; want %+v, %d", got, before, err, tt.want, tt.wantBefore)
			}
			if m := tag(t, s, "t").MaxID; m != tt.want.End {
				t.Fatalf("max_id = %d, want %d", m, tt.want.End)
			}
		})
	}
	s := newStore(t)
	if _, _, err := s.FetchAbove(ctx, "nope", 1, 0); !errors.Is(err, tagmodel.ErrUnknownTag) {
		t.Fatalf("unknown tag: %v, want ErrUnknownTag", err)
	}
}
