package tagmodel

import (
	"fmt"
	"strings"
	"sync"
	"time"
)

// PeriodOfKey returns the period of r whose key is key (a period name's
// KEY: YYYYMMDD for a day, YYYYMM for a month, YYYY for a year) in loc:
// what a store needs to create, or refuse, a period's row. A key that is
// not one of r's periods (another length, a date that does not exist), or
// a tag without a reset period, yields ErrInvalidArgument.
func (r Reset) PeriodOfKey(key string, loc *time.Location) (Period, error) {
	var layout string
	switch r {
	case ResetDay:
		layout = "20060102"
	case ResetMonth:
		layout = "200601"
	case ResetYear:
		layout = "2006"
	default:
		return Period{}, fmt.Errorf("%w: period %q of a tag without a reset period", ErrInvalidArgument, key)
	}
	t, err := time.ParseInLocation(layout, key, loc)
	if err != nil || len(key) != len(layout) {
		return Period{}, fmt.Errorf("%w: period %q is not a %s (want %s)", ErrInvalidArgument, key, r, layout)
	}
	// Noon, so that a midnight that a daylight saving change skips still
	// lands in the day.
	p := r.PeriodAt(t.Add(12*time.Hour), loc)
	if p.Key != key {
		return Period{}, fmt.Errorf("%w: period %q is not a %s (want %s)", ErrInvalidArgument, key, r, layout)
	}
	return p, nil
}

// PeriodOfKey returns the period of t whose key is key, in t's time zone.
// Errors wrap ErrInvalidArgument: t has no reset period (so no periods),
// its time zone does not load, or key is not one of its periods.
func (t Tag) PeriodOfKey(key string) (Period, error) {
	if t.Reset == ResetNone {
		return Period{}, fmt.Errorf("%w: tag %q has no reset period, so no period %q", ErrInvalidArgument, t.Name, key)
	}
	loc, err := LoadLocation(t.TimeZone)
	if err != nil {
		return Period{}, err
	}
	return t.Reset.PeriodOfKey(key, loc)
}

// Retention returns how long a tag with retention days keeps a period's
// row after the period ended: days times 24 hours (DefaultRetentionDays
// for 0). Stores compare by it: a period whose row is missing is expired
// once End + Retention is not after now.
func Retention(days int) time.Duration {
	if days == 0 {
		days = DefaultRetentionDays
	}
	return time.Duration(days) * 24 * time.Hour
}

// PeriodExpired reports whether a period ending at end, of a tag with
// retention days, is expired at now: its row, missing, is not created
// again.
func PeriodExpired(end, now time.Time, days int) bool {
	return !end.After(now.Add(-Retention(days)))
}

