package storetest

import (
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/dispenser-dev/dispenser/segment"
	"github.com/dispenser-dev/dispenser/tagmodel"
)

// createPeriodic creates a tag with reset period r and fails the test on
// error.
func createPeriodic(tb testing.TB, s Store, t tagmodel.Tag) {
	tb.Helper()
	if t.Description == "" {
		t.Description = "test tag " + t.Name
	}
	if err := s.CreateTag(ctx(tb), t); err != nil {
		tb.Fatalf("CreateTag(%+v): %v", t, err)
	}
}

// dayKey is the key of the day d days from today (UTC, the clocks of the
// test and of the store): periods near today are not expired.
func dayKey(d int) string {
	return tagmodel.ResetDay.PeriodAt(time.Now().AddDate(0, 0, d), time.UTC).Key
}

// A period's first fetch starts at the tag's start, its fetches are
// contiguous, another period starts again at the tag's start, the tag's
// own row neither moves nor hands out IDs, and neither Tags nor Changes
// list periods.
func testPeriods(t *testing.T, c Config) {
	s := newStore(t, c)
	cl, ok := s.(tagmodel.ChangeLister)
	if !ok {
		t.Fatalf("%T is not a tagmodel.ChangeLister", s)
	}
	_, cursor, err := cl.Changes(ctx(t), 0)
	if err != nil {
		t.Fatal(err)
	}
	createPeriodic(t, s, tagmodel.Tag{Name: "daily", Step: 10, MaxID: 100, Reset: tagmodel.ResetDay, Format: "D{date:20060102}-{seq:4}"})
	createPeriodic(t, s, tagmodel.Tag{Name: "monthly", Step: 5, MaxID: 1, Reset: tagmodel.ResetMonth, TimeZone: "Asia/Shanghai", RetentionDays: 40})
	createTag(t, s, "plain", 10, 1)
	today, yesterday := tagmodel.PeriodName("daily", dayKey(0)), tagmodel.PeriodName("daily", dayKey(-1))
	month := tagmodel.PeriodName("monthly", tagmodel.ResetMonth.PeriodAt(time.Now(), mustZone(t, "Asia/Shanghai")).Key)

	steps := []struct {
		name string
		step int64
		want tagmodel.Allocation
	}{
		{name: today, want: tagmodel.Allocation{Start: 100, End: 110, TagStep: 10}},
		{name: today, want: tagmodel.Allocation{Start: 110, End: 120, TagStep: 10}},
		{name: today, step: 25, want: tagmodel.Allocation{Start: 120, End: 145, TagStep: 10}},
		{name: yesterday, step: 3, want: tagmodel.Allocation{Start: 100, End: 103, TagStep: 10}},
		{name: yesterday, want: tagmodel.Allocation{Start: 103, End: 113, TagStep: 10}},
		{name: today, want: tagmodel.Allocation{Start: 145, End: 155, TagStep: 10}},
		{name: month, want: tagmodel.Allocation{Start: 1, End: 6, TagStep: 5}},
	}
	for i, st := range steps {
		if got := fetch(t, s, st.name, st.step); got != st.want {
			t.Errorf("fetch %d: Fetch(%q, %d) = %+v, want %+v", i, st.name, st.step, got, st.want)
		}
	}
	checkTag(t, s, tagmodel.Tag{Name: "daily", MaxID: 100, Step: 10, Description: "test tag daily", Reset: tagmodel.ResetDay, Format: "D{date:20060102}-{seq:4}"}, "after fetches of its periods")

	// A period follows its tag's step.
	mustUpdate(t, s, "daily", tagmodel.Update{Step: ptr[int64](7)})
	if got, want := fetch(t, s, today, 0), (tagmodel.Allocation{Start: 155, End: 162, TagStep: 7}); got != want {
		t.Errorf("Fetch(%q, 0) after the tag's step changed = %+v, want %+v", today, got, want)
	}

	// The tag's own row hands out nothing: its max_id is every period's
	// start.
	before := snapshot(t, s)
	_, err = s.Fetch(ctx(t), "daily", 0)
	checkErr(t, c, err, tagmodel.ErrInvalidArgument)
	checkUnchanged(t, s, before, "Fetch of a tag with a reset period")

	if names, err := s.Tags(ctx(t)); err != nil || !slices.Equal(names, []string{"daily", "monthly", "plain"}) {
		t.Errorf("Tags() = %q, %v, want [daily monthly plain]: no periods", names, err)
	}
	changes, _, err := cl.Changes(ctx(t), cursor)
	if err != nil {
		t.Fatal(err)
	}
	for _, ch := range changes {
		if !tagmodel.ValidTag(ch.Tag.Name) {
			t.Errorf("Changes listed %+v, want tags only", ch)
		}
	}
}

