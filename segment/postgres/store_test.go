package postgres_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"os"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"

	"github.com/dispenser-dev/dispenser/schema"
	"github.com/dispenser-dev/dispenser/segment"
	"github.com/dispenser-dev/dispenser/segment/postgres"
	"github.com/dispenser-dev/dispenser/testenv"
	"github.com/jackc/pgx/v5/pgxpool"
)

func TestMain(m *testing.M) { os.Exit(testenv.Run(m)) }

var ctx = context.Background()

// newDB returns the URL of a new database with the schema.
func newDB(tb testing.TB) string {
	tb.Helper()
	url := testenv.Postgres(tb)
	if _, err := schema.Migrate(ctx, newPool(tb, url)); err != nil {
		tb.Fatalf("schema.Migrate: %v", err)
	}
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
	return postgres.New(newPool(tb, newDB(tb)))
}

// createTag creates a tag and fails the test on error.
func createTag(tb testing.TB, s *postgres.Store, name string, step, start int64) {
	tb.Helper()
	if err := s.CreateTag(ctx, name, step, start, "test tag "+name); err != nil {
		tb.Fatalf("CreateTag(%q, %d, %d): %v", name, step, start, err)
	}
}

// tag looks up a tag and fails the test on error.
func tag(tb testing.TB, s *postgres.Store, name string) segment.Tag {
	tb.Helper()
	t, err := s.Tag(ctx, name)
	if err != nil {
		tb.Fatalf("Tag(%q): %v", name, err)
	}
	return t
}