// ApplyUpdate returns t with the fields of u that are not nil, checked as
// Admin.UpdateTag takes them: a reset period can be set on a tag without
// one, never changed or removed, and the tag as updated must pass
// Tag.Periodic (its settings are checked together: a format a daily tag
// accepts, a time zone only with a reset period). Stores call it on the
// tag as stored, in the same atomic step as the write. Errors wrap
// ErrInvalidArgument (or ErrInvalidTag); step and description are checked
// by Update.Check.
func ApplyUpdate(t Tag, u Update) (Tag, error) {
	oldFormat := t.Format
	if u.Step != nil {
		t.Step = *u.Step
	}
	if u.Description != nil {
		t.Description = *u.Description
	}
	if u.Ordered != nil {
		t.Ordered = *u.Ordered
	}
	if u.Reset != nil {
		r, err := ParseReset(string(*u.Reset))
		if err != nil {
			return Tag{}, fmt.Errorf("%q: %w", t.Name, err)
		}
		if t.Reset != ResetNone && r != t.Reset {
			return Tag{}, fmt.Errorf("%q: %w: reset period %s cannot be changed to %s: each period's row is named after its key, and numbers of the new periods would repeat those of the old ones; create a new tag", t.Name, ErrInvalidArgument, t.Reset, r)
		}
		t.Reset = r
	}
	if u.TimeZone != nil {
		// A tag with periods may move to another zone (issue 34, point
		// 2). Safety argument: a period's numbers come from one row, named
		// after its key (tag=KEY); the zone decides only which instants a
		// key names. After a move, Berlin's 20261029 and London's 20261029
		// are one row, its sequence going on: no two rows have one key, so
		// a key's numbers never repeat while its row lives, and a format's
		// date text, which names one key (ParseFormat), never comes from
		// two rows. A row that is gone (pruned) is never created again:
		// the record of what was pruned is compared with the key's
		// earliest end in any zone (PeriodPruned), not with its end in the
		// zone of now. What a move changes is when keys begin and end: a
		// worker serves the new zone's key of now, whose row goes on if it
		// exists and is created from the tag's start if not, and a key the
		// old zone had already left may be served again from its row.
		// Tag.Periodic refuses a zone beyond MaxZoneOffset, for which
		// PeriodPruned would not hold.
		t.TimeZone = *u.TimeZone
	}
	if u.Format != nil {
		t.Format = *u.Format
	}
	if u.RetentionDays != nil {
		t.RetentionDays = *u.RetentionDays
	}
	p, err := t.Periodic()
	if err != nil {
		return Tag{}, err
	}
	if u.Ordered != nil || u.Format != nil {
		if err := checkOrderedFormat(t); err != nil {
			return Tag{}, err
		}
	}
	if err := formatChange(oldFormat, t.Format); err != nil {
		return Tag{}, fmt.Errorf("%q: %w", t.Name, err)
	}
	t.Reset = p.Reset
	return t, nil
}

// formatChange checks a change of a tag's format from old to format: a
// format, once set, keeps everything before {seq} for good; only the
// width of {seq} may change. Errors wrap ErrInvalidArgument.
//
// Why: numbers already handed out were written in the old format, and the
// store does not remember which texts those were, nor which formats a tag
// has had. Two formats whose heads (the text before {seq}) differ can
// write two numbers alike: ORD-{seq} writes 115 as ORD-115, and
// ORD-1{seq} writes 15 the same way; D{date:20060102}{seq} writes 5 of
// 2026-01-01 as D202601015, and D{date:2006002}{seq} writes 15 of
// 2026-01-10 the same way. Only a format whose head is the old one's is
// proven disjoint from it:
// a head names one period in every format of the tag (ParseFormat), and
// the digits after it read as one number whatever the zero padding, a
// number its period's row hands out once. A removed format is refused
// too, since a format set later would have no old one to be checked
// against. A format set on a tag without one is free: no formatted number
// of it was handed out (a format removed by a version before this check
// is the one case it cannot see).
//
// The reset period and the time zone need no rule here: a reset period,
// once set, never changes (ApplyUpdate), and a date layout prints the
// period's date and nothing of the time of day or the zone
// (checkDateLayout), so after a change of time zone every period's head
// is what it was: the head of the period keyed YYYYMMDD, whose row is
// named by the same key.
func formatChange(old, format string) error {
	if old == "" || format == old {
		return nil
	}
	if format == "" {
		return fmt.Errorf("%w: format %s cannot be removed: numbers were handed out in it, and a format set later could write others alike; create a new tag for numbers without it", ErrInvalidArgument, old)
	}
	if formatHead(format) != formatHead(old) {
		return fmt.Errorf("%w: format %s cannot be changed to %s: numbers were handed out in the old format, and the new one could write other numbers alike (ORD-{seq} writes 115 as ORD-115, and so does ORD-1{seq} with 15); only the width of {seq} may change: create a new tag for another format", ErrInvalidArgument, old, format)
	}
	return nil
}

// formatHead returns the template's text before its {seq} (which comes
// last).
func formatHead(template string) string {
	if i := strings.LastIndex(template, "{seq"); i >= 0 {
		return template[:i]
	}
	return template
}