func mustZone(tb testing.TB, name string) *time.Location {
	tb.Helper()
	loc, err := time.LoadLocation(name)
	if err != nil {
		tb.Fatal(err)
	}
	return loc
}

func testPeriodErrors(t *testing.T, c Config) {
	s := newStore(t, c)
	createPeriodic(t, s, tagmodel.Tag{Name: "daily", Step: 10, MaxID: 1, Reset: tagmodel.ResetDay})
	createPeriodic(t, s, tagmodel.Tag{Name: "yearly", Step: 10, MaxID: 1, Reset: tagmodel.ResetYear, RetentionDays: 1})
	createTag(t, s, "plain", 10, 1)
	fetch(t, s, tagmodel.PeriodName("daily", dayKey(0)), 0)
	tests := []struct {
		name string
		tag  string
		want error
	}{
		{name: "period of a tag without reset", tag: tagmodel.PeriodName("plain", dayKey(0)), want: tagmodel.ErrInvalidArgument},
		{name: "period of an unknown tag", tag: tagmodel.PeriodName("nosuch", dayKey(0)), want: tagmodel.ErrUnknownTag},
		{name: "month of a daily tag", tag: "daily=" + dayKey(0)[:6], want: tagmodel.ErrInvalidArgument},
		{name: "day of a yearly tag", tag: "yearly=" + dayKey(0), want: tagmodel.ErrInvalidArgument},
		{name: "day that does not exist", tag: "daily=20260230", want: tagmodel.ErrInvalidArgument},
		{name: "expired day", tag: "daily=20200101", want: tagmodel.ErrPeriodExpired},
		{name: "expired year", tag: "yearly=2020", want: tagmodel.ErrPeriodExpired},
		{name: "key not digits", tag: "daily=2026x101", want: tagmodel.ErrInvalidTag},
		{name: "key too short", tag: "daily=202", want: tagmodel.ErrInvalidTag},
		{name: "two separators", tag: "daily=2026=01", want: tagmodel.ErrInvalidTag},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			before := snapshot(t, s)
			a, err := s.Fetch(ctx(t), tt.tag, 0)
			checkErr(t, c, err, tt.want)
			if a != (tagmodel.Allocation{}) {
				t.Errorf("Fetch returned %+v with the error, want zero", a)
			}
			checkUnchanged(t, s, before, "failed Fetch of a period")
			// A failed first fetch creates nothing: a later one of a
			// valid period still starts at the tag's start.
		})
	}
	if got, want := fetch(t, s, tagmodel.PeriodName("yearly", time.Now().UTC().Format("2006")), 0), (tagmodel.Allocation{Start: 1, End: 11, TagStep: 10}); got != want {
		t.Errorf("first fetch of this year after the failures = %+v, want %+v", got, want)
	}
}

