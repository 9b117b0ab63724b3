package segment

import (
	"context"
	"errors"
	"github.com/dispenser-dev/dispenser/tagmodel"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"
)

// TestParseFormatProvesDates: a date layout is accepted only if what it
// prints names its period for all time: the year (2006, never 06) and,
// for a daily tag, the month and day (or the day of the year), at one
// width, in printable ASCII without space, and nothing that depends on
// the time of day or the time zone. Checked on what the layout prints over
// a 400-year Gregorian cycle, not on the layout's text.
func TestParseFormatProvesDates(t *testing.T) {
	tests := []struct {
		name     string
		template string
		reset    tagmodel.Reset
		wantErr  error  // nil: accepted
		wantMsg  string // in the error
	}{
		{name: "YYYYMMDD", template: "ORD-{date:20060102}-{seq:6}", reset: tagmodel.ResetDay},
		{name: "day of the year", template: "ORD-{date:2006002}-{seq:6}", reset: tagmodel.ResetDay},
		{name: "month name", template: "INV-{date:Jan2006}-{seq:5}", reset: tagmodel.ResetMonth},
		{name: "month name in a daily date", template: "{date:02Jan2006}{seq}", reset: tagmodel.ResetDay},
		{name: "weekday beside year, month and day", template: "{date:2006-01-02-Mon}-{seq}", reset: tagmodel.ResetDay},
		{name: "year", template: "Y{date:2006}-{seq}", reset: tagmodel.ResetYear},
		{name: "underscore before the year is a literal", template: "Y{date:_2006}-{seq}", reset: tagmodel.ResetYear},
		{name: "month of a monthly tag", template: "M{date:200601}{seq}", reset: tagmodel.ResetMonth},
		{name: "a daily date on a monthly tag", template: "M{date:20060102}{seq}", reset: tagmodel.ResetMonth},

		{name: "weekday instead of year (issue 34)", template: "ORD-{date:Mon0102}-{seq:4}", reset: tagmodel.ResetDay, wantErr: tagmodel.ErrInvalidArgument, wantMsg: "for all time"},
		{name: "no year", template: "{date:0102}{seq}", reset: tagmodel.ResetDay, wantErr: tagmodel.ErrInvalidArgument, wantMsg: "for all time"},
		{name: "month name without year", template: "{date:Jan}{seq}", reset: tagmodel.ResetMonth, wantErr: tagmodel.ErrInvalidArgument, wantMsg: "for all time"},
		{name: "no day on a daily tag", template: "{date:200601}{seq}", reset: tagmodel.ResetDay, wantErr: tagmodel.ErrInvalidArgument, wantMsg: "for all time"},
		{name: "no month on a monthly tag", template: "{date:2006}{seq}", reset: tagmodel.ResetMonth, wantErr: tagmodel.ErrInvalidArgument, wantMsg: "for all time"},
		{name: "two-digit year", template: "{date:060102}{seq}", reset: tagmodel.ResetDay, wantErr: tagmodel.ErrInvalidArgument, wantMsg: "two-digit year"},
		{name: "two-digit year and weekday (unique in a 400-year cycle only)", template: "{date:Mon060102}{seq}", reset: tagmodel.ResetDay, wantErr: tagmodel.ErrInvalidArgument, wantMsg: "two-digit year"},
		{name: "two-digit year on a yearly tag", template: "{date:06}{seq}", reset: tagmodel.ResetYear, wantErr: tagmodel.ErrInvalidArgument, wantMsg: "two-digit year"},
		{name: "day padded with a space (issue 34)", template: "ORD-{date:2006-01-_2}-{seq:4}", reset: tagmodel.ResetDay, wantErr: tagmodel.ErrInvalidArgument, wantMsg: "space"},
		{name: "day of the year padded with spaces", template: "{date:2006__2}{seq}", reset: tagmodel.ResetDay, wantErr: tagmodel.ErrInvalidArgument, wantMsg: "space"},
		{name: "unpadded month and day", template: "{date:2006-1-2}{seq}", reset: tagmodel.ResetDay, wantErr: tagmodel.ErrInvalidArgument, wantMsg: "width"},
		{name: "long month name", template: "{date:January2006}{seq}", reset: tagmodel.ResetMonth, wantErr: tagmodel.ErrInvalidArgument, wantMsg: "width"},
		{name: "long weekday name", template: "{date:20060102Monday}{seq}", reset: tagmodel.ResetDay, wantErr: tagmodel.ErrInvalidArgument, wantMsg: "width"},
		{name: "hour", template: "{date:2006010215}{seq}", reset: tagmodel.ResetDay, wantErr: tagmodel.ErrInvalidArgument, wantMsg: "time of day"},
		{name: "minute", template: "{date:20060102-04}{seq}", reset: tagmodel.ResetDay, wantErr: tagmodel.ErrInvalidArgument, wantMsg: "time of day"},
		{name: "AM or PM", template: "{date:20060102PM}{seq}", reset: tagmodel.ResetDay, wantErr: tagmodel.ErrInvalidArgument, wantMsg: "time of day"},
		{name: "fractional seconds", template: "{date:20060102.000}{seq}", reset: tagmodel.ResetDay, wantErr: tagmodel.ErrInvalidArgument, wantMsg: "time of day"},
		{name: "zone abbreviation", template: "{date:20060102MST}{seq}", reset: tagmodel.ResetDay, wantErr: tagmodel.ErrInvalidArgument, wantMsg: "time zone"},
		{name: "zone offset", template: "{date:20060102-0700}{seq}", reset: tagmodel.ResetDay, wantErr: tagmodel.ErrInvalidArgument, wantMsg: "time zone"},
		{name: "ISO 8601 zone", template: "{date:20060102Z07:00}{seq}", reset: tagmodel.ResetDay, wantErr: tagmodel.ErrInvalidArgument, wantMsg: "time zone"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			for _, zone := range []string{"UTC", "America/New_York", "Asia/Kolkata"} {
				_, err := tagmodel.ParseFormat(tt.template, tt.reset, mustLoc(t, zone))
				if !errors.Is(err, tt.wantErr) || (err == nil) != (tt.wantErr == nil) {
					t.Fatalf("ParseFormat(%q, %s, %s) = %v, want %v", tt.template, tt.reset, zone, err, tt.wantErr)
				}
				if err != nil && !strings.Contains(err.Error(), tt.wantMsg) {
					t.Errorf("ParseFormat(%q, %s, %s) = %q, want it to say %q", tt.template, tt.reset, zone, err, tt.wantMsg)
				}
			}
		})
	}
}

