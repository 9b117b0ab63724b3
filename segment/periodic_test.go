package segment

import (
	"context"
	"errors"
	"fmt"
	"github.com/dispenser-dev/dispenser/tagmodel"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

func mustLoc(tb testing.TB, name string) *time.Location {
	tb.Helper()
	loc, err := tagmodel.LoadLocation(name)
	if err != nil {
		tb.Fatal(err)
	}
	return loc
}

// TestPeriodAt: periods in time zones with offsets and across daylight
// saving changes: a day is from local midnight to local midnight, 23 or 25
// hours when the clocks change.
func TestPeriodAt(t *testing.T) {
	ny, sh := mustLoc(t, "America/New_York"), mustLoc(t, "Asia/Shanghai")
	scl, cai := mustLoc(t, "America/Santiago"), mustLoc(t, "Africa/Cairo")
	tests := []struct {
		name     string
		reset    tagmodel.Reset
		at       time.Time
		loc      *time.Location
		key      string
		duration time.Duration
	}{
		{"UTC day", tagmodel.ResetDay, time.Date(2026, 11, 24, 23, 59, 59, 999e6, time.UTC), time.UTC, "20261124", 24 * time.Hour},
		{"UTC next day", tagmodel.ResetDay, time.Date(2026, 11, 25, 0, 0, 0, 0, time.UTC), time.UTC, "20261125", 24 * time.Hour},
		{"UTC+8: 16:00 UTC is the next day", tagmodel.ResetDay, time.Date(2026, 11, 24, 16, 0, 0, 0, time.UTC), sh, "20261125", 24 * time.Hour},
		{"UTC+8: 15:59:59.999 UTC is still today", tagmodel.ResetDay, time.Date(2026, 11, 24, 15, 59, 59, 999e6, time.UTC), sh, "20261124", 24 * time.Hour},
		{"spring forward: a 23-hour day", tagmodel.ResetDay, time.Date(2026, 3, 8, 12, 0, 0, 0, ny), ny, "20260308", 23 * time.Hour},
		{"fall back: a 25-hour day", tagmodel.ResetDay, time.Date(2026, 11, 1, 1, 30, 0, 0, ny), ny, "20261101", 25 * time.Hour},
		{"month", tagmodel.ResetMonth, time.Date(2026, 2, 28, 23, 0, 0, 0, time.UTC), time.UTC, "202602", 28 * 24 * time.Hour},
		{"month in a leap year", tagmodel.ResetMonth, time.Date(2028, 2, 29, 23, 0, 0, 0, time.UTC), time.UTC, "202802", 29 * 24 * time.Hour},
		{"year", tagmodel.ResetYear, time.Date(2026, 12, 31, 23, 59, 59, 0, time.UTC), time.UTC, "2026", 365 * 24 * time.Hour},
		{"year with a DST change inside", tagmodel.ResetYear, time.Date(2026, 7, 1, 0, 0, 0, 0, ny), ny, "2026", 365 * 24 * time.Hour},
		// Santiago's clocks go from 23:59:59 -04 to 01:00 -03: the day
		// begins at the change, and is its own.
		{"midnight skipped", tagmodel.ResetDay, time.Date(2026, 9, 6, 12, 0, 0, 0, scl), scl, "20260906", 23 * time.Hour},
		{"the day before a skipped midnight", tagmodel.ResetDay, time.Date(2026, 9, 5, 23, 30, 0, 0, scl), scl, "20260905", 24 * time.Hour},
		{"Cairo: midnight skipped forwards", tagmodel.ResetDay, time.Date(2026, 4, 23, 23, 30, 0, 0, cai), cai, "20260423", 24 * time.Hour},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := tt.reset.PeriodAt(tt.at, tt.loc)
			if p.Key != tt.key {
				t.Errorf("key = %q, want %q", p.Key, tt.key)
			}
			if got := p.End.Sub(p.Start); got != tt.duration {
				t.Errorf("period %v..%v lasts %v, want %v", p.Start, p.End, got, tt.duration)
			}
			if tt.at.Before(p.Start) || !tt.at.Before(p.End) {
				t.Errorf("%v is not in its period %v..%v", tt.at, p.Start, p.End)
			}
			if next := tt.reset.PeriodAt(p.End, tt.loc); next.Start != p.End || next.Key <= p.Key {
				t.Errorf("the next period %+v does not start at %v with a larger key", next, p.End)
			}
		})
	}
}