// First fetches of a new period from several Stores (connections of their
// own) at once never overlap, and leave no gap: for each of several new
// periods, every goroutine's first fetch waits for one start signal, so
// that as many as can race to create the period's row do.
func testConcurrentPeriodCreation(t *testing.T, c Config) {
	ss := openStores(t, c, stores)
	createPeriodic(t, ss[0], tagmodel.Tag{Name: "daily", Step: 10, MaxID: 1000, Reset: tagmodel.ResetDay})
	ctx := ctx(t)
	const periods, perGoroutine = 4, 3
	for d := range periods {
		name := tagmodel.PeriodName("daily", dayKey(-d))
		start := make(chan struct{})
		var wg sync.WaitGroup
		var res results
		for g := range stores * goroutines {
			wg.Go(func() {
				s := ss[g%len(ss)]
				<-start
				for range perGoroutine {
					a, err := s.Fetch(ctx, name, 0)
					if err == nil && (a.End-a.Start != 10 || a.TagStep != 10) {
						err = fmt.Errorf("Fetch(%s, 0) = %+v, want 10 IDs and TagStep 10", name, a)
					}
					res.add(a, err)
				}
			})
		}
		close(start)
		wg.Wait()
		res.check(t)
		checkTiling(t, res.allocs, 1000, 1000+10*int64(len(res.allocs)))
	}
	checkTag(t, ss[1], tagmodel.Tag{Name: "daily", MaxID: 1000, Step: 10, Description: "test tag daily", Reset: tagmodel.ResetDay}, "after its periods' fetches")
}

// A period that ended longer ago than its tag's retention is pruned by
// PrunePeriods and never created again, even when the retention is
// raised; periods within it are kept.
func testPrunePeriods(t *testing.T, c Config) {
	s := newStore(t, c)
	// 2020-01-01 ended within MaxRetentionDays (ten years): its row can
	// be created.
	createPeriodic(t, s, tagmodel.Tag{Name: "old", Step: 10, MaxID: 1, Reset: tagmodel.ResetDay, RetentionDays: tagmodel.MaxRetentionDays})
	createPeriodic(t, s, tagmodel.Tag{Name: "fresh", Step: 10, MaxID: 1, Reset: tagmodel.ResetDay, RetentionDays: 1})
	old, fresh := "old=20200101", tagmodel.PeriodName("fresh", dayKey(0))
	fetch(t, s, old, 0)
	fetch(t, s, fresh, 0)
	if n, err := s.PrunePeriods(ctx(t)); err != nil || n != 0 {
		t.Fatalf("PrunePeriods with nothing expired = %d, %v, want 0", n, err)
	}

	// With a retention of a week, 2020-01-01 is expired; its row,
	// still there, serves on until pruned.
	mustUpdate(t, s, "old", tagmodel.Update{RetentionDays: ptr(7)})
	if got, want := fetch(t, s, old, 0), (tagmodel.Allocation{Start: 11, End: 21, TagStep: 10}); got != want {
		t.Errorf("Fetch(%s) of an expired period whose row is kept = %+v, want %+v", old, got, want)
	}
	if n, err := s.PrunePeriods(ctx(t)); err != nil || n != 1 {
		t.Fatalf("PrunePeriods = %d, %v, want 1", n, err)
	}
	checkGone := func(what string) {
		t.Helper()
		before := snapshot(t, s)
		a, err := s.Fetch(ctx(t), old, 0)
		if !errors.Is(err, tagmodel.ErrPeriodExpired) && !errors.Is(err, tagmodel.ErrTagDeleted) {
			t.Fatalf("%s: Fetch(%s) = %+v, %v, want ErrPeriodExpired or ErrTagDeleted", what, old, a, err)
		}
		checkErr(t, c, err, err) // the prefix
		checkUnchanged(t, s, before, what)
	}
	checkGone("fetch of a pruned period")
	// Raised again, the retention would let the period be created: it
	// is not, a pruned period's numbers are not started again.
	mustUpdate(t, s, "old", tagmodel.Update{RetentionDays: ptr(tagmodel.MaxRetentionDays)})
	checkGone("fetch of a pruned period after the retention was raised")
	if n, err := s.PrunePeriods(ctx(t)); err != nil || n != 0 {
		t.Errorf("PrunePeriods again = %d, %v, want 0", n, err)
	}
	if got, want := fetch(t, s, fresh, 0), (tagmodel.Allocation{Start: 11, End: 21, TagStep: 10}); got != want {
		t.Errorf("Fetch(%s) after pruning = %+v, want %+v: a period within retention is kept", fresh, got, want)
	}
	if got, want := fetch(t, s, "old="+dayKey(0), 0), (tagmodel.Allocation{Start: 1, End: 11, TagStep: 10}); got != want {
		t.Errorf("Fetch of today's period of the pruned tag = %+v, want %+v", got, want)
	}
}

