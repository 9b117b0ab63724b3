package tagmodel

import (
	"fmt"
	"strings"
	"time"

	"github.com/dispenser-dev/dispenser/protocol"
)

// Reset is a tag's reset period: how often its numbers start again from the
// tag's start. Nothing is ever reset: each period is a sequence of its own,
// one store row per tag and period (its period name, PeriodName), created on
// the period's first fetch from the tag's start and step. The empty Reset is
// a tag without periods.
type Reset string

// The reset periods.
const (
	ResetNone  Reset = ""
	ResetDay   Reset = "day"
	ResetMonth Reset = "month"
	ResetYear  Reset = "year"
)

// ParseReset reads a reset period as the tags commands and stores spell it:
// "day", "month", "year", or "none" (or "") for none. Errors wrap
// ErrInvalidArgument.
func ParseReset(s string) (Reset, error) {
	switch r := Reset(s); r {
	case ResetDay, ResetMonth, ResetYear:
		return r, nil
	case ResetNone, "none":
		return ResetNone, nil
	}
	return ResetNone, fmt.Errorf("%w: reset %q: want day, month, year or none", ErrInvalidArgument, s)
}

// String returns the reset period's name, "none" for none.
func (r Reset) String() string {
	if r == ResetNone {
		return "none"
	}
	return string(r)
}

// PeriodSep separates a tag from its period's key in a period name: a
// character no tag has (so that no tag's row is a period's) and that NATS
// KV keys allow.
const PeriodSep = "="

// MaxPeriodicTag is the longest name a tag with a reset period may have: its
// period names (tag, PeriodSep and a key of up to 8 digits) must fit
// leaf_alloc.biz_tag, a varchar(128).
const MaxPeriodicTag = 128 - 1 - 8

// DefaultRetentionDays is how many days a period's row is kept after the
// period ended, unless the tag says otherwise (Tag.RetentionDays), and
// MaxRetentionDays the most a tag may keep them.
const (
	DefaultRetentionDays = 7
	MaxRetentionDays     = 3660
)

// Period is one period of a tag with a reset period: Key names it in its
// period name ("20261124" for a day, "202611" for a month, "2026" for a
// year, in the tag's time zone), and its numbers belong to [Start, End).
type Period struct {
	Key        string
	Start, End time.Time
}

// PeriodAt returns the period of r that holds t in loc. r must not be
// ResetNone.
//
// A period is the instants whose date in loc is its date (day), or falls
// in its month or year: it starts at the first instant of its first date
// and ends at the first instant of the next period's (dayStart), and its
// key is its date, not the date its start prints. Where a daylight saving
// change skips midnight, time.Date's midnight is not the day's first
// instant: America/Santiago goes from 23:59:59 -04 to 01:00 -03, and
// time.Date gives 23:00 -04 of the day before, which named a whole day's
// numbers after the day before (TestPeriodAtSkippedMidnight).
func (r Reset) PeriodAt(t time.Time, loc *time.Location) Period {
	t = t.In(loc)
	y, m, d := t.Date()
	var p Period
	switch r {
	case ResetDay:
		p.Start, p.End = dayStart(y, m, d, loc), dayStart(y, m, d+1, loc)
		p.Key = time.Date(y, m, d, 0, 0, 0, 0, time.UTC).Format("20060102")
	case ResetMonth:
		p.Start, p.End = dayStart(y, m, 1, loc), dayStart(y, m+1, 1, loc)
		p.Key = time.Date(y, m, 1, 0, 0, 0, 0, time.UTC).Format("200601")
	case ResetYear:
		p.Start, p.End = dayStart(y, 1, 1, loc), dayStart(y+1, 1, 1, loc)
		p.Key = time.Date(y, 1, 1, 0, 0, 0, 0, time.UTC).Format("2006")
	default:
		panic("segment: PeriodAt of a tag without a reset period")
	}
	return p
}

// dayStart returns the first instant whose date in loc is y-m-d or later
// (y-m-d normalized as time.Date does): its midnight, or, where a zone
// change skips midnight, the change (01:00 of a day that begins with a
// daylight saving hour; the next date's first instant for a date a zone
// skipped, as Pacific/Apia skipped 2011-12-30). time.Date reads a missing
// midnight with one of the zone's two offsets: with the old one it is the
// change itself, with the new one an instant of the day before, whose
// zone period ends at the change.
func dayStart(y int, m time.Month, d int, loc *time.Location) time.Time {
	want := time.Date(y, m, d, 0, 0, 0, 0, time.UTC)
	t := time.Date(y, m, d, 0, 0, 0, 0, loc)
	ty, tm, td := t.Date()
	if time.Date(ty, tm, td, 0, 0, 0, 0, time.UTC).Before(want) {
		if _, end := t.ZoneBounds(); !end.IsZero() {
			t = end
		}
	}
	return t
}