// TestParseFormat: templates that could print one string for two numbers
// are refused.
func TestParseFormat(t *testing.T) {
	tests := []struct {
		name     string
		template string
		reset    tagmodel.Reset
		wantErr  bool
	}{
		{"the issue's example", "ORD-{date:20060102}-{seq:6}", tagmodel.ResetDay, false},
		{"date only", "{date:20060102}{seq}", tagmodel.ResetDay, false},
		{"month", "INV{date:200601}{seq:5}", tagmodel.ResetMonth, false},
		{"plain tag, prefix only", "ORD-{seq:8}", tagmodel.ResetNone, false},
		{"no seq", "ORD-{date:20060102}", tagmodel.ResetDay, true},
		{"seq not last", "{seq}-{date:20060102}", tagmodel.ResetDay, true},
		{"a daily tag without its date", "ORD-{seq:6}", tagmodel.ResetDay, true},
		{"date without year", "{date:0102}{seq}", tagmodel.ResetDay, true},
		{"date of variable width", "{date:2006-1-2}{seq}", tagmodel.ResetDay, true},
		{"month layout for a daily tag", "{date:200601}{seq}", tagmodel.ResetDay, true},
		{"date on a tag without periods", "{date:20060102}{seq}", tagmodel.ResetNone, true},
		{"two dates", "{date:2006}{date:20060102}{seq}", tagmodel.ResetDay, true},
		{"space", "ORD {seq}", tagmodel.ResetNone, true},
		{"newline", "ORD\n{seq}", tagmodel.ResetNone, true},
		{"unknown field", "{tag}{seq}", tagmodel.ResetNone, true},
		{"unclosed", "{seq", tagmodel.ResetNone, true},
		{"width zero", "{seq:0}", tagmodel.ResetNone, true},
		{"width too large", "{seq:20}", tagmodel.ResetNone, true},
		{"too long", strings.Repeat("x", 65) + "{seq}", tagmodel.ResetNone, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := tagmodel.ParseFormat(tt.template, tt.reset, time.UTC)
			if (err != nil) != tt.wantErr {
				t.Fatalf("ParseFormat(%q, %s) = %v, want error %v", tt.template, tt.reset, err, tt.wantErr)
			}
			if err != nil && !errors.Is(err, tagmodel.ErrInvalidArgument) {
				t.Fatalf("error %v does not wrap ErrInvalidArgument", err)
			}
		})
	}
}

// TestFormatNeverWraps: a number longer than its padding keeps all its
// digits.
func TestFormatNeverWraps(t *testing.T) {
	f, err := tagmodel.ParseFormat("ORD-{date:20060102}-{seq:3}", tagmodel.ResetDay, time.UTC)
	if err != nil {
		t.Fatal(err)
	}
	head := f.Head(time.Date(2026, 11, 24, 0, 0, 0, 0, time.UTC))
	for _, tt := range []struct {
		seq  int64
		want string
	}{{1, "ORD-20261124-001"}, {999, "ORD-20261124-999"}, {1000, "ORD-20261124-1000"}, {1<<63 - 1, "ORD-20261124-9223372036854775807"}} {
		if got := string(f.AppendNumber(nil, head, tt.seq)); got != tt.want {
			t.Errorf("%d: got %q, want %q", tt.seq, got, tt.want)
		}
	}
}

// clock is a settable clock for an allocator.
type clock struct {
	mu  sync.Mutex // protects now
	now time.Time
}

func (c *clock) Now() time.Time  { c.mu.Lock(); defer c.mu.Unlock(); return c.now }
func (c *clock) set(t time.Time) { c.mu.Lock(); c.now = t; c.mu.Unlock() }

// takeFormatted takes n formatted numbers of tag from a.
func takeFormatted(tb testing.TB, a *Allocator, tag string, n int) []string {
	tb.Helper()
	runs, num, p, err := a.TakeNowNumbered(tag, n, nil)
	if err == nil && p != nil {
		runs, err = p.Wait(context.Background())
		num = p.Numbering()
	}
	if err != nil {
		tb.Fatalf("TakeNowNumbered(%q, %d): %v", tag, n, err)
	}
	return strings.Split(string(num.Append(nil, runs)), "\n")
}