func testPeriodGiveBack(t *testing.T, c Config) {
	s := newStore(t, c)
	createPeriodic(t, s, tagmodel.Tag{Name: "daily", Step: 100, MaxID: 1, Reset: tagmodel.ResetDay})
	name := tagmodel.PeriodName("daily", dayKey(0))
	other := tagmodel.PeriodName("daily", dayKey(-1))
	a := fetch(t, s, name, 0)
	if ok, err := s.GiveBack(ctx(t), other, a.End, 50); err != nil || ok {
		t.Errorf("GiveBack(%s) of another period's segment = %v, %v, want false", other, ok, err)
	}
	if ok, err := s.GiveBack(ctx(t), name, a.End, 50); err != nil || !ok {
		t.Fatalf("GiveBack(%s, %d, 50) = %v, %v, want true", name, a.End, ok, err)
	}
	if ok, err := s.GiveBack(ctx(t), name, a.End, 60); err != nil || ok {
		t.Errorf("second GiveBack(%s, %d, 60) = %v, %v, want false", name, a.End, ok, err)
	}
	if got, want := fetch(t, s, name, 0), (tagmodel.Allocation{Start: 50, End: 150, TagStep: 100}); got != want {
		t.Errorf("Fetch(%s) after the give-back = %+v, want %+v", name, got, want)
	}
	if got, want := fetch(t, s, other, 0), (tagmodel.Allocation{Start: 1, End: 101, TagStep: 100}); got != want {
		t.Errorf("Fetch(%s), the other period = %+v, want %+v", other, got, want)
	}
	_, err := s.GiveBack(ctx(t), "daily=2026x", 10, 5)
	checkErr(t, c, err, tagmodel.ErrInvalidTag)
	checkTag(t, s, tagmodel.Tag{Name: "daily", MaxID: 1, Step: 100, Description: "test tag daily", Reset: tagmodel.ResetDay}, "after give-backs of its periods")
}

