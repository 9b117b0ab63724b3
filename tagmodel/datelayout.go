package tagmodel

import (
	"fmt"
	"sync"
	"time"
)

// A {date:LAYOUT} is a promise that its text names one period, for all
// time: a formatted number is its period's head and a number that the
// period's row hands out once, so two periods whose heads read alike hand
// out the same strings (each period starts again at the tag's start).
// checkDateLayout proves the promise, in two steps:
//
//  1. The layout prints the period's date and nothing else: no element of
//     the time of day (15, 3, 4, 5, PM, .000 …) and no time zone (MST,
//     -0700, Z07:00 …), which splitLayout finds as Go's time package reads
//     a layout. A period starts at local midnight (at the change where a
//     daylight saving change skips midnight: PeriodAt), so the time of day and the zone add
//     nothing that names the period, and they make its text depend on the
//     tag's time zone and the zone's laws: a zone's abbreviation and offset
//     change with daylight saving time and with politics, and a tag's zone
//     can be changed (tags update --time-zone). Without them a period's
//     text is a function of its date (its key, YYYYMMDD, YYYYMM or YYYY)
//     alone, in every zone and after any change of zone, and the period's
//     row is named by the same key.
//  2. What it prints is checked on every period of one full cycle of the
//     Gregorian calendar, which repeats every 400 years (146,097 days, a
//     whole number of weeks, so weekdays repeat too): 146,097 days, 4,800
//     months or 400 years from 2000-01-01. Every period's text has the same
//     width, consists of printable ASCII without space, braces or backslash
//     (what a reply line may hold: checkLiteral), and reads back, with
//     time.Parse and the same layout, as the date the period starts on.
//     Reading back proves that no two periods of the cycle print alike, and
//     it carries over to every other cycle: Parse takes the year from the
//     four digits of 2006 (a two-digit year, 06, repeats every 100 years
//     and is refused in step 1), and every other element (month, day, day
//     of the year, weekday, a month's or weekday's name, leap years)
//     prints and reads the same in year y as in year y+400. So the text of
//     every period from year 0000 to 9999 reads back as its date, and no
//     two of them print alike. (Year 10000 would print five digits; a
//     period's key has four, so no store names a period after 9999.)
//
// The check takes tens of milliseconds; its result is kept per layout and
// reset period (provenLayouts), since a layout prints the same in every
// zone, so that a worker proves a tag's layout once, not at every lookup.

// layoutKind is what an element of a Go time layout prints.
type layoutKind int

const (
	layoutLiteral   layoutKind = iota
	layoutYear                 // 2006
	layoutShortYear            // 06
	layoutDate                 // month, day, day of the year, weekday: 01 1 Jan January 02 2 _2 002 __2 Mon Monday
	layoutTime                 // 15 3 03 4 04 5 05 PM pm, fractional seconds
	layoutZone                 // MST -0700 -07:00 -07 -070000 -07:00:00 Z0700 Z07:00 Z07 Z070000 Z07:00:00
)

// layoutChunk is one element of a layout, or literal text.
type layoutChunk struct {
	text string
	kind layoutKind
}

// splitLayout splits a Go time layout into its elements and literal text,
// reading it as the time package does (time.nextStdChunk, Go 1.26):
// TestSplitLayoutAgreesWithGo checks that what it calls a date layout
// prints the same at any time of day in any zone.
func splitLayout(layout string) []layoutChunk {
	var out []layoutChunk
	lit := 0 // start of the pending literal
	emit := func(i, n int, k layoutKind) int {
		if lit < i {
			out = append(out, layoutChunk{text: layout[lit:i], kind: layoutLiteral})
		}
		out = append(out, layoutChunk{text: layout[i : i+n], kind: k})
		lit = i + n
		return i + n
	}
	has := func(i int, s string) bool { return len(layout)-i >= len(s) && layout[i:i+len(s)] == s }
	lowerAt := func(i int) bool { return i < len(layout) && 'a' <= layout[i] && layout[i] <= 'z' }
	digitAt := func(i int) bool { return i < len(layout) && '0' <= layout[i] && layout[i] <= '9' }
	for i := 0; i < len(layout); {
		switch layout[i] {
		case 'J':
			if has(i, "January") {
				i = emit(i, 7, layoutDate)
				continue
			}
			if has(i, "Jan") && !lowerAt(i+3) {
				i = emit(i, 3, layoutDate)
				continue
			}
		case 'M':
			if has(i, "Monday") {
				i = emit(i, 6, layoutDate)
				continue
			}
			if has(i, "Mon") && !lowerAt(i+3) {
				i = emit(i, 3, layoutDate)
				continue
			}
			if has(i, "MST") {
				i = emit(i, 3, layoutZone)
				continue
			}
		case '0':
			if i+1 < len(layout) && '1' <= layout[i+1] && layout[i+1] <= '6' {
				k := [...]layoutKind{layoutDate, layoutDate, layoutTime, layoutTime, layoutTime, layoutShortYear}[layout[i+1]-'1']
				i = emit(i, 2, k)
				continue
			}
			if has(i, "002") {
				i = emit(i, 3, layoutDate)
				continue
			}
		case '1':
			if has(i, "15") {
				i = emit(i, 2, layoutTime)
				continue
			}
			i = emit(i, 1, layoutDate) // 1: the month
			continue
		case '2':
			if has(i, "2006") {
				i = emit(i, 4, layoutYear)
				continue
			}
			i = emit(i, 1, layoutDate) // 2: the day
			continue
		case '_':
			if has(i, "_2006") { // a literal _ and the year
				i = emit(i+1, 4, layoutYear)
				continue
			}
			if has(i, "_2") {
				i = emit(i, 2, layoutDate)
				continue
			}
			if has(i, "__2") {
				i = emit(i, 3, layoutDate)
				continue
			}
		case '3', '4', '5':
			i = emit(i, 1, layoutTime)
			continue
		case 'P':
			if has(i, "PM") {
				i = emit(i, 2, layoutTime)
				continue
			}
		case 'p':
			if has(i, "pm") {
				i = emit(i, 2, layoutTime)
				continue
			}
		case '-':
			if n := zoneAt(layout[i:], "-070000", "-07:00:00", "-0700", "-07:00", "-07"); n > 0 {
				i = emit(i, n, layoutZone)
				continue
			}
		case 'Z':
			if n := zoneAt(layout[i:], "Z070000", "Z07:00:00", "Z0700", "Z07:00", "Z07"); n > 0 {
				i = emit(i, n, layoutZone)
				continue
			}
		case '.', ',':
			if i+1 < len(layout) && (layout[i+1] == '0' || layout[i+1] == '9') {
				j := i + 1
				for j < len(layout) && layout[j] == layout[i+1] {
					j++
				}
				if !digitAt(j) { // fractional seconds: the digits end here
					i = emit(i, j-i, layoutTime)
					continue
				}
			}
		}
		i++
	}
	if lit < len(layout) {
		out = append(out, layoutChunk{text: layout[lit:], kind: layoutLiteral})
	}
	return out
}