// KeyLen is the length of r's period keys.
func (r Reset) KeyLen() int {
	switch r {
	case ResetDay:
		return 8
	case ResetMonth:
		return 6
	case ResetYear:
		return 4
	}
	return 0
}

// PeriodName returns the store name of tag's period key: tag=key.
func PeriodName(tag, key string) string { return tag + PeriodSep + key }

// SplitPeriodName splits a period name into its tag and period key; ok is
// false for anything else (a tag, an invalid name).
func SplitPeriodName(name string) (tag, key string, ok bool) {
	tag, key, ok = strings.Cut(name, PeriodSep)
	if !ok || len(tag) > MaxPeriodicTag || !ValidTag(tag) {
		return "", "", false
	}
	switch len(key) {
	case 4, 6, 8:
	default:
		return "", "", false
	}
	for i := range len(key) {
		if key[i] < '0' || key[i] > '9' {
			return "", "", false
		}
	}
	return tag, key, true
}

// ValidName reports whether name is a store row's name: a tag (ValidTag) or
// a period name (SplitPeriodName).
func ValidName(name string) bool {
	if ValidTag(name) {
		return true
	}
	_, _, ok := SplitPeriodName(name)
	return ok
}

// CheckName returns nil for a valid store row name (ValidName) and an error
// wrapping ErrInvalidTag otherwise.
func CheckName(name string) error {
	if !ValidName(name) {
		return fmt.Errorf("%w %q: want a tag (%s) or a tag's period (tag%sYYYYMMDD, YYYYMM or YYYY)", ErrInvalidTag, name, protocol.TagRule, PeriodSep)
	}
	return nil
}

// LoadLocation loads an IANA time zone for a tag ("" is UTC). Errors wrap
// ErrInvalidArgument.
func LoadLocation(name string) (*time.Location, error) {
	if name == "" {
		return time.UTC, nil
	}
	loc, err := time.LoadLocation(name)
	if err != nil || name == "Local" {
		return nil, fmt.Errorf("%w: time zone %q: want an IANA name such as Asia/Shanghai (or UTC)", ErrInvalidArgument, name)
	}
	return loc, nil
}

// Periodic is the reset settings of a tag, checked: what Tag.Periodic
// returns.
type Periodic struct {
	Reset         Reset
	Location      *time.Location
	Format        *Format // nil: the tag has no format
	RetentionDays int
}

// Periodic checks and reads the reset settings of t (Reset, TimeZone,
// Format, RetentionDays, and the name's length and Ordered, which a tag
// with a reset period may not be). Errors wrap ErrInvalidArgument (or
// ErrInvalidTag for a name too long for its period names).
func (t Tag) Periodic() (Periodic, error) {
	r, err := ParseReset(string(t.Reset))
	if err != nil {
		return Periodic{}, fmt.Errorf("%q: %w", t.Name, err)
	}
	p := Periodic{Reset: r, RetentionDays: t.RetentionDays}
	if p.Location, err = LoadLocation(t.TimeZone); err != nil {
		return Periodic{}, fmt.Errorf("%q: %w", t.Name, err)
	}
	if t.Format != "" {
		if p.Format, err = ParseFormat(t.Format, r, p.Location); err != nil {
			return Periodic{}, fmt.Errorf("%q: %w", t.Name, err)
		}
	}
	if t.RetentionDays < 0 || t.RetentionDays > MaxRetentionDays {
		return Periodic{}, fmt.Errorf("%q: %w: retention %d days, want 1..%d (0: %d)", t.Name, ErrInvalidArgument, t.RetentionDays, MaxRetentionDays, DefaultRetentionDays)
	}
	if r == ResetNone {
		if t.TimeZone != "" || t.RetentionDays != 0 {
			return Periodic{}, fmt.Errorf("%q: %w: a time zone or retention without a reset period", t.Name, ErrInvalidArgument)
		}
		return p, nil
	}
	if p.RetentionDays == 0 {
		p.RetentionDays = DefaultRetentionDays
	}
	if err := checkZoneOffset(p.Location); err != nil {
		return Periodic{}, fmt.Errorf("%q: %w", t.Name, err)
	}
	if len(t.Name) > MaxPeriodicTag {
		return Periodic{}, fmt.Errorf("%w %q: a tag with a reset period has at most %d characters", ErrInvalidTag, t.Name, MaxPeriodicTag)
	}
	if t.Ordered {
		return Periodic{}, fmt.Errorf("%q: %w: a tag with a reset period cannot be ordered", t.Name, ErrInvalidArgument)
	}
	return p, nil
}