// The reset settings are kept with the tag, and set on a tag without.
func testPeriodicSettings(t *testing.T, c Config) {
	s := newStore(t, c)
	want := tagmodel.Tag{Name: "invoices", Step: 10, MaxID: 5, Description: "invoice numbers", Reset: tagmodel.ResetMonth,
		TimeZone: "Asia/Shanghai", Format: "INV{date:200601}{seq:6}", RetentionDays: 400}
	createPeriodic(t, s, want)
	checkTag(t, s, want, "created with a reset period")
	createPeriodic(t, s, tagmodel.Tag{Name: "none", Step: 10, MaxID: 1, Reset: "none", Format: "N{seq}"})
	checkTag(t, s, tagmodel.Tag{Name: "none", Step: 10, MaxID: 1, Description: "test tag none", Format: "N{seq}"}, "created with reset none")

	createTag(t, s, "plain", 10, 1)
	fetch(t, s, "plain", 0)
	tests := []struct {
		name string
		tag  string
		u    tagmodel.Update
		want tagmodel.Tag
	}{
		{name: "none to day", tag: "plain", u: tagmodel.Update{Reset: ptr(tagmodel.ResetDay)},
			want: tagmodel.Tag{Name: "plain", Step: 10, MaxID: 11, Description: "test tag plain", Reset: tagmodel.ResetDay}},
		{name: "same reset again", tag: "plain", u: tagmodel.Update{Reset: ptr(tagmodel.ResetDay), Format: ptr("P{date:20060102}{seq:5}")},
			want: tagmodel.Tag{Name: "plain", Step: 10, MaxID: 11, Description: "test tag plain", Reset: tagmodel.ResetDay, Format: "P{date:20060102}{seq:5}"}},
		{name: "time zone and retention", tag: "plain", u: tagmodel.Update{TimeZone: ptr("Europe/Berlin"), RetentionDays: ptr(30)},
			want: tagmodel.Tag{Name: "plain", Step: 10, MaxID: 11, Description: "test tag plain", Reset: tagmodel.ResetDay, Format: "P{date:20060102}{seq:5}", TimeZone: "Europe/Berlin", RetentionDays: 30}},
		{name: "step keeps them", tag: "plain", u: tagmodel.Update{Step: ptr[int64](20)},
			want: tagmodel.Tag{Name: "plain", Step: 20, MaxID: 11, Description: "test tag plain", Reset: tagmodel.ResetDay, Format: "P{date:20060102}{seq:5}", TimeZone: "Europe/Berlin", RetentionDays: 30}},
		{name: "width of seq, UTC, default retention", tag: "plain", u: tagmodel.Update{Format: ptr("P{date:20060102}{seq:8}"), TimeZone: ptr(""), RetentionDays: ptr(0)},
			want: tagmodel.Tag{Name: "plain", Step: 20, MaxID: 11, Description: "test tag plain", Reset: tagmodel.ResetDay, Format: "P{date:20060102}{seq:8}"}},
		{name: "width of seq of a tag without reset", tag: "none", u: tagmodel.Update{Format: ptr("N{seq:3}")},
			want: tagmodel.Tag{Name: "none", Step: 10, MaxID: 1, Description: "test tag none", Format: "N{seq:3}"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			mustUpdate(t, s, tt.tag, tt.u)
			checkTag(t, s, tt.want, "after UpdateTag")
		})
	}
}