// fetch fetches a segment and fails the test on error.
func fetch(tb testing.TB, s *postgres.Store, name string, step int64) segment.Allocation {
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

func TestConcurrentFetchesNeverOverlap(t *testing.T) {
	url := newDB(t)
	// Two pools stand for two dispenser processes.
	stores := []*postgres.Store{postgres.New(newPool(t, url)), postgres.New(newPool(t, url))}
	const (
		tagStep    = 10
		goroutines = 32
		fetches    = 25
	)
	createTag(t, stores[0], "orders", tagStep, 1)

	var (
		wg     sync.WaitGroup
		mu     sync.Mutex
		allocs []segment.Allocation
		errs   []error
	)
	for g := range goroutines {
		wg.Go(func() {
			s := stores[g%len(stores)]
			for i := range fetches {
				step := int64(0) // the tag's own step, or an explicit one
				if i%3 != 0 {
					step = int64(1 + (g*7+i)%50)
				}
				length := step
				if step == 0 {
					length = tagStep
				}
				a, err := s.Fetch(ctx, "orders", step)
				if err == nil && (a.End-a.Start != length || a.TagStep != tagStep) {
					err = fmt.Errorf("Fetch(orders, %d) = %+v, want %d IDs and TagStep %d", step, a, length, tagStep)
				}
				mu.Lock()
				allocs = append(allocs, a)
				if err != nil {
					errs = append(errs, err)
				}
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	for _, err := range errs {
		t.Error(err)
	}
	if t.Failed() {
		t.FailNow()
	}

	// Sorted, the segments must tile 1..max_id-1 exactly: no overlap, no gap.
	sort.Slice(allocs, func(i, j int) bool { return allocs[i].Start < allocs[j].Start })
	next := int64(1)
	for _, a := range allocs {
		if a.Start != next {
			t.Fatalf("segment %+v starts at %d, want %d (overlap or gap)", a, a.Start, next)
		}
		next = a.End
	}
	if got := tag(t, stores[1], "orders").MaxID; got != next {
		t.Errorf("max_id = %d, want %d, the end of the last segment", got, next)
	}
	if len(allocs) != goroutines*fetches {
		t.Errorf("got %d segments, want %d", len(allocs), goroutines*fetches)
	}
}

func TestFetchStep(t *testing.T) {
	s := newStore(t)
	createTag(t, s, "orders", 10, 1)
	tests := []struct {
		name   string
		step   int64
		length int64
	}{
		{name: "zero means the tag's step", step: 0, length: 10},
		{name: "negative means the tag's step", step: -7, length: 10},
		{name: "explicit larger step", step: 25, length: 25},
		{name: "explicit smaller step", step: 1, length: 1},
		{name: "largest step", step: segment.MaxStepLimit, length: segment.MaxStepLimit},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			before := tag(t, s, "orders")
			a := fetch(t, s, "orders", tt.step)
			want := segment.Allocation{Start: before.MaxID, End: before.MaxID + tt.length, TagStep: 10}
			if a != want {
				t.Errorf("Fetch(orders, %d) = %+v, want %+v", tt.step, a, want)
			}
			after := tag(t, s, "orders")
			if after.MaxID != a.End || after.Step != 10 {
				t.Errorf("after fetch: max_id %d step %d, want %d and 10", after.MaxID, after.Step, a.End)
			}
		})
	}
}

func TestNewTagStartsAtStart(t *testing.T) {
	s := newStore(t)
	createTag(t, s, "one", 1000, 1)
	createTag(t, s, "later", 50, 5000)
	if got, want := fetch(t, s, "one", 0), (segment.Allocation{Start: 1, End: 1001, TagStep: 1000}); got != want {
		t.Errorf("first fetch of a tag created at 1 = %+v, want %+v", got, want)
	}
	if got, want := fetch(t, s, "later", 0), (segment.Allocation{Start: 5000, End: 5050, TagStep: 50}); got != want {
		t.Errorf("first fetch of a tag created at 5000 = %+v, want %+v", got, want)
	}
}

func TestFetchErrorsChangeNothing(t *testing.T) {
	s := newStore(t)
	createTag(t, s, "orders", 10, 1)
	fetch(t, s, "orders", 0)
	tests := []struct {
		name string
		tag  string
		step int64
		want error
	}{
		{name: "unknown tag", tag: "nosuch", want: segment.ErrUnknownTag},
		{name: "unknown tag explicit step", tag: "nosuch", step: 5, want: segment.ErrUnknownTag},
		{name: "empty tag", tag: "", want: segment.ErrInvalidTag},
		{name: "dot in tag", tag: "orders.eu", want: segment.ErrInvalidTag},
		{name: "wildcard tag", tag: "*", want: segment.ErrInvalidTag},
		{name: "non-ASCII tag", tag: "bestellungen-ü", want: segment.ErrInvalidTag},
		{name: "tag too long", tag: strings.Repeat("a", 129), want: segment.ErrInvalidTag},
		{name: "step too large", tag: "orders", step: segment.MaxStepLimit + 1, want: segment.ErrInvalidStep},
		{name: "step far too large", tag: "orders", step: math.MaxInt64, want: segment.ErrInvalidStep},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			before := snapshot(t, s)
			a, err := s.Fetch(ctx, tt.tag, tt.step)
			checkErr(t, err, tt.want)
			if a != (segment.Allocation{}) {
				t.Errorf("Fetch returned %+v with the error, want zero", a)
			}
			if after := snapshot(t, s); after != before {
				t.Errorf("failed Fetch changed the table:\nbefore:\n%s\nafter:\n%s", before, after)
			}
		})
	}
}

func TestFetchExhausted(t *testing.T) {
	s := newStore(t)
	createTag(t, s, "big", 10, math.MaxInt64-10)
	// The last full segment ends exactly at the largest bigint.
	if got, want := fetch(t, s, "big", 0), (segment.Allocation{Start: math.MaxInt64 - 10, End: math.MaxInt64, TagStep: 10}); got != want {
		t.Fatalf("last fetch = %+v, want %+v", got, want)
	}
	for _, step := range []int64{0, 1, segment.MaxStepLimit} {
		before := snapshot(t, s)
		_, err := s.Fetch(ctx, "big", step)
		checkErr(t, err, postgres.ErrExhausted)
		if after := snapshot(t, s); after != before {
			t.Errorf("exhausted Fetch(big, %d) changed the table:\nbefore:\n%s\nafter:\n%s", step, before, after)
		}
	}
}

func TestFetchNonPositiveStoredStep(t *testing.T) {
	s := newStore(t)
	// A table inherited from Leaf may hold rows this store would not create.
	exec(t, s, "INSERT INTO leaf_alloc (biz_tag, max_id, step) VALUES ('zero', 100, 0), ('negative', 100, -5)")
	for _, name := range []string{"zero", "negative"} {
		before := snapshot(t, s)
		_, err := s.Fetch(ctx, name, 0)
		checkErr(t, err, segment.ErrInvalidStep)
		if after := snapshot(t, s); after != before {
			t.Errorf("Fetch(%s, 0) changed the table:\nbefore:\n%s\nafter:\n%s", name, before, after)
		}
	}
	// An explicit step still works.
	if got, want := fetch(t, s, "zero", 5), (segment.Allocation{Start: 100, End: 105, TagStep: 0}); got != want {
		t.Errorf("Fetch(zero, 5) = %+v, want %+v", got, want)
	}
}

func TestGiveBack(t *testing.T) {
	s := newStore(t)
	createTag(t, s, "orders", 100, 1)

	// We fetched last: the unissued rest goes back.
	a := fetch(t, s, "orders", 0)
	ok, err := s.GiveBack(ctx, "orders", a.End, a.Start+3)
	if err != nil || !ok {
		t.Fatalf("GiveBack after our own fetch = %v, %v, want true, nil", ok, err)
	}
	if got, want := tag(t, s, "orders").MaxID, a.Start+3; got != want {
		t.Errorf("max_id after give-back = %d, want %d", got, want)
	}
	if got := fetch(t, s, "orders", 0); got.Start != a.Start+3 {
		t.Errorf("fetch after give-back = %+v, want it to start at %d", got, a.Start+3)
	}

	// Somebody fetched after us: nothing goes back.
	a = fetch(t, s, "orders", 0)
	b := fetch(t, s, "orders", 0)
	before := snapshot(t, s)
	ok, err = s.GiveBack(ctx, "orders", a.End, a.Start)
	if err != nil || ok {
		t.Fatalf("GiveBack after a later fetch = %v, %v, want false, nil", ok, err)
	}
	if got := tag(t, s, "orders").MaxID; got != b.End {
		t.Errorf("max_id after refused give-back = %d, want %d", got, b.End)
	}
	if after := snapshot(t, s); after != before {
		t.Errorf("refused give-back changed the table:\nbefore:\n%s\nafter:\n%s", before, after)
	}

	// Giving back nothing is allowed and keeps max_id.
	ok, err = s.GiveBack(ctx, "orders", b.End, b.End)
	if err != nil || !ok {
		t.Errorf("GiveBack of nothing = %v, %v, want true, nil", ok, err)
	}
	if got := tag(t, s, "orders").MaxID; got != b.End {
		t.Errorf("max_id after empty give-back = %d, want %d", got, b.End)
	}

	// An unknown tag has nothing to give back to.
	ok, err = s.GiveBack(ctx, "nosuch", 10, 5)
	if err != nil || ok {
		t.Errorf("GiveBack of an unknown tag = %v, %v, want false, nil", ok, err)
	}
}

func TestGiveBackInvalid(t *testing.T) {
	s := newStore(t)
	createTag(t, s, "orders", 100, 1)
	a := fetch(t, s, "orders", 0)
	tests := []struct {
		name          string
		tag           string
		end, unissued int64
		want          error
	}{
		{name: "first unissued past end", tag: "orders", end: a.End, unissued: a.End + 1, want: postgres.ErrInvalidArgument},
		{name: "first unissued zero", tag: "orders", end: a.End, unissued: 0, want: postgres.ErrInvalidArgument},
		{name: "first unissued negative", tag: "orders", end: a.End, unissued: -5, want: postgres.ErrInvalidArgument},
		{name: "invalid tag", tag: "orders>", end: a.End, unissued: a.Start, want: segment.ErrInvalidTag},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			before := snapshot(t, s)
			ok, err := s.GiveBack(ctx, tt.tag, tt.end, tt.unissued)
			checkErr(t, err, tt.want)
			if ok {
				t.Error("GiveBack reported true with an error")
			}
			if after := snapshot(t, s); after != before {
				t.Errorf("failed GiveBack changed the table:\nbefore:\n%s\nafter:\n%s", before, after)
			}
		})
	}
}