// TestWeekdayLayoutRepeats: what issue 34 saw: Mon0102 names 2026-01-01
// and 2032-01-01 alike, both Thursdays, so a daily tag restarting at its
// start would hand out ORD-Thu0101-0001 twice.
func TestWeekdayLayoutRepeats(t *testing.T) {
	a := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC).Format("ORD-Mon0102-")
	b := time.Date(2032, 1, 1, 0, 0, 0, 0, time.UTC).Format("ORD-Mon0102-")
	if a != b || a != "ORD-Thu0101-" {
		t.Fatalf("2026-01-01 prints %q and 2032-01-01 %q, want both ORD-Thu0101-", a, b)
	}
	if _, err := tagmodel.ParseFormat("ORD-{date:Mon0102}-{seq:4}", tagmodel.ResetDay, time.UTC); !errors.Is(err, tagmodel.ErrInvalidArgument) {
		t.Fatalf("ParseFormat of a layout that prints them alike = %v, want ErrInvalidArgument", err)
	}
}

// TestFormatChange: a tag's format, once set, keeps the text before {seq}
// for good; only the width of {seq} may change. Numbers already handed out
// were written in the old format, and a new head could write others
// alike; a removed format would let any format be set later.
func TestFormatChange(t *testing.T) {
	plain := tagmodel.Tag{Name: "orders", Step: 10, MaxID: 1, Format: "ORD-{seq}"}
	daily := tagmodel.Tag{Name: "orders", Step: 10, MaxID: 1, Reset: tagmodel.ResetDay, Format: "D{date:20060102}{seq}"}
	tests := []struct {
		name    string
		tag     tagmodel.Tag
		u       tagmodel.Update
		wantErr error // nil: accepted
	}{
		{name: "first format", tag: tagmodel.Tag{Name: "orders", Step: 10, MaxID: 1}, u: tagmodel.Update{Format: ptr("ORD-{seq}")}},
		{name: "same format again", tag: plain, u: tagmodel.Update{Format: ptr("ORD-{seq}")}},
		{name: "width of seq", tag: plain, u: tagmodel.Update{Format: ptr("ORD-{seq:8}")}},
		{name: "width of seq of a daily tag", tag: daily, u: tagmodel.Update{Format: ptr("D{date:20060102}{seq:6}")}},
		{name: "time zone of a formatted daily tag", tag: daily, u: tagmodel.Update{TimeZone: ptr("Asia/Shanghai")}},
		{name: "prefix grown", tag: plain, u: tagmodel.Update{Format: ptr("ORD-1{seq}")}, wantErr: tagmodel.ErrInvalidArgument},
		{name: "another prefix", tag: plain, u: tagmodel.Update{Format: ptr("INV-{seq}")}, wantErr: tagmodel.ErrInvalidArgument},
		{name: "format removed", tag: plain, u: tagmodel.Update{Format: ptr("")}, wantErr: tagmodel.ErrInvalidArgument},
		{name: "date layout changed", tag: daily, u: tagmodel.Update{Format: ptr("D{date:2006002}{seq}")}, wantErr: tagmodel.ErrInvalidArgument},
		{name: "reset set on a formatted tag", tag: plain, u: tagmodel.Update{Reset: ptr(tagmodel.ResetDay), Format: ptr("ORD-{date:20060102}-{seq}")}, wantErr: tagmodel.ErrInvalidArgument},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := tagmodel.ApplyUpdate(tt.tag, tt.u)
			if !errors.Is(err, tt.wantErr) || (err == nil) != (tt.wantErr == nil) {
				t.Fatalf("ApplyUpdate of %q = %v, want %v", tt.tag.Format, err, tt.wantErr)
			}
			if err == nil && tt.u.Format != nil && got.Format != *tt.u.Format {
				t.Errorf("format %q, want %q", got.Format, *tt.u.Format)
			}
		})
	}
}

