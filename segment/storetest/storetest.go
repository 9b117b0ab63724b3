// Package storetest is a conformance suite for implementations of
// tagmodel.Store and tagmodel.Admin: every store must pass it unchanged. A
// store reports the errors of package segment, wrapped with %w, and keeps
// to its limits (tagmodel.MaxStepLimit, tagmodel.MaxDescription).
//
//	func TestConformance(t *testing.T) {
//		storetest.Run(t, storetest.Config{NewBackend: ..., Prefix: "mystore: "})
//	}
package storetest

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dispenser-dev/dispenser/tagmodel"
)

// Store is what the suite tests: a segment store with administration, a
// way to delete tags and a way to write a tag as older software did.
type Store interface {
	tagmodel.Store
	tagmodel.Admin
	tagmodel.PeriodPruner
	// DeleteTag removes a tag, which then is unknown to every operation and
	// may be created again. An unknown tag yields tagmodel.ErrUnknownTag.
	DeleteTag(ctx context.Context, name string) error
	// PutLegacyTag adds the tag name, first ID maxID, with step and no
	// description, stored as software that knows nothing of ordered tags
	// stores it: for PostgreSQL a row inserted as Leaf inserts it, naming
	// only Leaf's columns; for a KV store a value without the "ordered"
	// field. The tag must not exist.
	PutLegacyTag(ctx context.Context, name string, maxID, step int64) error
}

// Config describes the store under test.
type Config struct {
	// NewBackend sets up a new, empty backend (a database, a bucket) for one
	// test, removed in tb's Cleanup, and returns a function that opens a
	// Store on it. Each Store that open returns must have connections of its
	// own, as if it were in another process, and be closed in tb's Cleanup.
	NewBackend func(tb testing.TB) (open func(tb testing.TB) Store)
	// Prefix starts the message of every error of the store, e.g. "kv: ".
	Prefix string
	// NoPerRegion: the store refuses per-region settings
	// (tagmodel.ErrInvalidArgument) and records one region only, as the
	// MySQL store does (a Leaf may serve its table); the Regions test
	// checks the refusal instead of the per-region record.
	NoPerRegion bool
}

// Run runs the suite, each test as a subtest of t on a backend of its own.
func Run(t *testing.T, c Config) {
	if c.NewBackend == nil || c.Prefix == "" {
		t.Fatalf("storetest: incomplete Config %+v", c)
	}
	tests := []struct {
		name string
		test func(t *testing.T, c Config)
	}{
		{"ConcurrentFetchesNeverOverlap", testConcurrentFetches},
		{"ConcurrentGiveBacksNeverOverlap", testConcurrentGiveBacks},
		{"ConcurrentUpdatesNotLost", testConcurrentUpdates},
		{"FetchStep", testFetchStep},
		{"NewTagStartsAtStart", testNewTagStartsAtStart},
		{"FetchErrorsChangeNothing", testFetchErrors},
		{"FetchExhausted", testFetchExhausted},
		{"ChangesListWhatChanged", testChanges},
		{"GiveBack", testGiveBack},
		{"GiveBackInvalid", testGiveBackInvalid},
		{"GiveBackNotAfterAReturnedValue", testGiveBackReturnedValue},
		{"CreateTag", testCreateTag},
		{"CreateTagInvalid", testCreateTagInvalid},
		{"UpdateTag", testUpdateTag},
		{"UpdateTagInvalid", testUpdateTagInvalid},
		{"Ordered", testOrdered},
		{"LegacyTagsNotOrdered", testLegacyTagsNotOrdered},
		{"Tags", testTags},
		{"Tag", testTag},
		{"DeleteTag", testDeleteTag},
		{"Periods", testPeriods},
		{"PeriodErrors", testPeriodErrors},
		{"ConcurrentFirstFetchesOfAPeriod", testConcurrentPeriodCreation},
		{"PrunePeriods", testPrunePeriods},
		{"PrunedPeriodAfterZoneChange", testPrunedPeriodAfterZoneChange},
		{"PrunedPeriodNumbersAfterZoneChange", testPrunedPeriodNumbersAfterZoneChange},
		{"PeriodGiveBack", testPeriodGiveBack},
		{"PeriodicSettings", testPeriodicSettings},
		{"PeriodicSettingsInvalid", testPeriodicSettingsInvalid},
		{"Regions", testRegions},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) { tt.test(t, c) })
	}
}

// newStore returns one Store on a new backend.
func newStore(tb testing.TB, c Config) Store {
	tb.Helper()
	return c.NewBackend(tb)(tb)
}

// ctx bounds every store call of the suite, so that a hung store fails the
// test instead of stalling it.
func ctx(tb testing.TB) context.Context {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	tb.Cleanup(cancel)
	return ctx
}

// createTag creates a tag and fails the test on error.
func createTag(tb testing.TB, s Store, name string, step, start int64) {
	tb.Helper()
	if err := s.CreateTag(ctx(tb), tagmodel.Tag{Name: name, Step: step, MaxID: start, Description: "test tag " + name}); err != nil {
		tb.Fatalf("CreateTag(%q, %d, %d): %v", name, step, start, err)
	}
}

// tag looks up a tag and fails the test on error.
func tag(tb testing.TB, s Store, name string) tagmodel.Tag {
	tb.Helper()
	t, err := s.Tag(ctx(tb), name)
	if err != nil {
		tb.Fatalf("Tag(%q): %v", name, err)
	}
	return t
}

// fetch fetches a segment and fails the test on error.
func fetch(tb testing.TB, s Store, name string, step int64) tagmodel.Allocation {
	tb.Helper()
	a, err := s.Fetch(ctx(tb), name, step)
	if err != nil {
		tb.Fatalf("Fetch(%q, %d): %v", name, step, err)
	}
	return a
}