func testPeriodicSettingsInvalid(t *testing.T, c Config) {
	s := newStore(t, c)
	createPeriodic(t, s, tagmodel.Tag{Name: "daily", Step: 10, MaxID: 1, Reset: tagmodel.ResetDay, Format: "D{date:20060102}{seq}"})
	createTag(t, s, "plain", 10, 1)
	createTests := []struct {
		name string
		t    tagmodel.Tag
		want error
	}{
		{name: "unknown reset", t: tagmodel.Tag{Reset: "week"}, want: tagmodel.ErrInvalidArgument},
		{name: "format without date on a daily tag", t: tagmodel.Tag{Reset: tagmodel.ResetDay, Format: "N{seq:6}"}, want: tagmodel.ErrInvalidArgument},
		{name: "date of a month on a daily tag", t: tagmodel.Tag{Reset: tagmodel.ResetDay, Format: "N{date:200601}{seq:6}"}, want: tagmodel.ErrInvalidArgument},
		{name: "date without reset", t: tagmodel.Tag{Format: "N{date:200601}{seq:6}"}, want: tagmodel.ErrInvalidArgument},
		{name: "two-digit year", t: tagmodel.Tag{Reset: tagmodel.ResetDay, Format: "N{date:060102}{seq:6}"}, want: tagmodel.ErrInvalidArgument},
		{name: "weekday for the year", t: tagmodel.Tag{Reset: tagmodel.ResetDay, Format: "N{date:Mon0102}{seq:6}"}, want: tagmodel.ErrInvalidArgument},
		{name: "date padded with a space", t: tagmodel.Tag{Reset: tagmodel.ResetDay, Format: "N{date:2006-01-_2}{seq:6}"}, want: tagmodel.ErrInvalidArgument},
		{name: "bad time zone", t: tagmodel.Tag{Reset: tagmodel.ResetDay, TimeZone: "Mars/Olympus"}, want: tagmodel.ErrInvalidArgument},
		{name: "time zone without reset", t: tagmodel.Tag{TimeZone: "UTC"}, want: tagmodel.ErrInvalidArgument},
		{name: "ordered with reset", t: tagmodel.Tag{Reset: tagmodel.ResetMonth, Ordered: true}, want: tagmodel.ErrInvalidArgument},
		{name: "negative retention", t: tagmodel.Tag{Reset: tagmodel.ResetDay, RetentionDays: -1}, want: tagmodel.ErrInvalidArgument},
		{name: "retention too long", t: tagmodel.Tag{Reset: tagmodel.ResetDay, RetentionDays: tagmodel.MaxRetentionDays + 1}, want: tagmodel.ErrInvalidArgument},
		{name: "name too long for its periods", t: tagmodel.Tag{Name: string(make([]byte, tagmodel.MaxPeriodicTag+1)), Reset: tagmodel.ResetDay}, want: tagmodel.ErrInvalidTag},
		{name: "existing tag", t: tagmodel.Tag{Name: "daily", Reset: tagmodel.ResetDay}, want: tagmodel.ErrTagExists},
	}
	for _, tt := range createTests {
		t.Run("create/"+tt.name, func(t *testing.T) {
			if tt.t.Name == "" {
				tt.t.Name = "new"
			} else if tt.t.Name[0] == 0 {
				tt.t.Name = string(slices.Repeat([]byte{'n'}, len(tt.t.Name)))
			}
			tt.t.Step, tt.t.MaxID = 10, 1
			before := snapshot(t, s)
			checkErr(t, c, s.CreateTag(ctx(t), tt.t), tt.want)
			checkUnchanged(t, s, before, "failed CreateTag")
		})
	}
	updateTests := []struct {
		name string
		tag  string
		u    tagmodel.Update
		want error
	}{
		{name: "reset changed", tag: "daily", u: tagmodel.Update{Reset: ptr(tagmodel.ResetMonth), Format: ptr("M{date:200601}{seq}")}, want: tagmodel.ErrInvalidArgument},
		{name: "reset removed", tag: "daily", u: tagmodel.Update{Reset: ptr(tagmodel.ResetNone), Format: ptr("")}, want: tagmodel.ErrInvalidArgument},
		{name: "reset removed as none", tag: "daily", u: tagmodel.Update{Reset: ptr[tagmodel.Reset]("none")}, want: tagmodel.ErrInvalidArgument},
		{name: "unknown reset", tag: "plain", u: tagmodel.Update{Reset: ptr[tagmodel.Reset]("hour")}, want: tagmodel.ErrInvalidArgument},
		{name: "format without date on a daily tag", tag: "daily", u: tagmodel.Update{Format: ptr("D{seq}")}, want: tagmodel.ErrInvalidArgument},
		{name: "format changed", tag: "daily", u: tagmodel.Update{Format: ptr("E{date:20060102}{seq}")}, want: tagmodel.ErrInvalidArgument},
		{name: "format's date changed", tag: "daily", u: tagmodel.Update{Format: ptr("D{date:2006002}{seq}")}, want: tagmodel.ErrInvalidArgument},
		{name: "format removed", tag: "daily", u: tagmodel.Update{Format: ptr("")}, want: tagmodel.ErrInvalidArgument},
		{name: "reset on a tag whose format has no date", tag: "plain", u: tagmodel.Update{Reset: ptr(tagmodel.ResetDay), Format: ptr("P{seq}")}, want: tagmodel.ErrInvalidArgument},
		{name: "bad time zone", tag: "daily", u: tagmodel.Update{TimeZone: ptr("Nowhere/Town")}, want: tagmodel.ErrInvalidArgument},
		{name: "time zone without reset", tag: "plain", u: tagmodel.Update{TimeZone: ptr("Europe/Paris")}, want: tagmodel.ErrInvalidArgument},
		{name: "ordered with reset", tag: "daily", u: tagmodel.Update{Ordered: ptr(true)}, want: tagmodel.ErrInvalidArgument},
		{name: "reset on an ordered tag", tag: "plain", u: tagmodel.Update{Ordered: ptr(true), Reset: ptr(tagmodel.ResetYear)}, want: tagmodel.ErrInvalidArgument},
		{name: "retention too long", tag: "daily", u: tagmodel.Update{RetentionDays: ptr(tagmodel.MaxRetentionDays + 1)}, want: tagmodel.ErrInvalidArgument},
		{name: "period name", tag: "daily=" + dayKey(0), u: tagmodel.Update{RetentionDays: ptr(3)}, want: tagmodel.ErrInvalidTag},
		{name: "unknown tag", tag: "nosuch", u: tagmodel.Update{Reset: ptr(tagmodel.ResetDay)}, want: tagmodel.ErrUnknownTag},
	}
	for _, tt := range updateTests {
		t.Run("update/"+tt.name, func(t *testing.T) {
			before := snapshot(t, s)
			checkErr(t, c, s.UpdateTag(ctx(t), tt.tag, tt.u), tt.want)
			checkUnchanged(t, s, before, "failed UpdateTag")
		})
	}
}