func TestCreateTag(t *testing.T) {
	s := newStore(t)
	if err := s.CreateTag(ctx, "orders", 1000, 42, "order numbers"); err != nil {
		t.Fatal(err)
	}
	got := tag(t, s, "orders")
	if got.Name != "orders" || got.MaxID != 42 || got.Step != 1000 || got.Description != "order numbers" || got.UpdateTime.IsZero() {
		t.Errorf("Tag(orders) = %+v, want max_id 42, step 1000, description \"order numbers\", an update time", got)
	}

	// Boundary values are accepted.
	longest := strings.Repeat("é", postgres.MaxDescription) // characters, not bytes
	if err := s.CreateTag(ctx, "edges", segment.MaxStepLimit, math.MaxInt64, longest); err != nil {
		t.Fatalf("CreateTag with boundary values: %v", err)
	}
	if got := tag(t, s, "edges"); got.MaxID != math.MaxInt64 || got.Step != segment.MaxStepLimit || got.Description != longest {
		t.Errorf("Tag(edges) = %+v, want the boundary values back", got)
	}
}

func TestCreateTagInvalid(t *testing.T) {
	s := newStore(t)
	createTag(t, s, "orders", 10, 1)
	fetch(t, s, "orders", 0)
	tests := []struct {
		name        string
		tag         string
		step, start int64
		description string
		want        error
	}{
		{name: "existing tag", tag: "orders", step: 99, start: 500, description: "again", want: segment.ErrTagExists},
		{name: "empty name", tag: "", step: 10, start: 1, want: segment.ErrInvalidTag},
		{name: "space in name", tag: "new orders", step: 10, start: 1, want: segment.ErrInvalidTag},
		{name: "name too long", tag: strings.Repeat("x", 129), step: 10, start: 1, want: segment.ErrInvalidTag},
		{name: "zero step", tag: "new", step: 0, start: 1, want: segment.ErrInvalidStep},
		{name: "negative step", tag: "new", step: -1, start: 1, want: segment.ErrInvalidStep},
		{name: "step too large", tag: "new", step: segment.MaxStepLimit + 1, start: 1, want: segment.ErrInvalidStep},
		{name: "zero start", tag: "new", step: 10, start: 0, want: postgres.ErrInvalidArgument},
		{name: "negative start", tag: "new", step: 10, start: -100, want: postgres.ErrInvalidArgument},
		{name: "description too long", tag: "new", step: 10, start: 1, description: strings.Repeat("d", postgres.MaxDescription+1), want: postgres.ErrInvalidArgument},
		{name: "description not UTF-8", tag: "new", step: 10, start: 1, description: "\xff", want: postgres.ErrInvalidArgument},
		{name: "description with NUL", tag: "new", step: 10, start: 1, description: "a\x00b", want: postgres.ErrInvalidArgument},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			before := snapshot(t, s)
			err := s.CreateTag(ctx, tt.tag, tt.step, tt.start, tt.description)
			checkErr(t, err, tt.want)
			if after := snapshot(t, s); after != before {
				t.Errorf("failed CreateTag changed the table:\nbefore:\n%s\nafter:\n%s", before, after)
			}
		})
	}
}