// snapshot returns every tag the store lists, every field, as text, so that
// tests can check that an operation changed nothing.
func snapshot(tb testing.TB, s Store) string {
	tb.Helper()
	names, err := s.Tags(ctx(tb))
	if err != nil {
		tb.Fatalf("snapshot: Tags: %v", err)
	}
	var b strings.Builder
	for _, n := range names {
		t := tag(tb, s, n)
		fmt.Fprintf(&b, "%s|%d|%d|%q|ordered=%v|reset=%s|tz=%q|format=%q|retention=%d|%s\n", t.Name, t.MaxID, t.Step, t.Description, t.Ordered,
			t.Reset, t.TimeZone, t.Format, t.RetentionDays, t.UpdateTime.UTC().Format(time.RFC3339Nano))
	}
	return b.String()
}

// checkUnchanged fails the test if the store's snapshot is not before.
func checkUnchanged(tb testing.TB, s Store, before, what string) {
	tb.Helper()
	if after := snapshot(tb, s); after != before {
		tb.Errorf("%s changed the store:\nbefore:\n%s\nafter:\n%s", what, before, after)
	}
}

// checkErr fails the test unless err wraps want and reads as a store error.
func checkErr(tb testing.TB, c Config, err, want error) {
	tb.Helper()
	if !errors.Is(err, want) {
		tb.Fatalf("got error %v, want %v", err, want)
	}
	if !strings.HasPrefix(err.Error(), c.Prefix) {
		tb.Errorf("error %q lacks the %q prefix", err, c.Prefix)
	}
}

func ptr[T any](v T) *T { return &v }

// checkTiling fails the test unless the non-empty segments, sorted, cover
// start..end-1 exactly: no overlap, no gap.
func checkTiling(tb testing.TB, segs []tagmodel.Allocation, start, end int64) {
	tb.Helper()
	segs = slices.DeleteFunc(slices.Clone(segs), func(a tagmodel.Allocation) bool { return a.Start == a.End })
	sort.Slice(segs, func(i, j int) bool { return segs[i].Start < segs[j].Start })
	next := start
	for _, a := range segs {
		switch {
		case a.End < a.Start:
			tb.Fatalf("segment [%d, %d) ends before it starts", a.Start, a.End)
		case a.Start < next:
			tb.Fatalf("segment [%d, %d) overlaps the IDs below %d", a.Start, a.End, next)
		case a.Start > next:
			tb.Fatalf("gap: IDs %d..%d are in no segment", next, a.Start-1)
		}
		next = a.End
	}
	if next != end {
		tb.Fatalf("segments end at %d, want %d, the tag's max_id", next, end)
	}
}

// Four Stores, as four processes, with eight goroutines each.
const (
	stores     = 4
	goroutines = 8
	fetches    = 20
)

// openStores opens n Stores on one new backend.
func openStores(tb testing.TB, c Config, n int) []Store {
	tb.Helper()
	open := c.NewBackend(tb)
	ss := make([]Store, n)
	for i := range ss {
		ss[i] = open(tb)
	}
	return ss
}

// results gathers the segments and errors of concurrent goroutines.
type results struct {
	mu     sync.Mutex // protects the fields below
	allocs []tagmodel.Allocation
	errs   []error
}

// add records a segment (also a failed fetch's zero one) and err, if any.
func (r *results) add(a tagmodel.Allocation, err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.allocs = append(r.allocs, a)
	if err != nil {
		r.errs = append(r.errs, err)
	}
}

// fail records err alone.
func (r *results) fail(err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.errs = append(r.errs, err)
}

// check reports the errors and stops the test if there were any.
func (r *results) check(t *testing.T) {
	t.Helper()
	for _, err := range r.errs {
		t.Error(err)
	}
	if t.Failed() {
		t.FailNow()
	}
}

func testConcurrentFetches(t *testing.T, c Config) {
	ss := openStores(t, c, stores)
	const tagStep = 10
	createTag(t, ss[0], "orders", tagStep, 1)

	ctx := ctx(t)
	var wg sync.WaitGroup
	var res results
	for g := range stores * goroutines {
		wg.Go(func() {
			s := ss[g%len(ss)]
			for i := range fetches {
				step := int64(0) // the tag's own step, or an explicit one
				if i%3 != 0 {
					step = int64(1 + (g*7+i)%50)
				}
				length := cmp.Or(step, tagStep)
				a, err := s.Fetch(ctx, "orders", step)
				if err == nil && (a.End-a.Start != length || a.TagStep != tagStep) {
					err = fmt.Errorf("Fetch(orders, %d) = %+v, want %d IDs and TagStep %d", step, a, length, tagStep)
				}
				res.add(a, err)
			}
		})
	}
	wg.Wait()
	res.check(t)
	if got, want := len(res.allocs), stores*goroutines*fetches; got != want {
		t.Errorf("got %d segments, want %d", got, want)
	}
	checkTiling(t, res.allocs, 1, tag(t, ss[1], "orders").MaxID)
}

// Every fetch is followed by an attempt to give part of the segment back.
// A give-back that succeeds issues only the IDs below firstUnissued, one
// that fails the whole segment; either way the issued IDs must tile the
// range, whatever the interleaving.
func testConcurrentGiveBacks(t *testing.T, c Config) {
	ss := openStores(t, c, stores)
	const tagStep = 10
	createTag(t, ss[0], "orders", tagStep, 1)

	ctx := ctx(t)
	var wg sync.WaitGroup
	var res results // allocs: the IDs issued
	var given atomic.Int64
	for g := range stores * goroutines {
		wg.Go(func() {
			s := ss[g%len(ss)]
			for i := range fetches {
				a, err := s.Fetch(ctx, "orders", 0)
				ok := false
				if err == nil {
					keep := int64(g+i) % tagStep // 0: give everything back
					ok, err = s.GiveBack(ctx, "orders", a.End, a.Start+keep)
					if ok {
						a.End = a.Start + keep
					}
				}
				if ok {
					given.Add(1)
				}
				res.add(a, err)
			}
		})
	}
	wg.Wait()
	res.check(t)
	checkTiling(t, res.allocs, 1, tag(t, ss[1], "orders").MaxID)
	// Whatever the interleaving, at least one give-back succeeds: if the
	// last change of max_id was a fetch, the give-back that follows it
	// finds max_id still at that fetch's end (and gives back at least one
	// ID, since keep < tagStep); otherwise the last change was a
	// successful give-back. A store that never gives back would pass the
	// tiling check above, since its segments tile too.
	if given.Load() == 0 {
		t.Errorf("none of %d give-backs succeeded; the one after the last fetch must", len(res.allocs))
	}
	t.Logf("%d of %d give-backs succeeded", given.Load(), len(res.allocs))
}