// A period pruned is never created again after its tag's time zone moved
// (issue 34, point 2): the record of what was pruned must not depend on
// the zone in effect later. Each case fetches a period of 30 days ago in
// the old zone, prunes it (retention lowered), moves the zone and raises
// the retention: the period's row is not created again. A period not
// pruned goes on from its row in the new zone: its key names one row
// whatever the zone.
func testPrunedPeriodAfterZoneChange(t *testing.T, c Config) {
	tests := []struct {
		name     string
		reset    tagmodel.Reset
		from, to string
	}{
		{name: "Berlin to London", reset: tagmodel.ResetDay, from: "Europe/Berlin", to: "Europe/London"},
		{name: "Tokyo to New York", reset: tagmodel.ResetDay, from: "Asia/Tokyo", to: "America/New_York"},
		{name: "easternmost to westernmost", reset: tagmodel.ResetDay, from: "Pacific/Kiritimati", to: "Etc/GMT+12"},
		{name: "UTC to Los Angeles", reset: tagmodel.ResetDay, from: "", to: "America/Los_Angeles"},
		{name: "month, Shanghai to Honolulu", reset: tagmodel.ResetMonth, from: "Asia/Shanghai", to: "Pacific/Honolulu"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := newStore(t, c)
			createPeriodic(t, s, tagmodel.Tag{Name: "inv", Step: 10, MaxID: 1, Reset: tt.reset, TimeZone: tt.from, RetentionDays: 400})
			from := mustZone(t, tt.from)
			back := time.Now().AddDate(0, 0, -30)
			if tt.reset == tagmodel.ResetMonth {
				back = time.Now().AddDate(0, -3, 0)
			}
			old := tagmodel.PeriodName("inv", tt.reset.PeriodAt(back, from).Key)
			kept := tagmodel.PeriodName("inv", tt.reset.PeriodAt(time.Now(), from).Key)
			if got, want := fetch(t, s, old, 0), (tagmodel.Allocation{Start: 1, End: 11, TagStep: 10}); got != want {
				t.Fatalf("Fetch(%s) = %+v, want %+v", old, got, want)
			}
			if got, want := fetch(t, s, kept, 0), (tagmodel.Allocation{Start: 1, End: 11, TagStep: 10}); got != want {
				t.Fatalf("Fetch(%s) = %+v, want %+v", kept, got, want)
			}
			mustUpdate(t, s, "inv", tagmodel.Update{RetentionDays: ptr(7)})
			if n, err := s.PrunePeriods(ctx(t)); err != nil || n != 1 {
				t.Fatalf("PrunePeriods = %d, %v, want 1 (%s)", n, err, old)
			}
			mustUpdate(t, s, "inv", tagmodel.Update{TimeZone: ptr(tt.to), RetentionDays: ptr(400)})
			before := snapshot(t, s)
			a, err := s.Fetch(ctx(t), old, 0)
			if !errors.Is(err, tagmodel.ErrPeriodExpired) && !errors.Is(err, tagmodel.ErrTagDeleted) {
				t.Fatalf("Fetch(%s) of a period pruned, after the zone moved to %q = %+v, %v, want ErrPeriodExpired or ErrTagDeleted: its numbers start again",
					old, tt.to, a, err)
			}
			checkErr(t, c, err, err) // the prefix
			checkUnchanged(t, s, before, "fetch of a period pruned, after a zone change")
			if got, want := fetch(t, s, kept, 0), (tagmodel.Allocation{Start: 11, End: 21, TagStep: 10}); got != want {
				t.Errorf("Fetch(%s) after the zone change = %+v, want %+v: a period's row goes on", kept, got, want)
			}
		})
	}
}