// TestFormatChangesThatRepeat: the changes TestFormatChange refuses do
// write two numbers alike: 115 in ORD-{seq} and 15 in ORD-1{seq}; 5 of
// 2026-01-01 in D{date:20060102}{seq} and 15 of 2026-01-10 in
// D{date:2006002}{seq}.
func TestFormatChangesThatRepeat(t *testing.T) {
	write := func(template string, r tagmodel.Reset, day time.Time, seq int64) string {
		t.Helper()
		f, err := tagmodel.ParseFormat(template, r, time.UTC)
		if err != nil {
			t.Fatal(err)
		}
		return string(f.AppendNumber(nil, f.Head(day), seq))
	}
	var none time.Time
	if a, b := write("ORD-{seq}", tagmodel.ResetNone, none, 115), write("ORD-1{seq}", tagmodel.ResetNone, none, 15); a != b {
		t.Errorf("ORD-{seq} writes 115 as %q, ORD-1{seq} 15 as %q: want them alike", a, b)
	}
	jan1, jan10 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC), time.Date(2026, 1, 10, 0, 0, 0, 0, time.UTC)
	if a, b := write("D{date:20060102}{seq}", tagmodel.ResetDay, jan1, 5), write("D{date:2006002}{seq}", tagmodel.ResetDay, jan10, 15); a != b {
		t.Errorf("5 of 2026-01-01 is %q, 15 of 2026-01-10 %q: want them alike", a, b)
	}
}