// zoneAt returns the length of the first of elems that s starts with, 0 if
// none.
func zoneAt(s string, elems ...string) int {
	for _, e := range elems {
		if len(s) >= len(e) && s[:len(e)] == e {
			return len(e)
		}
	}
	return 0
}

// checkDateLayout proves that layout names every period of r apart for all
// time (see above). Errors say why and what to write instead.
func checkDateLayout(layout string, r Reset) error {
	for _, c := range splitLayout(layout) {
		switch c.kind {
		case layoutShortYear:
			return fmt.Errorf("%s is a two-digit year, which repeats every 100 years (2026 and 2126 both print 26): use the four-digit year 2006", c.text)
		case layoutTime:
			return fmt.Errorf("%s prints the time of day: a period is named by its date alone (use 2006 for the year, 01 or Jan for the month, 02 for the day or 002 for the day of the year)", c.text)
		case layoutZone:
			return fmt.Errorf("%s prints a time zone: a zone's name and offset change with daylight saving time and with its laws, so a number's text could not be proven to name one period; leave it out (the tag's --time-zone decides where a period begins)", c.text)
		}
	}
	key := provenKey{layout, r}
	provenMu.Lock()
	err, ok := provenLayouts[key]
	provenMu.Unlock()
	if ok {
		return err
	}
	err = provePeriods(layout, r)
	provenMu.Lock()
	if len(provenLayouts) < maxProvenLayouts {
		provenLayouts[key] = err
	}
	provenMu.Unlock()
	return err
}

// provenKey is a layout proven for a reset period.
type provenKey struct {
	layout string
	reset  Reset
}

// maxProvenLayouts bounds provenLayouts: a worker serves a few formats; a
// layout beyond the bound is proven again at each use.
const maxProvenLayouts = 1024

var (
	provenMu      sync.Mutex // protects provenLayouts
	provenLayouts = map[provenKey]error{}
)

// provePeriods checks what layout prints on every period of r in one
// 400-year cycle: one width, characters a reply line may hold, and a text
// that reads back as the period's date.
func provePeriods(layout string, r Reset) error {
	start := time.Date(2000, 1, 1, 0, 0, 0, 0, time.UTC)
	end := start.AddDate(400, 0, 0)
	var next func(time.Time) time.Time
	switch r {
	case ResetDay:
		next = func(t time.Time) time.Time { return t.Add(24 * time.Hour) } // UTC: every day has 24 hours
	case ResetMonth:
		next = func(t time.Time) time.Time { return t.AddDate(0, 1, 0) }
	case ResetYear:
		next = func(t time.Time) time.Time { return t.AddDate(1, 0, 0) }
	default:
		return fmt.Errorf("{date} needs a reset period")
	}
	const advice = "a date must name its period for all time: use the four-digit year 2006, and the month (01 or Jan) for a monthly tag, and month and day (0102) or the day of the year (002) for a daily one"
	first := start.Format(layout)
	var buf []byte
	for p := start; p.Before(end); p = next(p) {
		buf = p.AppendFormat(buf[:0], layout)
		if len(buf) != len(first) {
			return fmt.Errorf("the period starting %s prints %q (%d bytes) and the one starting %s %q (%d bytes): want a fixed width (such as 01 and 02, not 1 and 2; Jan and Mon, not January and Monday)", p.Format(time.DateOnly), buf, len(buf), start.Format(time.DateOnly), first, len(first))
		}
		if err := checkLiteral(string(buf)); err != nil {
			return fmt.Errorf("the period starting %s prints %q: %w (use 02, not _2; 002, not __2)", p.Format(time.DateOnly), buf, err)
		}
		back, err := time.Parse(layout, string(buf))
		if err != nil {
			return fmt.Errorf("the period starting %s prints %q, which does not read back as a date (%v): %s", p.Format(time.DateOnly), buf, err, advice)
		}
		if y, m, d := back.Date(); y != p.Year() || m != p.Month() || d != p.Day() {
			return fmt.Errorf("the period starting %s prints %q, which reads as %s: %s", p.Format(time.DateOnly), buf, back.Format(time.DateOnly), advice)
		}
	}
	return nil
}
