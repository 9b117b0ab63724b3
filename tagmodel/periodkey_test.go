package tagmodel

import (
	"encoding/binary"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"
)

func TestPeriodOfKey(t *testing.T) {
	shanghai, err := time.LoadLocation("Asia/Shanghai")
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name      string
		reset     Reset
		key       string
		loc       *time.Location
		wantStart time.Time
		wantEnd   time.Time
		wantErr   error
	}{
		{name: "day", reset: ResetDay, key: "20261124", loc: time.UTC, wantStart: time.Date(2026, 11, 24, 0, 0, 0, 0, time.UTC), wantEnd: time.Date(2026, 11, 25, 0, 0, 0, 0, time.UTC)},
		{name: "day in a zone", reset: ResetDay, key: "20261124", loc: shanghai, wantStart: time.Date(2026, 11, 23, 16, 0, 0, 0, time.UTC), wantEnd: time.Date(2026, 11, 24, 16, 0, 0, 0, time.UTC)},
		{name: "month", reset: ResetMonth, key: "202612", loc: time.UTC, wantStart: time.Date(2026, 12, 1, 0, 0, 0, 0, time.UTC), wantEnd: time.Date(2027, 1, 1, 0, 0, 0, 0, time.UTC)},
		{name: "year", reset: ResetYear, key: "2026", loc: time.UTC, wantStart: time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC), wantEnd: time.Date(2027, 1, 1, 0, 0, 0, 0, time.UTC)},
		{name: "month key of a daily tag", reset: ResetDay, key: "202611", loc: time.UTC, wantErr: ErrInvalidArgument},
		{name: "day key of a yearly tag", reset: ResetYear, key: "20261124", loc: time.UTC, wantErr: ErrInvalidArgument},
		{name: "no such day", reset: ResetDay, key: "20260231", loc: time.UTC, wantErr: ErrInvalidArgument},
		{name: "month 13", reset: ResetMonth, key: "202613", loc: time.UTC, wantErr: ErrInvalidArgument},
		{name: "no reset", reset: ResetNone, key: "2026", loc: time.UTC, wantErr: ErrInvalidArgument},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, err := tt.reset.PeriodOfKey(tt.key, tt.loc)
			if !errors.Is(err, tt.wantErr) {
				t.Fatalf("PeriodOfKey(%q) error = %v, want %v", tt.key, err, tt.wantErr)
			}
			if err != nil {
				return
			}
			if p.Key != tt.key || !p.Start.Equal(tt.wantStart) || !p.End.Equal(tt.wantEnd) {
				t.Errorf("PeriodOfKey(%q) = %+v, want key %s, [%v, %v)", tt.key, p, tt.key, tt.wantStart, tt.wantEnd)
			}
		})
	}
}

func TestPeriodExpired(t *testing.T) {
	end := time.Date(2026, 1, 2, 0, 0, 0, 0, time.UTC)
	tests := []struct {
		name string
		now  time.Time
		days int
		want bool
	}{
		{name: "within retention", now: end.Add(7*24*time.Hour - time.Nanosecond), days: 7, want: false},
		{name: "at retention's end", now: end.Add(7 * 24 * time.Hour), days: 7, want: true},
		{name: "default retention", now: end.Add(6 * 24 * time.Hour), days: 0, want: false},
		{name: "past default retention", now: end.Add(8 * 24 * time.Hour), days: 0, want: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := PeriodExpired(end, tt.now, tt.days); got != tt.want {
				t.Errorf("PeriodExpired(%v, %v, %d) = %v, want %v", end, tt.now, tt.days, got, tt.want)
			}
		})
	}
}