// Fetches with the tag's own step race with updates of that step: each
// fetch must take exactly the step it reports, and no fetch may write back
// a step it read before an update.
func testConcurrentUpdates(t *testing.T, c Config) {
	ss := openStores(t, c, stores)
	ctx := ctx(t)
	createTag(t, ss[0], "orders", 1, 1)
	const updates = 30

	var wg sync.WaitGroup
	var res results
	wg.Go(func() {
		for i := range updates {
			// The flag alternates, ending set: a store that writes back
			// what it read before an update loses it.
			step, desc, ordered := int64(i+2), fmt.Sprintf("version %d", i+2), i%2 == 1
			if err := ss[i%len(ss)].UpdateTag(ctx, "orders", tagmodel.Update{Step: &step, Description: &desc, Ordered: &ordered}); err != nil {
				res.fail(err)
			}
		}
	})
	for g := range stores * 2 {
		wg.Go(func() {
			s := ss[g%len(ss)]
			for range fetches {
				a, err := s.Fetch(ctx, "orders", 0)
				if err == nil && (a.End-a.Start != a.TagStep || a.TagStep < 1 || a.TagStep > updates+1) {
					err = fmt.Errorf("Fetch(orders, 0) = %+v, want TagStep IDs, TagStep in 1..%d", a, updates+1)
				}
				res.add(a, err)
			}
		})
	}
	wg.Wait()
	res.check(t)
	got := tag(t, ss[1], "orders")
	if got.Step != updates+1 || got.Description != fmt.Sprintf("version %d", updates+1) || !got.Ordered {
		t.Errorf("after the updates: %+v, want step %d, description \"version %d\" and ordered, the last update", got, updates+1, updates+1)
	}
	checkTiling(t, res.allocs, 1, got.MaxID)
}

func testFetchStep(t *testing.T, c Config) {
	s := newStore(t, c)
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
		{name: "largest step", step: tagmodel.MaxStepLimit, length: tagmodel.MaxStepLimit},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			before := tag(t, s, "orders")
			got := fetch(t, s, "orders", tt.step)
			want := tagmodel.Allocation{Start: before.MaxID, End: before.MaxID + tt.length, TagStep: 10}
			if got != want {
				t.Errorf("Fetch(orders, %d) = %+v, want %+v", tt.step, got, want)
			}
			after := tag(t, s, "orders")
			if after.MaxID != want.End || after.Step != 10 || after.Description != before.Description {
				t.Errorf("after fetch: %+v, want max_id %d, step 10, description %q", after, want.End, before.Description)
			}
		})
	}
}

func testNewTagStartsAtStart(t *testing.T, c Config) {
	s := newStore(t, c)
	createTag(t, s, "one", 1000, 1)
	createTag(t, s, "later", 50, 5000)
	if got, want := fetch(t, s, "one", 0), (tagmodel.Allocation{Start: 1, End: 1001, TagStep: 1000}); got != want {
		t.Errorf("first fetch of a tag created at 1 = %+v, want %+v", got, want)
	}
	if got, want := fetch(t, s, "later", 0), (tagmodel.Allocation{Start: 5000, End: 5050, TagStep: 50}); got != want {
		t.Errorf("first fetch of a tag created at 5000 = %+v, want %+v", got, want)
	}
	if got, want := fetch(t, s, "one", 0), (tagmodel.Allocation{Start: 1001, End: 2001, TagStep: 1000}); got != want {
		t.Errorf("second fetch of a tag created at 1 = %+v, want %+v", got, want)
	}
}

func testFetchErrors(t *testing.T, c Config) {
	s := newStore(t, c)
	createTag(t, s, "orders", 10, 1)
	fetch(t, s, "orders", 0)
	tests := []struct {
		name string
		tag  string
		step int64
		want error
	}{
		{name: "unknown tag", tag: "nosuch", want: tagmodel.ErrUnknownTag},
		{name: "unknown tag explicit step", tag: "nosuch", step: 5, want: tagmodel.ErrUnknownTag},
		{name: "unknown tag differing in case", tag: "Orders", want: tagmodel.ErrUnknownTag},
		{name: "empty tag", tag: "", want: tagmodel.ErrInvalidTag},
		{name: "dot in tag", tag: "orders.eu", want: tagmodel.ErrInvalidTag},
		{name: "wildcard tag", tag: "*", want: tagmodel.ErrInvalidTag},
		{name: "full wildcard tag", tag: ">", want: tagmodel.ErrInvalidTag},
		{name: "non-ASCII tag", tag: "bestellungen-ü", want: tagmodel.ErrInvalidTag},
		{name: "tag too long", tag: strings.Repeat("a", 129), want: tagmodel.ErrInvalidTag},
		{name: "step too large", tag: "orders", step: tagmodel.MaxStepLimit + 1, want: tagmodel.ErrInvalidStep},
		{name: "step far too large", tag: "orders", step: math.MaxInt64, want: tagmodel.ErrInvalidStep},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			before := snapshot(t, s)
			a, err := s.Fetch(ctx(t), tt.tag, tt.step)
			checkErr(t, c, err, tt.want)
			if a != (tagmodel.Allocation{}) {
				t.Errorf("Fetch returned %+v with the error, want zero", a)
			}
			checkUnchanged(t, s, before, "failed Fetch")
		})
	}
}

func testFetchExhausted(t *testing.T, c Config) {
	s := newStore(t, c)
	createTag(t, s, "big", 10, math.MaxInt64-10)
	// The last full segment ends exactly at the largest int64.
	if got, want := fetch(t, s, "big", 0), (tagmodel.Allocation{Start: math.MaxInt64 - 10, End: math.MaxInt64, TagStep: 10}); got != want {
		t.Fatalf("last fetch = %+v, want %+v", got, want)
	}
	for _, step := range []int64{0, 1, tagmodel.MaxStepLimit} {
		before := snapshot(t, s)
		a, err := s.Fetch(ctx(t), "big", step)
		checkErr(t, c, err, tagmodel.ErrExhausted)
		if a != (tagmodel.Allocation{}) {
			t.Errorf("Fetch(big, %d) returned %+v with the error, want zero", step, a)
		}
		checkUnchanged(t, s, before, fmt.Sprintf("exhausted Fetch(big, %d)", step))
	}
}