// The scenario of issue 34, point 2, through an allocator: a worker whose
// clock is 30 days behind hands out INV-…-000001 of a day of a tag in
// Europe/Berlin; the retention is lowered and the day pruned; the zone
// moved to Europe/London and the retention raised again. The same worker
// asks again: it must get an error, not INV-…-000001 a second time.
func testPrunedPeriodNumbersAfterZoneChange(t *testing.T, c Config) {
	s := newStore(t, c)
	createPeriodic(t, s, tagmodel.Tag{Name: "inv", Step: 10, MaxID: 1, Reset: tagmodel.ResetDay, TimeZone: "Europe/Berlin",
		RetentionDays: 60, Format: "INV-{date:20060102}-{seq:6}"})
	berlin := mustZone(t, "Europe/Berlin")
	y, m, d := time.Now().In(berlin).AddDate(0, 0, -30).Date()
	behind := time.Date(y, m, d, 12, 0, 0, 0, berlin) // noon: the same day in London
	take := func() ([]string, error) {
		a, err := segment.New(segment.Settings{Store: s, Now: func() time.Time { return behind },
			MaxWait: time.Second, ColdWait: time.Second, IdleTimeout: -1, Logger: slog.New(slog.DiscardHandler)})
		if err != nil {
			t.Fatal(err)
		}
		defer func() {
			if err := a.Close(ctx(t)); err != nil {
				t.Errorf("Close: %v", err)
			}
		}()
		runs, num, p, err := a.TakeNowNumbered("inv", 1, nil)
		if err == nil && p != nil {
			runs, err = p.Wait(ctx(t))
			num = p.Numbering()
		}
		if err != nil {
			return nil, err
		}
		return strings.Split(string(num.Append(nil, runs)), "\n"), nil
	}
	first, err := take()
	if want := "INV-" + behind.Format("20060102") + "-000001"; err != nil || !slices.Equal(first, []string{want}) {
		t.Fatalf("first number = %q, %v, want %q", first, err, want)
	}
	mustUpdate(t, s, "inv", tagmodel.Update{RetentionDays: ptr(7)})
	if n, err := s.PrunePeriods(ctx(t)); err != nil || n != 1 {
		t.Fatalf("PrunePeriods = %d, %v, want 1", n, err)
	}
	mustUpdate(t, s, "inv", tagmodel.Update{TimeZone: ptr("Europe/London"), RetentionDays: ptr(60)})
	again, err := take()
	if err == nil {
		t.Fatalf("after the prune and the zone change: %q handed out, want an error (first: %q)", again, first)
	}
	if !errors.Is(err, tagmodel.ErrPeriodExpired) && !errors.Is(err, tagmodel.ErrTagDeleted) {
		t.Errorf("after the prune and the zone change: %v, want ErrPeriodExpired or ErrTagDeleted", err)
	}
}