// TestPeriodPruned: a period pruned in any zone is pruned in every other
// (issue 34, point 2), and the price of that is at most the next period,
// for zones at -10:00 or further west. Seen failing with EarliestEnd
// computing the end in UTC instead of at MaxZoneOffset: the Berlin and
// Kiritimati records no longer cover their own day.
func TestPeriodPruned(t *testing.T) {
	endIn := func(r Reset, key, zone string) time.Time {
		t.Helper()
		loc, err := LoadLocation(zone)
		if err != nil {
			t.Fatal(err)
		}
		p, err := r.PeriodOfKey(key, loc)
		if err != nil {
			t.Fatal(err)
		}
		return p.End
	}
	tests := []struct {
		name   string
		reset  Reset
		pruned time.Time // the record: the end of the last period pruned, in the zone of then
		key    string
		want   bool
	}{
		{name: "Berlin's day itself", reset: ResetDay, pruned: endIn(ResetDay, "20261029", "Europe/Berlin"), key: "20261029", want: true},
		{name: "Berlin's day before", reset: ResetDay, pruned: endIn(ResetDay, "20261029", "Europe/Berlin"), key: "20261028", want: true},
		{name: "Berlin's next day", reset: ResetDay, pruned: endIn(ResetDay, "20261029", "Europe/Berlin"), key: "20261030", want: false},
		{name: "easternmost day itself", reset: ResetDay, pruned: endIn(ResetDay, "20261029", "Pacific/Kiritimati"), key: "20261029", want: true},
		{name: "easternmost next day", reset: ResetDay, pruned: endIn(ResetDay, "20261029", "Pacific/Kiritimati"), key: "20261030", want: false},
		{name: "westernmost day itself", reset: ResetDay, pruned: endIn(ResetDay, "20261029", "Etc/GMT+12"), key: "20261029", want: true},
		{name: "westernmost next day (the price)", reset: ResetDay, pruned: endIn(ResetDay, "20261029", "Etc/GMT+12"), key: "20261030", want: true},
		{name: "westernmost day after next", reset: ResetDay, pruned: endIn(ResetDay, "20261029", "Etc/GMT+12"), key: "20261031", want: false},
		{name: "New York's next day", reset: ResetDay, pruned: endIn(ResetDay, "20261029", "America/New_York"), key: "20261030", want: false},
		{name: "month itself, Honolulu", reset: ResetMonth, pruned: endIn(ResetMonth, "202608", "Pacific/Honolulu"), key: "202608", want: true},
		{name: "next month, westernmost", reset: ResetMonth, pruned: endIn(ResetMonth, "202608", "Etc/GMT+12"), key: "202609", want: false},
		{name: "year itself, Shanghai", reset: ResetYear, pruned: endIn(ResetYear, "2025", "Asia/Shanghai"), key: "2025", want: true},
		{name: "next year", reset: ResetYear, pruned: endIn(ResetYear, "2025", "Etc/GMT+12"), key: "2026", want: false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := PeriodPruned(tt.reset, tt.key, tt.pruned)
			if err != nil || got != tt.want {
				t.Errorf("PeriodPruned(%s, %q, %s) = %v, %v, want %v", tt.reset, tt.key, tt.pruned.UTC().Format(time.RFC3339), got, err, tt.want)
			}
		})
	}
	if _, err := PeriodPruned(ResetDay, "202610", time.Now()); !errors.Is(err, ErrInvalidArgument) {
		t.Errorf("PeriodPruned of a month key of a daily tag: %v, want ErrInvalidArgument", err)
	}
}