// TestPeriodsRestartAtTheirEnd: with an injected clock, a request a
// millisecond before midnight (in the tag's time zone) and one at
// midnight get numbers of their own days, each day from the tag's start;
// the plain reply is the number without its date; an earlier day goes on
// where it stopped.
func TestPeriodsRestartAtTheirEnd(t *testing.T) {
	sh := mustLoc(t, "Asia/Shanghai")
	st := newMemStore(t, tagmodel.Tag{Name: "orders", MaxID: 1, Step: 10, Reset: tagmodel.ResetDay, TimeZone: "Asia/Shanghai", Format: "ORD-{date:20060102}-{seq:4}"})
	c := &clock{now: time.Date(2026, 11, 24, 23, 59, 59, 998e6, sh)}
	a := newAllocator(t, Settings{Store: st, Now: c.Now, MaxWait: time.Minute})

	if got, want := takeFormatted(t, a, "orders", 2), []string{"ORD-20261124-0001", "ORD-20261124-0002"}; !slices.Equal(got, want) {
		t.Fatalf("before midnight: %q, want %q", got, want)
	}
	c.set(time.Date(2026, 11, 24, 23, 59, 59, 999e6, sh))
	if got, want := take(t, a, "orders", 1), []int64{3}; !slices.Equal(got, want) {
		t.Fatalf("plain, a millisecond before midnight: %v, want %v", got, want)
	}
	c.set(time.Date(2026, 11, 25, 0, 0, 0, 0, sh))
	if got, want := takeFormatted(t, a, "orders", 3), []string{"ORD-20261125-0001", "ORD-20261125-0002", "ORD-20261125-0003"}; !slices.Equal(got, want) {
		t.Fatalf("at midnight: %q, want %q", got, want)
	}
	// A worker whose clock is behind goes on with the day before.
	c.set(time.Date(2026, 11, 24, 23, 59, 59, 999e6, sh))
	if got, want := takeFormatted(t, a, "orders", 1), []string{"ORD-20261124-0004"}; !slices.Equal(got, want) {
		t.Fatalf("back before midnight: %q, want %q", got, want)
	}
	if got := st.maxID("orders"); got != 1 {
		t.Errorf("the tag's own max_id moved to %d, want 1 (the start of every period)", got)
	}
	for _, period := range []string{"orders=20261124", "orders=20261125"} {
		if st.fetchCount(period) == 0 {
			t.Errorf("no fetch of %s", period)
		}
	}
}

// TestSkippedMidnightServedAsItsDay: in America/Santiago, 2026-09-06
// begins at 01:00 -03 (its midnight is skipped); a worker serves it as
// its own day, from its own row, and prints its date, not the day
// before's.
func TestSkippedMidnightServedAsItsDay(t *testing.T) {
	scl := mustLoc(t, "America/Santiago")
	st := newMemStore(t, tagmodel.Tag{Name: "orders", MaxID: 1, Step: 10, Reset: tagmodel.ResetDay, TimeZone: "America/Santiago", Format: "ORD-{date:20060102}-{seq:4}"})
	c := &clock{now: time.Date(2026, 9, 5, 22, 0, 0, 0, scl)}
	a := newAllocator(t, Settings{Store: st, Now: c.Now, MaxWait: time.Minute})
	if got, want := takeFormatted(t, a, "orders", 2), []string{"ORD-20260905-0001", "ORD-20260905-0002"}; !slices.Equal(got, want) {
		t.Fatalf("the day before: %q, want %q", got, want)
	}
	c.set(time.Date(2026, 9, 6, 10, 0, 0, 0, scl))
	if got, want := takeFormatted(t, a, "orders", 2), []string{"ORD-20260906-0001", "ORD-20260906-0002"}; !slices.Equal(got, want) {
		t.Fatalf("the day whose midnight is skipped: %q, want %q", got, want)
	}
	if st.fetchCount("orders=20260906") == 0 {
		t.Errorf("no fetch of orders=20260906")
	}
}

// TestFormattedErrors: a tag without a format, and an ordered tag, refuse
// formatted numbers and take nothing.
func TestFormattedErrors(t *testing.T) {
	st := newMemStore(t, tagmodel.Tag{Name: "plain", MaxID: 1, Step: 10}, tagmodel.Tag{Name: "fmt", MaxID: 1, Step: 10, Format: "F{seq:3}"})
	a := newAllocator(t, Settings{Store: st})
	for _, tag := range []string{"plain", "plain"} { // unknown, then known
		_, _, p, err := a.TakeNowNumbered(tag, 1, nil)
		if err == nil && p != nil {
			_, err = p.Wait(context.Background())
		}
		if !errors.Is(err, ErrNoFormat) {
			t.Fatalf("%s: err = %v, want ErrNoFormat", tag, err)
		}
	}
	if got := take(t, a, "plain", 1); got[0] != 1 {
		t.Errorf("after the refusals: %v, want 1 (nothing taken)", got)
	}
	if got, want := takeFormatted(t, a, "fmt", 2), []string{"F001", "F002"}; !slices.Equal(got, want) {
		t.Errorf("a tag without periods: %q, want %q", got, want)
	}
}

