package segment

import (
	"fmt"
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
