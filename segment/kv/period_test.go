package kv_test

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/dispenser-dev/dispenser/segment/kv"
	"github.com/dispenser-dev/dispenser/tagmodel"
	"github.com/dispenser-dev/dispenser/testenv"
)

// TestPeriodsByTheStoresClock: a missing period is expired, and pruned, by
// the Store's clock (Settings.Now); a pruned period's key keeps its delete
// marker, so a Store whose clock is behind does not create it again.
func TestPeriodsByTheStoresClock(t *testing.T) {
	srv := testenv.NATS(t)
	late := newStore(t, srv, kv.Settings{Logger: quiet})
	ahead := newStore(t, srv, kv.Settings{Logger: quiet, Now: func() time.Time { return time.Now().AddDate(0, 0, 10) }})
	if err := late.CreateTag(ctx, tagmodel.Tag{Name: "daily", Step: 10, MaxID: 1, Reset: tagmodel.ResetDay}); err != nil {
		t.Fatal(err)
	}
	now := time.Now().UTC()
	today := tagmodel.PeriodName("daily", tagmodel.ResetDay.PeriodAt(now, time.UTC).Key)
	yesterday := tagmodel.PeriodName("daily", tagmodel.ResetDay.PeriodAt(now.AddDate(0, 0, -1), time.UTC).Key)
	want := tagmodel.Allocation{Start: 1, End: 11, TagStep: 10}
	if a, err := late.Fetch(ctx, today, 0); err != nil || a != want {
		t.Fatalf("Fetch(%s) = %+v, %v, want %+v", today, a, err, want)
	}
	if a, err := ahead.Fetch(ctx, yesterday, 0); !errors.Is(err, tagmodel.ErrPeriodExpired) {
		t.Errorf("Fetch(%s) by a clock 10 days ahead = %+v, %v, want ErrPeriodExpired", yesterday, a, err)
	}
	// An existing period's key serves on, whatever the clock.
	if a, err := ahead.Fetch(ctx, today, 0); err != nil || a.Start != 11 {
		t.Errorf("Fetch(%s) by a clock 10 days ahead = %+v, %v, want the segment from 11", today, a, err)
	}
	if n, err := late.PrunePeriods(ctx); err != nil || n != 0 {
		t.Errorf("PrunePeriods by the right clock = %d, %v, want 0", n, err)
	}
	if n, err := ahead.PrunePeriods(ctx); err != nil || n != 1 {
		t.Fatalf("PrunePeriods by a clock 10 days ahead = %d, %v, want 1", n, err)
	}
	if got := rawValueOrDeleted(t, bucket(t, srv, kv.DefaultBucket), today); got != "<deleted>" {
		t.Errorf("pruned key %s holds %s, want a delete marker", today, got)
	}
	if a, err := late.Fetch(ctx, today, 0); !errors.Is(err, tagmodel.ErrTagDeleted) {
		t.Errorf("Fetch(%s) of a pruned period by a clock behind = %+v, %v, want ErrTagDeleted", today, a, err)
	}
	if a, err := late.Fetch(ctx, yesterday, 0); err != nil || a != want {
		t.Errorf("Fetch(%s) by the right clock = %+v, %v, want %+v", yesterday, a, err, want)
	}
}

// TestPeriodInPurgedBucket: a missing period key is a new period only in a
// bucket that still holds what it held; also when an operator put the
// tag's key back by hand (but not its periods' keys), or its numbers would
// start again at the tag's max_id. The fetch is refused with
// ErrBucketPurged and no key is written.
func TestPeriodInPurgedBucket(t *testing.T) {
	for _, tt := range []struct {
		name   string
		putTag bool // the tag's key put back by hand after the purge
	}{
		{name: "purged"},
		{name: "tag put back", putTag: true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			srv := testenv.NATS(t)
			s := newStore(t, srv, kv.Settings{Logger: quiet})
			if err := s.CreateTag(ctx, tagmodel.Tag{Name: "daily", Step: 10, MaxID: 1, Reset: tagmodel.ResetDay}); err != nil {
				t.Fatal(err)
			}
			today := tagmodel.PeriodName("daily", tagmodel.ResetDay.PeriodAt(time.Now(), time.UTC).Key)
			if _, err := s.Fetch(ctx, today, 0); err != nil {
				t.Fatal(err)
			}
			purge(t, srv)
			b := bucket(t, srv, kv.DefaultBucket)
			if tt.putTag {
				put(t, b, "daily", `{"max_id":1,"step":10,"reset":"day"}`)
			}
			if a, err := s.Fetch(ctx, today, 0); !errors.Is(err, kv.ErrBucketPurged) {
				t.Errorf("Fetch(%s) after the purge = %+v, %v, want ErrBucketPurged", today, a, err)
			}
			if got := rawValueOrDeleted(t, b, today); got != "<deleted>" {
				t.Errorf("period key %s after the purge holds %s, want nothing", today, got)
			}
		})
	}
}

// TestCachedWritesKeepEveryField: fetches and give-backs that start from
// the Store's remembered value (no read) write back every field of the
// key's value: a tag's format and a period's end. (With a cache that kept
// only max_id, step, description and ordered, the second fetch of a period
// wrote its key without period_end, and a give-back erased a tag's
// format.)
func TestCachedWritesKeepEveryField(t *testing.T) {
	srv := testenv.NATS(t)
	s := newStore(t, srv, kv.Settings{Logger: quiet})
	for _, tag := range []tagmodel.Tag{
		{Name: "fmt", Step: 10, MaxID: 1, Format: "F{seq:4}"},
		{Name: "daily", Step: 10, MaxID: 1, Reset: tagmodel.ResetDay, TimeZone: "Asia/Shanghai", Format: "D{date:20060102}{seq}", RetentionDays: 30},
	} {
		if err := s.CreateTag(ctx, tag); err != nil {
			t.Fatal(err)
		}
	}
	loc, err := tagmodel.LoadLocation("Asia/Shanghai")
	if err != nil {
		t.Fatal(err)
	}
	period := tagmodel.PeriodName("daily", tagmodel.ResetDay.PeriodAt(time.Now(), loc).Key)
	var last tagmodel.Allocation
	for range 3 {
		if last, err = s.Fetch(ctx, "fmt", 0); err != nil {
			t.Fatal(err)
		}
		if _, err := s.Fetch(ctx, period, 0); err != nil {
			t.Fatal(err)
		}
	}
	if ok, err := s.GiveBack(ctx, "fmt", last.End, last.End-5); err != nil || !ok {
		t.Fatalf("GiveBack = %v, %v", ok, err)
	}
	b := bucket(t, srv, kv.DefaultBucket)
	if got := rawValueOrDeleted(t, b, "fmt"); !strings.Contains(got, `"format":"F{seq:4}"`) {
		t.Errorf("key fmt after cached fetches and a give-back: %s, want its format", got)
	}
	if got := rawValueOrDeleted(t, b, period); !strings.Contains(got, `"period_end"`) {
		t.Errorf("key %s after cached fetches: %s, want its period_end", period, got)
	}
	fresh := newStore(t, srv, kv.Settings{Logger: quiet})
	if tag, err := fresh.Tag(ctx, "fmt"); err != nil || tag.Format != "F{seq:4}" {
		t.Errorf("Tag(fmt) = %+v, %v; want its format", tag, err)
	}
}