// TestZoneOffsetBound: a tag's zone is refused if it is ever more than
// MaxZoneOffset ahead of UTC (PeriodPruned relies on it); the zones at the
// edge are accepted. No zone of the tz database goes beyond it, so the
// test runs itself again with ZONEINFO naming a directory that has one,
// Test/Plus15 (LoadLocation reads ZONEINFO once per process). Seen failing
// with the call of checkZoneOffset in Tag.Periodic removed:
// "Tag.Periodic of a tag in a zone 15 hours ahead: <nil>, want
// ErrInvalidArgument".
func TestZoneOffsetBound(t *testing.T) {
	if os.Getenv("DISPENSER_TEST_ZONE_CHILD") != "" {
		// The child: Test/Plus15 loads, and is refused.
		_, err := (Tag{Name: "t", Reset: ResetDay, TimeZone: "Test/Plus15"}).Periodic()
		if !errors.Is(err, ErrInvalidArgument) {
			t.Fatalf("Tag.Periodic of a tag in a zone 15 hours ahead: %v, want ErrInvalidArgument", err)
		}
		return
	}
	for _, zone := range []string{"Pacific/Kiritimati", "Pacific/Apia", "Pacific/Tongatapu", "Etc/GMT-14", "Etc/GMT+12", "America/Juneau", "Asia/Kolkata", ""} {
		if _, err := (Tag{Name: "t", Reset: ResetDay, TimeZone: zone}).Periodic(); err != nil {
			t.Errorf("zone %q: %v, want it accepted", zone, err)
		}
	}
	if err := checkZoneOffset(time.FixedZone("UTC+14", 14*3600)); err != nil {
		t.Errorf("a zone 14 hours ahead: %v, want it accepted", err)
	}
	dir := t.TempDir()
	if err := os.MkdirAll(filepath.Join(dir, "Test"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "Test", "Plus15"), tzif(15*3600, "X15"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := time.LoadLocationFromTZData("Test/Plus15", tzif(15*3600, "X15")); err != nil {
		t.Fatalf("the test's zone does not load: %v", err)
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestZoneOffsetBound$", "-test.count=1")
	cmd.Env = append(os.Environ(), "ZONEINFO="+dir, "DISPENSER_TEST_ZONE_CHILD=1")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Errorf("the child: %v\n%s", err, out)
	}
}

// tzif returns a time zone file (TZif version 1) of one zone, offset
// seconds east of UTC, named abbr, with no transitions.
func tzif(offset int32, abbr string) []byte {
	b := []byte("TZif")
	b = append(b, make([]byte, 16)...) // version 1, reserved
	// isutcnt, isstdcnt, leapcnt, timecnt, typecnt, charcnt
	for _, n := range []uint32{0, 0, 0, 0, 1, uint32(len(abbr) + 1)} {
		b = binary.BigEndian.AppendUint32(b, n)
	}
	b = binary.BigEndian.AppendUint32(b, uint32(offset))
	b = append(b, 0, 0) // not daylight saving; abbreviation at 0
	return append(append(b, abbr...), 0)
}

// TestPeriodAtSkippedMidnight checks that a period holds the instants of
// its date and no others, and is named after that date, in zones whose
// midnight a daylight saving change skips: America/Santiago goes from
// 23:59:59 -04 to 01:00 -03, and time.Date normalizes the missing
// midnight to 23:00 of the day before; Asia/Beirut and Africa/Cairo skip
// 00:00 to 01:00 forwards; Pacific/Apia skipped 2011-12-30 entirely.
func TestPeriodAtSkippedMidnight(t *testing.T) {
	zones := []string{"America/Santiago", "America/Asuncion", "America/Havana", "America/Sao_Paulo",
		"Asia/Beirut", "Africa/Cairo", "Asia/Tehran", "Pacific/Apia", "Australia/Lord_Howe", "Europe/Berlin"}
	layouts := map[Reset]string{ResetDay: "20060102", ResetMonth: "200601", ResetYear: "2006"}
	for _, z := range zones {
		loc, err := time.LoadLocation(z)
		if err != nil {
			t.Fatal(err)
		}
		for r, layout := range layouts {
			t.Run(z+"/"+r.String(), func(t *testing.T) {
				bad, lastKey := 0, ""
				for at := time.Date(2011, 1, 1, 0, 0, 0, 0, time.UTC); at.Year() < 2026 && bad < 3; at = at.Add(30 * time.Minute) {
					p := r.PeriodAt(at, loc)
					want := at.In(loc).Format(layout)
					if p.Key != want || at.Before(p.Start) || !at.Before(p.End) {
						t.Errorf("PeriodAt(%s) = key %s [%s, %s), want key %s holding it", at.In(loc), p.Key, p.Start.In(loc), p.End.In(loc), want)
						bad++
						continue
					}
					if before := p.Start.Add(-time.Nanosecond).In(loc).Format(layout); before == want {
						t.Errorf("PeriodAt(%s) starts at %s, after the first instant of %s", at.In(loc), p.Start.In(loc), want)
						bad++
					}
					if last := p.End.Add(-time.Nanosecond).In(loc).Format(layout); last != want || p.End.In(loc).Format(layout) == want {
						t.Errorf("PeriodAt(%s) of %s ends at %s, not at the first instant after %s", at.In(loc), want, p.End.In(loc), want)
						bad++
					}
					if p.Key == lastKey {
						continue
					}
					lastKey = p.Key
					if q, err := r.PeriodOfKey(p.Key, loc); err != nil || !q.Start.Equal(p.Start) || !q.End.Equal(p.End) {
						t.Errorf("PeriodOfKey(%s) = [%s, %s), %v; want PeriodAt's [%s, %s)", p.Key, q.Start.In(loc), q.End.In(loc), err, p.Start.In(loc), p.End.In(loc))
						bad++
					}
				}
			})
		}
	}
}