func testGiveBack(t *testing.T, c Config) {
	s := newStore(t, c)
	createTag(t, s, "orders", 100, 1)
	giveBack := func(end, firstUnissued int64) bool {
		t.Helper()
		ok, err := s.GiveBack(ctx(t), "orders", end, firstUnissued)
		if err != nil {
			t.Fatalf("GiveBack(orders, %d, %d): %v", end, firstUnissued, err)
		}
		return ok
	}

	// We fetched last: the unissued rest goes back.
	a := fetch(t, s, "orders", 0)
	if !giveBack(a.End, a.Start+3) {
		t.Fatal("GiveBack after our own fetch = false, want true")
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
	if giveBack(a.End, a.Start) {
		t.Fatal("GiveBack after a later fetch = true, want false")
	}
	checkUnchanged(t, s, before, "refused give-back")

	// Giving back nothing is allowed and keeps max_id.
	if !giveBack(b.End, b.End) {
		t.Error("GiveBack of nothing = false, want true")
	}
	if got := tag(t, s, "orders").MaxID; got != b.End {
		t.Errorf("max_id after empty give-back = %d, want %d", got, b.End)
	}

	// Giving back everything, down to the tag's very first ID.
	if !giveBack(b.End, 1) {
		t.Error("GiveBack to 1 = false, want true")
	}
	if got, want := fetch(t, s, "orders", 0), (tagmodel.Allocation{Start: 1, End: 101, TagStep: 100}); got != want {
		t.Errorf("fetch after giving back everything = %+v, want %+v", got, want)
	}

	// An unknown tag has nothing to give back to.
	before = snapshot(t, s)
	ok, err := s.GiveBack(ctx(t), "nosuch", 10, 5)
	if err != nil || ok {
		t.Errorf("GiveBack of an unknown tag = %v, %v, want false, nil", ok, err)
	}
	checkUnchanged(t, s, before, "give-back to an unknown tag")
}

// testGiveBackReturnedValue: A fetches 1..10, B fetches 11..20 and gives
// all of it back, so max_id is 11 again, A's end. A's give-back must not
// take that for "nobody fetched after me": behind a witness (package
// witness), whose mark B raised and lowered to 11 meanwhile, it would put
// max_id below the mark and raise a false rollback alarm. A store that
// never fetched the tag gives nothing back either.
func testGiveBackReturnedValue(t *testing.T, c Config) {
	ss := openStores(t, c, 3)
	a, b, other := ss[0], ss[1], ss[2]
	createTag(t, a, "orders", 10, 1)
	first := fetch(t, a, "orders", 0)
	second := fetch(t, b, "orders", 0)
	if first.End != second.Start {
		t.Fatalf("segments %+v and %+v are not adjacent", first, second)
	}
	if ok, err := b.GiveBack(ctx(t), "orders", second.End, second.Start); err != nil || !ok {
		t.Fatalf("B's GiveBack(%d, %d) = %v, %v, want true", second.End, second.Start, ok, err)
	}
	if got := tag(t, a, "orders").MaxID; got != first.End {
		t.Fatalf("max_id after B's give-back = %d, want %d", got, first.End)
	}
	before := snapshot(t, a)
	if ok, err := a.GiveBack(ctx(t), "orders", first.End, first.Start+5); err != nil || ok {
		t.Errorf("A's GiveBack(%d, %d) after B fetched and gave back = %v, %v, want false, nil", first.End, first.Start+5, ok, err)
	}
	if ok, err := other.GiveBack(ctx(t), "orders", first.End, first.Start+5); err != nil || ok {
		t.Errorf("GiveBack by a store that never fetched = %v, %v, want false, nil", ok, err)
	}
	checkUnchanged(t, a, before, "give-backs after somebody else fetched")
	// B, the last to write, may still give back.
	if ok, err := b.GiveBack(ctx(t), "orders", first.End, first.End); err != nil || !ok {
		t.Errorf("B's second GiveBack(%d, %d) = %v, %v, want true", first.End, first.End, ok, err)
	}
}

func testGiveBackInvalid(t *testing.T, c Config) {
	s := newStore(t, c)
	createTag(t, s, "orders", 100, 1)
	a := fetch(t, s, "orders", 0)
	tests := []struct {
		name          string
		tag           string
		end, unissued int64
		want          error
	}{
		{name: "first unissued past end", tag: "orders", end: a.End, unissued: a.End + 1, want: tagmodel.ErrInvalidArgument},
		{name: "first unissued zero", tag: "orders", end: a.End, unissued: 0, want: tagmodel.ErrInvalidArgument},
		{name: "first unissued negative", tag: "orders", end: a.End, unissued: -5, want: tagmodel.ErrInvalidArgument},
		{name: "end below one", tag: "orders", end: 0, unissued: 0, want: tagmodel.ErrInvalidArgument},
		{name: "invalid tag", tag: "orders>", end: a.End, unissued: a.Start, want: tagmodel.ErrInvalidTag},
		{name: "invalid tag, invalid range", tag: "", end: 1, unissued: 2, want: tagmodel.ErrInvalidTag},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			before := snapshot(t, s)
			ok, err := s.GiveBack(ctx(t), tt.tag, tt.end, tt.unissued)
			checkErr(t, c, err, tt.want)
			if ok {
				t.Error("GiveBack reported true with an error")
			}
			checkUnchanged(t, s, before, "failed GiveBack")
		})
	}
}