func TestUpdateTag(t *testing.T) {
	s := newStore(t)
	createTag(t, s, "orders", 10, 1)
	fetch(t, s, "orders", 0)
	ptr := func(v int64) *int64 { return &v }
	str := func(v string) *string { return &v }
	tests := []struct {
		name        string
		step        *int64
		description *string
		wantStep    int64
		wantDesc    string
	}{
		{name: "neither", wantStep: 10, wantDesc: "test tag orders"},
		{name: "step only", step: ptr(20), wantStep: 20, wantDesc: "test tag orders"},
		{name: "description only", description: str("orders of the shop"), wantStep: 20, wantDesc: "orders of the shop"},
		{name: "both", step: ptr(segment.MaxStepLimit), description: str(""), wantStep: segment.MaxStepLimit, wantDesc: ""},
		{name: "step 1", step: ptr(1), wantStep: 1, wantDesc: ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if err := s.UpdateTag(ctx, "orders", tt.step, tt.description); err != nil {
				t.Fatal(err)
			}
			got := tag(t, s, "orders")
			if got.Step != tt.wantStep || got.Description != tt.wantDesc || got.MaxID != 11 {
				t.Errorf("after UpdateTag: %+v, want step %d, description %q, max_id 11", got, tt.wantStep, tt.wantDesc)
			}
		})
	}
	// The new step is the default of the next fetch.
	if got, want := fetch(t, s, "orders", 0), (segment.Allocation{Start: 11, End: 12, TagStep: 1}); got != want {
		t.Errorf("fetch after update = %+v, want %+v", got, want)
	}
}