// TestStoredUnprovableFormat: a tag stored by an older version with a
// format this one refuses serves its plain numbers and refuses formatted
// ones, instead of printing ORD-Thu0101-0001 again six years later.
func TestStoredUnprovableFormat(t *testing.T) {
	st := newMemStore(t, tagmodel.Tag{Name: "orders", MaxID: 1, Step: 10, Reset: tagmodel.ResetDay, Format: "ORD-{date:Mon0102}-{seq:4}"})
	c := &clock{now: time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)}
	a := newAllocator(t, Settings{Store: st, Now: c.Now, MaxWait: time.Minute})
	if got := take(t, a, "orders", 1); len(got) != 1 || got[0] != 1 {
		t.Fatalf("plain: %v, want [1]", got)
	}
	runs, num, p, err := a.TakeNowNumbered("orders", 1, nil)
	if err == nil && p != nil {
		runs, err = p.Wait(context.Background())
		num = p.Numbering()
	}
	if !errors.Is(err, tagmodel.ErrInvalidArgument) {
		t.Fatalf("formatted: %q, %v; want ErrInvalidArgument", num.Append(nil, runs), err)
	}
	if !strings.Contains(err.Error(), "create a new tag") {
		t.Errorf("error %q does not say what to do", err)
	}
	if got := take(t, a, "orders", 1); len(got) != 1 || got[0] != 2 {
		t.Errorf("plain after the refusal: %v, want [2] (nothing taken by it)", got)
	}
}

// TestDocumentedFormats: the templates of docs/business-numbers.md, in its
// table of examples (accepted or refused, for a reset period) and in its
// commands (--format with --reset), are what ParseFormat says.
func TestDocumentedFormats(t *testing.T) {
	doc, err := os.ReadFile("../docs/business-numbers.md")
	if err != nil {
		t.Fatal(err)
	}
	rows := 0
	row := regexp.MustCompile("^\\| `([^`]+)` \\| (day|month|year|none) \\| (accepted|refused)")
	for line := range strings.Lines(string(doc)) {
		m := row.FindStringSubmatch(line)
		if m == nil {
			continue
		}
		rows++
		r, err := tagmodel.ParseReset(m[2])
		if err != nil {
			t.Fatal(err)
		}
		_, err = tagmodel.ParseFormat(m[1], r, time.UTC)
		if accepted := m[3] == "accepted"; accepted != (err == nil) {
			t.Errorf("the doc says %s with reset %s is %s; ParseFormat: %v", m[1], m[2], m[3], err)
		}
		if err != nil && !errors.Is(err, tagmodel.ErrInvalidArgument) {
			t.Errorf("%s: %v is not ErrInvalidArgument", m[1], err)
		}
	}
	if rows < 10 {
		t.Errorf("%d rows of examples in the doc, want the table of formats", rows)
	}
	// Commands: a "dispenser tags ..." with its continuation lines.
	cmds := 0
	command := regexp.MustCompile(`dispenser tags (?:create|update)(?:[^\n]*\\\n)*[^\n]*`)
	formatFlag := regexp.MustCompile(`--format '([^']+)'`)
	resetFlag := regexp.MustCompile(`--reset (\w+)`)
	for _, c := range command.FindAllString(string(doc), -1) {
		f := formatFlag.FindStringSubmatch(c)
		if f == nil {
			continue
		}
		cmds++
		reset := "none"
		if m := resetFlag.FindStringSubmatch(c); m != nil {
			reset = m[1]
		}
		r, err := tagmodel.ParseReset(reset)
		if err != nil {
			t.Fatalf("%s: %v", c, err)
		}
		if _, err := tagmodel.ParseFormat(f[1], r, time.UTC); err != nil {
			t.Errorf("the doc's command %q: %v", c, err)
		}
	}
	if cmds == 0 {
		t.Error("no command with --format in the doc")
	}
}