func testCreateTag(t *testing.T, c Config) {
	s := newStore(t, c)
	if err := s.CreateTag(ctx(t), tagmodel.Tag{Name: "orders", Step: 1000, MaxID: 42, Description: "order numbers"}); err != nil {
		t.Fatal(err)
	}
	got := tag(t, s, "orders")
	if got.Name != "orders" || got.MaxID != 42 || got.Step != 1000 || got.Description != "order numbers" || got.Ordered || got.UpdateTime.IsZero() {
		t.Errorf("Tag(orders) = %+v, want max_id 42, step 1000, description \"order numbers\", not ordered, an update time", got)
	}

	// Boundary values are accepted and come back unchanged.
	longest := strings.Repeat("é", tagmodel.MaxDescription) // characters, not bytes
	tests := []struct {
		name        string
		tag         string
		step, start int64
		description string
		ordered     bool
	}{
		{name: "largest values", tag: "edges", step: tagmodel.MaxStepLimit, start: math.MaxInt64, description: longest, ordered: true},
		{name: "smallest values", tag: "x", step: 1, start: 1, description: ""},
		{name: "longest name", tag: strings.Repeat("Z", 128), step: 7, start: 3, description: `quotes " and \ and <html> & tabs	`},
		{name: "all name characters", tag: "aZ09_-", step: 7, start: 3, description: "中文 ✓"},
		{name: "ordered", tag: "ordered", step: 1000, start: 1, description: "invoice numbers", ordered: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if err := s.CreateTag(ctx(t), tagmodel.Tag{Name: tt.tag, Step: tt.step, MaxID: tt.start, Description: tt.description, Ordered: tt.ordered}); err != nil {
				t.Fatalf("CreateTag: %v", err)
			}
			got := tag(t, s, tt.tag)
			if got.Name != tt.tag || got.MaxID != tt.start || got.Step != tt.step || got.Description != tt.description || got.Ordered != tt.ordered {
				t.Errorf("Tag(%q) = %+v, want max_id %d, step %d, description %q, ordered %v", tt.tag, got, tt.start, tt.step, tt.description, tt.ordered)
			}
		})
	}
	// The update time is the store's, not the caller's.
	if err := s.CreateTag(ctx(t), tagmodel.Tag{Name: "dated", Step: 5, MaxID: 1, UpdateTime: time.Unix(0, 0)}); err != nil {
		t.Fatal(err)
	}
	if got := tag(t, s, "dated"); got.UpdateTime.Before(time.Now().Add(-time.Hour)) {
		t.Errorf("Tag(dated).UpdateTime = %v, want the time of creation, not the caller's", got.UpdateTime)
	}
}

func testCreateTagInvalid(t *testing.T, c Config) {
	s := newStore(t, c)
	createTag(t, s, "orders", 10, 1)
	fetch(t, s, "orders", 0)
	tests := []struct {
		name        string
		tag         string
		step, start int64
		description string
		ordered     bool
		want        error
	}{
		{name: "existing tag", tag: "orders", step: 99, start: 500, description: "again", want: tagmodel.ErrTagExists},
		{name: "existing tag, same values", tag: "orders", step: 10, start: 1, description: "test tag orders", want: tagmodel.ErrTagExists},
		{name: "existing tag, ordered", tag: "orders", step: 10, start: 1, ordered: true, want: tagmodel.ErrTagExists},
		{name: "zero step, ordered", tag: "new", step: 0, start: 1, ordered: true, want: tagmodel.ErrInvalidStep},
		{name: "empty name", tag: "", step: 10, start: 1, want: tagmodel.ErrInvalidTag},
		{name: "space in name", tag: "new orders", step: 10, start: 1, want: tagmodel.ErrInvalidTag},
		{name: "dot in name", tag: "new.orders", step: 10, start: 1, want: tagmodel.ErrInvalidTag},
		{name: "name too long", tag: strings.Repeat("x", 129), step: 10, start: 1, want: tagmodel.ErrInvalidTag},
		{name: "zero step", tag: "new", step: 0, start: 1, want: tagmodel.ErrInvalidStep},
		{name: "negative step", tag: "new", step: -1, start: 1, want: tagmodel.ErrInvalidStep},
		{name: "step too large", tag: "new", step: tagmodel.MaxStepLimit + 1, start: 1, want: tagmodel.ErrInvalidStep},
		{name: "zero start", tag: "new", step: 10, start: 0, want: tagmodel.ErrInvalidArgument},
		{name: "negative start", tag: "new", step: 10, start: -100, want: tagmodel.ErrInvalidArgument},
		{name: "description too long", tag: "new", step: 10, start: 1, description: strings.Repeat("d", tagmodel.MaxDescription+1), want: tagmodel.ErrInvalidArgument},
		{name: "description not UTF-8", tag: "new", step: 10, start: 1, description: "\xff", want: tagmodel.ErrInvalidArgument},
		{name: "description with NUL", tag: "new", step: 10, start: 1, description: "a\x00b", want: tagmodel.ErrInvalidArgument},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			before := snapshot(t, s)
			checkErr(t, c, s.CreateTag(ctx(t), tagmodel.Tag{Name: tt.tag, Step: tt.step, MaxID: tt.start, Description: tt.description, Ordered: tt.ordered}), tt.want)
			checkUnchanged(t, s, before, "failed CreateTag")
		})
	}
}

func testUpdateTag(t *testing.T, c Config) {
	s := newStore(t, c)
	createTag(t, s, "orders", 10, 1)
	fetch(t, s, "orders", 0)
	tests := []struct {
		name        string
		step        *int64
		description *string
		wantStep    int64
		wantDesc    string
	}{
		{name: "neither", wantStep: 10, wantDesc: "test tag orders"},
		{name: "step only", step: ptr[int64](20), wantStep: 20, wantDesc: "test tag orders"},
		{name: "description only", description: ptr("orders of the shop"), wantStep: 20, wantDesc: "orders of the shop"},
		{name: "both", step: ptr[int64](tagmodel.MaxStepLimit), description: ptr(""), wantStep: tagmodel.MaxStepLimit, wantDesc: ""},
		{name: "step 1", step: ptr[int64](1), wantStep: 1, wantDesc: ""},
		{name: "longest description", description: ptr(strings.Repeat("ß", tagmodel.MaxDescription)), wantStep: 1, wantDesc: strings.Repeat("ß", tagmodel.MaxDescription)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if err := s.UpdateTag(ctx(t), "orders", tagmodel.Update{Step: tt.step, Description: tt.description}); err != nil {
				t.Fatal(err)
			}
			got := tag(t, s, "orders")
			if got.Step != tt.wantStep || got.Description != tt.wantDesc || got.MaxID != 11 {
				t.Errorf("after UpdateTag: %+v, want step %d, description %q, max_id 11", got, tt.wantStep, tt.wantDesc)
			}
		})
	}
	// The new step is the default of the next fetch.
	if got, want := fetch(t, s, "orders", 0), (tagmodel.Allocation{Start: 11, End: 12, TagStep: 1}); got != want {
		t.Errorf("fetch after update = %+v, want %+v", got, want)
	}
}