func TestUpdateTagInvalid(t *testing.T) {
	s := newStore(t)
	createTag(t, s, "orders", 10, 1)
	ptr := func(v int64) *int64 { return &v }
	str := func(v string) *string { return &v }
	tests := []struct {
		name        string
		tag         string
		step        *int64
		description *string
		want        error
	}{
		{name: "unknown tag", tag: "nosuch", step: ptr(5), want: segment.ErrUnknownTag},
		{name: "unknown tag, no change", tag: "nosuch", want: segment.ErrUnknownTag},
		{name: "invalid name", tag: "a/b", step: ptr(5), want: segment.ErrInvalidTag},
		{name: "zero step", tag: "orders", step: ptr(0), description: str("x"), want: segment.ErrInvalidStep},
		{name: "step too large", tag: "orders", step: ptr(segment.MaxStepLimit + 1), want: segment.ErrInvalidStep},
		{name: "description too long", tag: "orders", step: ptr(5), description: str(strings.Repeat("d", postgres.MaxDescription+1)), want: postgres.ErrInvalidArgument},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			before := snapshot(t, s)
			checkErr(t, s.UpdateTag(ctx, tt.tag, tt.step, tt.description), tt.want)
			if after := snapshot(t, s); after != before {
				t.Errorf("failed UpdateTag changed the table:\nbefore:\n%s\nafter:\n%s", before, after)
			}
		})
	}
}

func TestTags(t *testing.T) {
	s := newStore(t)
	got, err := s.Tags(ctx)
	if err != nil || len(got) != 0 {
		t.Fatalf("Tags of an empty table = %q, %v, want none", got, err)
	}
	want := []string{"b", "B", "a-1", "a_1", "_z", "Z9"}
	for _, name := range want {
		createTag(t, s, name, 10, 1)
	}
	// Leaf allows names that are no NATS token; they are not served.
	exec(t, s, "INSERT INTO leaf_alloc (biz_tag, step) VALUES ('leaf.segment', 10), ('with space', 10)")
	sort.Strings(want)
	got, err = s.Tags(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(got, want) {
		t.Errorf("Tags() = %q, want %q", got, want)
	}
}

func TestTag(t *testing.T) {
	s := newStore(t)
	exec(t, s, "INSERT INTO leaf_alloc (biz_tag, max_id, step, description) VALUES ('legacy', 77, 5, NULL)")
	if got := tag(t, s, "legacy"); got.Name != "legacy" || got.MaxID != 77 || got.Step != 5 || got.Description != "" {
		t.Errorf("Tag(legacy) = %+v, want max_id 77, step 5, empty description", got)
	}
	tests := []struct {
		name string
		tag  string
		want error
	}{
		{name: "unknown", tag: "nosuch", want: segment.ErrUnknownTag},
		{name: "invalid", tag: "no such", want: segment.ErrInvalidTag},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := s.Tag(ctx, tt.tag)
			checkErr(t, err, tt.want)
			if got != (segment.Tag{}) {
				t.Errorf("Tag returned %+v with the error, want zero", got)
			}
		})
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