// TestWorkersWithSkewedClocksAcrossMidnight: four workers on one store,
// whose clocks are up to 300 ms apart, hand out formatted numbers of a
// daily tag while the time crosses midnight: no formatted number twice,
// and both days are served. (Formatting with the date of the clock when
// the number is written, instead of the period it was taken in, makes it
// fail: a worker behind prints its yesterday's numbers with today's date.)
func TestWorkersWithSkewedClocksAcrossMidnight(t *testing.T) {
	st := newMemStore(t, tagmodel.Tag{Name: "orders", MaxID: 1, Step: 5, Reset: tagmodel.ResetDay, Format: "{date:20060102}{seq:6}"})
	midnight := time.Date(2026, 11, 25, 0, 0, 0, 0, time.UTC)
	var base atomic.Int64 // the true time, UnixNano
	base.Store(midnight.Add(-200 * time.Millisecond).UnixNano())
	skews := []time.Duration{-300 * time.Millisecond, -50 * time.Millisecond, 0, 100 * time.Millisecond}
	var mu sync.Mutex
	seen := map[string]int{}
	var wg sync.WaitGroup
	for w, skew := range skews {
		now := func() time.Time { return time.Unix(0, base.Load()).Add(skew) }
		a := newAllocator(t, Settings{Store: st, Now: now, MaxWait: time.Minute, MaxStep: 5})
		for range 4 {
			wg.Go(func() {
				for i := range 150 {
					base.Add(int64(time.Millisecond)) // time goes on, from all workers
					for _, s := range takeFormatted(t, a, "orders", 1+i%3) {
						mu.Lock()
						if prev, ok := seen[s]; ok {
							t.Errorf("%s from workers %d and %d", s, prev, w)
						}
						seen[s] = w
						mu.Unlock()
					}
				}
			})
		}
	}
	wg.Wait()
	days := map[string]bool{}
	for s := range seen {
		days[s[:8]] = true
	}
	if !days["20261124"] || !days["20261125"] {
		t.Errorf("days served %v, want both 20261124 and 20261125", days)
	}
	t.Logf("%d formatted numbers, %d days", len(seen), len(days))
}

// TestPeriodTagRemoved: a tag with periods that is removed from the store
// stops being served with ErrUnknownTag, its periods too.
func TestPeriodTagRemoved(t *testing.T) {
	st := newMemStore(t, tagmodel.Tag{Name: "orders", MaxID: 1, Step: 1, Reset: tagmodel.ResetDay})
	c := &clock{now: time.Date(2026, 11, 24, 12, 0, 0, 0, time.UTC)}
	a := newAllocator(t, Settings{Store: st, Now: c.Now, MaxStep: 1, MaxDepth: 1})
	take(t, a, "orders", 1)
	st.set(func(s *memStore) { delete(s.tags, "orders"); delete(s.tags, "orders=20261124") })
	if err := a.Refresh(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := a.Refresh(context.Background()); err != nil {
		t.Fatal(err)
	}
	if _, err := a.Take(context.Background(), "orders", 5, nil); !errors.Is(err, tagmodel.ErrUnknownTag) {
		t.Fatalf("err = %v, want ErrUnknownTag", err)
	}
	_ = fmt.Sprint
}

// TestWarmPeriodicTag: warming a tag with a reset period loads the period
// of now; its own row, which hands out nothing (the stores refuse to fetch
// it), is never fetched. (Warming the tag's own buffer instead retried a
// refused fetch until the allocator closed: Warm returned 0.)
func TestWarmPeriodicTag(t *testing.T) {
	st := newMemStore(t, tagmodel.Tag{Name: "daily", MaxID: 1, Step: 10, Reset: tagmodel.ResetDay})
	c := &clock{now: time.Date(2026, 11, 24, 12, 0, 0, 0, time.UTC)}
	a := newAllocator(t, Settings{Store: st, Now: c.Now})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if got := a.Warm(ctx, []string{"daily"}); got != 1 {
		t.Fatalf("Warm = %d, want 1", got)
	}
	if n := st.fetchCount("daily"); n != 0 {
		t.Errorf("%d fetches of the tag's own row, want 0", n)
	}
	if _, pending, err := a.TakeNow("daily", 1, nil); err != nil || pending != nil {
		t.Errorf("TakeNow after Warm: pending %v, err %v; want an ID from memory", pending != nil, err)
	}
}