func testUpdateTagInvalid(t *testing.T, c Config) {
	s := newStore(t, c)
	createTag(t, s, "orders", 10, 1)
	tests := []struct {
		name        string
		tag         string
		step        *int64
		description *string
		ordered     *bool
		want        error
	}{
		{name: "unknown tag", tag: "nosuch", step: ptr[int64](5), want: tagmodel.ErrUnknownTag},
		{name: "unknown tag, ordered only", tag: "nosuch", ordered: ptr(true), want: tagmodel.ErrUnknownTag},
		{name: "invalid name, ordered only", tag: "a.b", ordered: ptr(false), want: tagmodel.ErrInvalidTag},
		{name: "zero step with ordered", tag: "orders", step: ptr[int64](0), ordered: ptr(true), want: tagmodel.ErrInvalidStep},
		{name: "description with NUL with ordered", tag: "orders", description: ptr("a\x00"), ordered: ptr(true), want: tagmodel.ErrInvalidArgument},
		{name: "unknown tag, no change", tag: "nosuch", want: tagmodel.ErrUnknownTag},
		{name: "invalid name", tag: "a/b", step: ptr[int64](5), want: tagmodel.ErrInvalidTag},
		{name: "zero step", tag: "orders", step: ptr[int64](0), description: ptr("x"), want: tagmodel.ErrInvalidStep},
		{name: "negative step", tag: "orders", step: ptr[int64](-10), want: tagmodel.ErrInvalidStep},
		{name: "step too large", tag: "orders", step: ptr[int64](tagmodel.MaxStepLimit + 1), want: tagmodel.ErrInvalidStep},
		{name: "description too long", tag: "orders", step: ptr[int64](5), description: ptr(strings.Repeat("d", tagmodel.MaxDescription+1)), want: tagmodel.ErrInvalidArgument},
		{name: "description not UTF-8", tag: "orders", description: ptr("ok\xc3"), want: tagmodel.ErrInvalidArgument},
		{name: "description with NUL", tag: "orders", description: ptr("\x00"), want: tagmodel.ErrInvalidArgument},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			before := snapshot(t, s)
			checkErr(t, c, s.UpdateTag(ctx(t), tt.tag, tagmodel.Update{Step: tt.step, Description: tt.description, Ordered: tt.ordered}), tt.want)
			checkUnchanged(t, s, before, "failed UpdateTag")
		})
	}
}

// checkTag fails the test unless the tag's fields are want's (the update
// time aside).
func checkTag(tb testing.TB, s Store, want tagmodel.Tag, what string) {
	tb.Helper()
	got := tag(tb, s, want.Name)
	got.UpdateTime = time.Time{}
	if got != want {
		tb.Errorf("%s: Tag(%q) = %+v, want %+v", what, want.Name, got, want)
	}
}

// An ordered tag keeps its flag through fetches, give-backs and updates of
// its other fields; updates turn it off and on; plain tags are unaffected.
func testOrdered(t *testing.T, c Config) {
	s := newStore(t, c)
	if err := s.CreateTag(ctx(t), tagmodel.Tag{Name: "invoices", Step: 10, MaxID: 1, Description: "invoice numbers", Ordered: true}); err != nil {
		t.Fatal(err)
	}
	createTag(t, s, "plain", 10, 1)
	want := tagmodel.Tag{Name: "invoices", MaxID: 1, Step: 10, Description: "invoice numbers", Ordered: true}
	checkTag(t, s, want, "created ordered")
	plain := tagmodel.Tag{Name: "plain", MaxID: 1, Step: 10, Description: "test tag plain"}
	checkTag(t, s, plain, "created plain")

	// Fetches and give-backs move max_id only.
	if got, wantA := fetch(t, s, "invoices", 0), (tagmodel.Allocation{Start: 1, End: 11, TagStep: 10}); got != wantA {
		t.Fatalf("Fetch(invoices, 0) = %+v, want %+v", got, wantA)
	}
	if got, wantA := fetch(t, s, "invoices", 25), (tagmodel.Allocation{Start: 11, End: 36, TagStep: 10}); got != wantA {
		t.Fatalf("Fetch(invoices, 25) = %+v, want %+v", got, wantA)
	}
	want.MaxID = 36
	checkTag(t, s, want, "after fetches")
	if ok, err := s.GiveBack(ctx(t), "invoices", 36, 20); err != nil || !ok {
		t.Fatalf("GiveBack(invoices, 36, 20) = %v, %v, want true", ok, err)
	}
	want.MaxID = 20
	checkTag(t, s, want, "after a give-back")
	if ok, err := s.GiveBack(ctx(t), "invoices", 36, 30); err != nil || ok {
		t.Fatalf("GiveBack(invoices, 36, 30) after a give-back = %v, %v, want false", ok, err)
	}
	checkTag(t, s, want, "after a refused give-back")

	tests := []struct {
		name string
		u    tagmodel.Update
		want tagmodel.Tag // Name and MaxID as before
	}{
		{name: "off", u: tagmodel.Update{Ordered: ptr(false)}, want: tagmodel.Tag{Step: 10, Description: "invoice numbers"}},
		{name: "off again", u: tagmodel.Update{Ordered: ptr(false)}, want: tagmodel.Tag{Step: 10, Description: "invoice numbers"}},
		{name: "on", u: tagmodel.Update{Ordered: ptr(true)}, want: tagmodel.Tag{Step: 10, Description: "invoice numbers", Ordered: true}},
		{name: "step only keeps it", u: tagmodel.Update{Step: ptr[int64](20)}, want: tagmodel.Tag{Step: 20, Description: "invoice numbers", Ordered: true}},
		{name: "description only keeps it", u: tagmodel.Update{Description: ptr("")}, want: tagmodel.Tag{Step: 20, Ordered: true}},
		{name: "nothing keeps it", want: tagmodel.Tag{Step: 20, Ordered: true}},
		{name: "all three", u: tagmodel.Update{Step: ptr[int64](5), Description: ptr("again plain"), Ordered: ptr(false)}, want: tagmodel.Tag{Step: 5, Description: "again plain"}},
		{name: "on with a step", u: tagmodel.Update{Step: ptr[int64](7), Ordered: ptr(true)}, want: tagmodel.Tag{Step: 7, Description: "again plain", Ordered: true}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if err := s.UpdateTag(ctx(t), "invoices", tt.u); err != nil {
				t.Fatalf("UpdateTag: %v", err)
			}
			tt.want.Name, tt.want.MaxID = "invoices", 20
			checkTag(t, s, tt.want, "after UpdateTag")
			checkTag(t, s, plain, "the other tag after UpdateTag")
		})
	}
	// The flag survives fetching with the new step, and a give-back.
	if got, wantA := fetch(t, s, "invoices", 0), (tagmodel.Allocation{Start: 20, End: 27, TagStep: 7}); got != wantA {
		t.Errorf("Fetch(invoices, 0) after the updates = %+v, want %+v", got, wantA)
	}
	if ok, err := s.GiveBack(ctx(t), "invoices", 27, 27); err != nil || !ok {
		t.Errorf("GiveBack(invoices, 27, 27) = %v, %v, want true", ok, err)
	}
	checkTag(t, s, tagmodel.Tag{Name: "invoices", MaxID: 27, Step: 7, Description: "again plain", Ordered: true}, "after the last fetch")

	// Deleted and created again as a plain tag, it is plain.
	if err := s.DeleteTag(ctx(t), "invoices"); err != nil {
		t.Fatal(err)
	}
	err := s.CreateTag(ctx(t), tagmodel.Tag{Name: "invoices", Step: 10, MaxID: 100, Description: "test tag invoices"})
	if errors.Is(err, tagmodel.ErrTagDeleted) {
		return // a store that keeps deleted tags deleted (testDeleteTag): nothing to be plain
	}
	if err != nil {
		t.Fatalf("CreateTag(invoices) after DeleteTag: %v", err)
	}
	checkTag(t, s, tagmodel.Tag{Name: "invoices", MaxID: 100, Step: 10, Description: "test tag invoices"}, "created again, plain")
}