// MaxZoneOffset is the greatest UTC offset a tag's time zone may have
// (Tag.Periodic): +14:00, Pacific/Kiritimati's. No IANA zone has had a
// greater one since 1867 (Alaska's local mean time before its purchase).
const MaxZoneOffset = 14 * time.Hour

// easternmost is the zone of MaxZoneOffset.
var easternmost = time.FixedZone("UTC+14", int(MaxZoneOffset/time.Second))

// EarliestEnd returns the earliest instant at which r's period key ends in
// any time zone a tag may have: its end at MaxZoneOffset, where a date
// ends first. Errors as PeriodOfKey's.
func (r Reset) EarliestEnd(key string) (time.Time, error) {
	p, err := r.PeriodOfKey(key, easternmost)
	if err != nil {
		return time.Time{}, err
	}
	return p.End, nil
}

// PeriodPruned reports whether r's period key is among the periods whose
// rows a store pruned, as the store recorded them: prunedUntil, the
// latest end of a period row pruned (its period_end, computed in the time
// zone the tag had when the row was created). A period pruned is never
// created again, whatever the tag's time zone is now.
//
// Safety argument. The record is an instant, computed in a zone that may
// no longer be the tag's; the check must not compare it with the period's
// end in the current zone (issue 34, point 2: a daily tag pruned in
// Europe/Berlin and moved to Europe/London ends each day an hour later
// than the record of it, and its pruned day was created again from the
// tag's start, handing out INV-20261029-000001 twice). What must never
// come back is the key, the text in the period's name and numbers. A row
// of key K created in zone Z records the end of K in Z; Z's offset is at
// most MaxZoneOffset, so that end is at or after EarliestEnd(K); pruning
// records an instant at or after the end of every row it deletes. So every
// pruned K has EarliestEnd(K) <= prunedUntil, whatever zone the tag had
// when, and is refused here. The price: a key never pruned whose
// EarliestEnd is at or before prunedUntil is refused too. That is only
// the period right after the last one pruned, only for a tag in a zone at
// -10:00 or further west (its day ends 24 hours after the record, at
// least 10 of them after the same date ends at +14:00), and only while
// its row is missing, at least a day after it ended (pruning waits at
// least a day of retention): fetched by a worker whose clock is that far
// behind, it answers ErrPeriodExpired instead of a number.
func PeriodPruned(r Reset, key string, prunedUntil time.Time) (bool, error) {
	end, err := r.EarliestEnd(key)
	if err != nil {
		return false, err
	}
	return !end.After(prunedUntil), nil
}

// zoneChecked caches checkZoneOffset's answers by zone name: a zone's
// rules do not change while the process runs.
var zoneChecked sync.Map // zone name → error (nil: fine)

// checkZoneOffset returns an error if loc has an offset greater than
// MaxZoneOffset at any time from 1900 to 2200: PeriodPruned, which keeps a
// pruned period from coming back after a zone change, holds only for
// zones within it. No IANA zone goes beyond it; a zone that did (a
// future tz database, a custom zoneinfo) is refused when a tag is given
// it. Errors wrap ErrInvalidArgument.
func checkZoneOffset(loc *time.Location) error {
	if v, ok := zoneChecked.Load(loc.String()); ok {
		err, _ := v.(error)
		return err
	}
	var err error
	t, stop := time.Date(1900, 1, 1, 0, 0, 0, 0, time.UTC), time.Date(2200, 1, 1, 0, 0, 0, 0, time.UTC)
	for t.Before(stop) {
		name, off := t.In(loc).Zone()
		if time.Duration(off)*time.Second > MaxZoneOffset {
			err = fmt.Errorf("%w: time zone %q is %s ahead of UTC at %s, more than the +14:00 a tag's zone may be (the record of pruned periods relies on it); choose another zone",
				ErrInvalidArgument, loc, time.Duration(off)*time.Second, t.In(loc).Format(time.DateOnly+" ")+name)
			break
		}
		_, end := t.In(loc).ZoneBounds()
		if !end.After(t) {
			break // no more transitions
		}
		t = end
	}
	zoneChecked.Store(loc.String(), err)
	return err
}