// Tags stored by software that knows nothing of ordered tags (Leaf, or
// dispenser before them) read as plain and work as before; the flag can be
// set on them.
func testLegacyTagsNotOrdered(t *testing.T, c Config) {
	s := newStore(t, c)
	if err := s.PutLegacyTag(ctx(t), "legacy", 100, 10); err != nil {
		t.Fatalf("PutLegacyTag: %v", err)
	}
	want := tagmodel.Tag{Name: "legacy", MaxID: 100, Step: 10}
	checkTag(t, s, want, "stored without the flag")
	if names, err := s.Tags(ctx(t)); err != nil || !slices.Equal(names, []string{"legacy"}) {
		t.Errorf("Tags() = %q, %v, want [legacy]", names, err)
	}
	if got, wantA := fetch(t, s, "legacy", 0), (tagmodel.Allocation{Start: 100, End: 110, TagStep: 10}); got != wantA {
		t.Fatalf("Fetch(legacy, 0) = %+v, want %+v", got, wantA)
	}
	if ok, err := s.GiveBack(ctx(t), "legacy", 110, 105); err != nil || !ok {
		t.Fatalf("GiveBack(legacy, 110, 105) = %v, %v, want true", ok, err)
	}
	want.MaxID = 105
	checkTag(t, s, want, "after a fetch and a give-back")
	if err := s.UpdateTag(ctx(t), "legacy", tagmodel.Update{Step: ptr[int64](20)}); err != nil {
		t.Fatal(err)
	}
	want.Step = 20
	checkTag(t, s, want, "after updating the step")
	if err := s.UpdateTag(ctx(t), "legacy", tagmodel.Update{Ordered: ptr(true)}); err != nil {
		t.Fatal(err)
	}
	want.Ordered = true
	checkTag(t, s, want, "after setting the flag")
	if err := s.UpdateTag(ctx(t), "legacy", tagmodel.Update{Ordered: ptr(false)}); err != nil {
		t.Fatal(err)
	}
	want.Ordered = false
	checkTag(t, s, want, "after clearing the flag")
	if got, wantA := fetch(t, s, "legacy", 0), (tagmodel.Allocation{Start: 105, End: 125, TagStep: 20}); got != wantA {
		t.Errorf("Fetch(legacy, 0) after the updates = %+v, want %+v", got, wantA)
	}
}

func testTags(t *testing.T, c Config) {
	s := newStore(t, c)
	got, err := s.Tags(ctx(t))
	if err != nil || len(got) != 0 {
		t.Fatalf("Tags of an empty store = %q, %v, want none", got, err)
	}
	want := []string{"b", "B", "a-1", "a_1", "_z", "Z9", "-"}
	for _, name := range want {
		createTag(t, s, name, 10, 1)
	}
	fetch(t, s, "b", 0) // changed tags are listed once
	sort.Strings(want)  // byte order
	got, err = s.Tags(ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(got, want) {
		t.Errorf("Tags() = %q, want %q", got, want)
	}
}

func testTag(t *testing.T, c Config) {
	s := newStore(t, c)
	createTag(t, s, "orders", 10, 77)
	if got := tag(t, s, "orders"); got.Name != "orders" || got.MaxID != 77 || got.Step != 10 || got.Description != "test tag orders" {
		t.Errorf("Tag(orders) = %+v, want max_id 77, step 10, description %q", got, "test tag orders")
	}
	tests := []struct {
		name string
		tag  string
		want error
	}{
		{name: "unknown", tag: "nosuch", want: tagmodel.ErrUnknownTag},
		{name: "prefix of a tag", tag: "order", want: tagmodel.ErrUnknownTag},
		{name: "invalid", tag: "no such", want: tagmodel.ErrInvalidTag},
		{name: "wildcard", tag: "orders.>", want: tagmodel.ErrInvalidTag},
		{name: "empty", tag: "", want: tagmodel.ErrInvalidTag},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := s.Tag(ctx(t), tt.tag)
			checkErr(t, c, err, tt.want)
			if got != (tagmodel.Tag{}) {
				t.Errorf("Tag returned %+v with the error, want zero", got)
			}
		})
	}
}

func testDeleteTag(t *testing.T, c Config) {
	s := newStore(t, c)
	createTag(t, s, "orders", 10, 1)
	createTag(t, s, "keep", 10, 1)
	a := fetch(t, s, "orders", 0)
	if err := s.DeleteTag(ctx(t), "orders"); err != nil {
		t.Fatalf("DeleteTag(orders): %v", err)
	}

	// A deleted tag is no longer served.
	if names, err := s.Tags(ctx(t)); err != nil || !slices.Equal(names, []string{"keep"}) {
		t.Errorf("Tags() after delete = %q, %v, want [keep]", names, err)
	}
	before := snapshot(t, s)
	_, err := s.Fetch(ctx(t), "orders", 0)
	checkErr(t, c, err, tagmodel.ErrUnknownTag)
	_, err = s.Tag(ctx(t), "orders")
	checkErr(t, c, err, tagmodel.ErrUnknownTag)
	checkErr(t, c, s.UpdateTag(ctx(t), "orders", tagmodel.Update{Step: ptr[int64](5)}), tagmodel.ErrUnknownTag)
	if ok, err := s.GiveBack(ctx(t), "orders", a.End, a.Start); ok || err != nil {
		t.Errorf("GiveBack to a deleted tag = %v, %v, want false, nil", ok, err)
	}
	checkErr(t, c, s.DeleteTag(ctx(t), "orders"), tagmodel.ErrUnknownTag)
	checkErr(t, c, s.DeleteTag(ctx(t), "nosuch"), tagmodel.ErrUnknownTag)
	checkErr(t, c, s.DeleteTag(ctx(t), "no.such"), tagmodel.ErrInvalidTag)
	checkUnchanged(t, s, before, "operations on a deleted tag")

	// It can be created again, afresh, by a store that forgets it (a
	// deleted row), or is refused by one that remembers the deletion (a
	// delete marker), which changes nothing.
	err = s.CreateTag(ctx(t), tagmodel.Tag{Name: "orders", Step: 5, MaxID: 1000, Description: "again"})
	switch {
	case errors.Is(err, tagmodel.ErrTagDeleted):
		checkErr(t, c, err, tagmodel.ErrTagDeleted)
		checkUnchanged(t, s, before, "creating a deleted tag again")
	case err != nil:
		t.Fatalf("CreateTag of a deleted tag: %v, want nil or tagmodel.ErrTagDeleted", err)
	default:
		if got, want := fetch(t, s, "orders", 0), (tagmodel.Allocation{Start: 1000, End: 1005, TagStep: 5}); got != want {
			t.Errorf("first fetch of the tag created again = %+v, want %+v", got, want)
		}
	}
	if got := tag(t, s, "keep"); got.MaxID != 1 {
		t.Errorf("Tag(keep) = %+v, want it untouched at max_id 1", got)
	}
}

// testChanges: every store is a tagmodel.ChangeLister. A first call lists
// nothing; later calls list the tags created, fetched or updated since (a
// store may list some again), with their current values; a tag deleted is
// either not listed or listed as Deleted.
func testChanges(t *testing.T, c Config) {
	s := newStore(t, c)
	cl, ok := s.(tagmodel.ChangeLister)
	if !ok {
		t.Fatalf("%T is not a tagmodel.ChangeLister", s)
	}
	createTag(t, s, "before", 10, 1)
	changes, cursor, err := cl.Changes(ctx(t), 0)
	if err != nil || len(changes) != 0 {
		t.Fatalf("Changes(0) = %v, %v; want nothing", changes, err)
	}
	createTag(t, s, "created", 10, 1)
	fetch(t, s, "before", 0)
	step := int64(77)
	updated := "updated"
	createTag(t, s, updated, 10, 1)
	mustUpdate(t, s, updated, tagmodel.Update{Step: &step})
	createTag(t, s, "gone", 10, 1)
	if err := s.DeleteTag(ctx(t), "gone"); err != nil {
		t.Fatal(err)
	}
	changes, next, err := cl.Changes(ctx(t), cursor)
	if err != nil {
		t.Fatalf("Changes: %v", err)
	}
	last := map[string]tagmodel.Change{}
	for _, ch := range changes {
		last[ch.Tag.Name] = ch
	}
	for _, name := range []string{"created", "before", updated} {
		if ch, ok := last[name]; !ok || ch.Deleted {
			t.Errorf("Changes after creating, fetching and updating: %s listed %v (%+v), want listed", name, ok, ch)
		}
	}
	if got := last[updated].Tag.Step; got != step {
		t.Errorf("updated tag listed with step %d, want %d", got, step)
	}
	if got := last["before"].Tag.MaxID; got != 11 {
		t.Errorf("fetched tag listed with max_id %d, want 11", got)
	}
	if ch, ok := last["gone"]; ok && !ch.Deleted {
		t.Errorf("deleted tag listed as %+v, want Deleted or not listed", ch)
	}
	if next == 0 {
		t.Fatal("next cursor 0")
	}
	again, _, err := cl.Changes(ctx(t), next)
	if err != nil {
		t.Fatal(err)
	}
	for _, ch := range again {
		if !ch.Deleted && tag(t, s, ch.Tag.Name).MaxID != ch.Tag.MaxID {
			t.Errorf("listed again with a stale value: %+v", ch)
		}
	}
}

func mustUpdate(tb testing.TB, s Store, name string, u tagmodel.Update) {
	tb.Helper()
	if err := s.UpdateTag(ctx(tb), name, u); err != nil {
		tb.Fatalf("UpdateTag(%q): %v", name, err)
	}
}
