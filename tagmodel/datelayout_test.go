package tagmodel

import (
	"math/rand/v2"
	"strings"
	"testing"
	"time"
)

// BenchmarkProveDateLayout: the full check of a daily layout over a
// 400-year cycle (146,097 days), as tags create/update and a worker's
// first lookup of a tag pay it, against a cached one.
func BenchmarkProveDateLayout(b *testing.B) {
	for _, bb := range []struct {
		name   string
		layout string
		reset  Reset
	}{{"day", "20060102", ResetDay}, {"month", "Jan2006", ResetMonth}, {"year", "2006", ResetYear}} {
		b.Run(bb.name, func(b *testing.B) {
			for b.Loop() {
				if err := provePeriods(bb.layout, bb.reset); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
	b.Run("cached", func(b *testing.B) {
		for b.Loop() {
			if err := checkDateLayout("20060102", ResetDay); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// TestSplitLayoutAgreesWithGo: splitLayout reads layouts as Go's time
// package does. Random layouts of elements and the letters and digits
// around them: the chunks put together are the layout; Go prints the
// layout as the chunks printed one by one; a literal chunk prints as
// itself; a date chunk prints the same at any time of day in any zone; a
// time chunk changes with the time of day and a zone chunk with the zone.
// (If splitLayout missed an element of the time of day or the zone, a
// layout with it would be proven on midnights in UTC and print otherwise
// in the tag's zone.)
func TestSplitLayoutAgreesWithGo(t *testing.T) {
	pieces := []string{"2006", "06", "01", "1", "Jan", "January", "02", "2", "_2", "002", "__2", "Mon", "Monday",
		"15", "3", "03", "4", "04", "5", "05", "PM", "pm", "MST", "-070000", "-07:00:00", "-0700", "-07:00", "-07",
		"Z070000", "Z07:00:00", "Z0700", "Z07:00", "Z07", ".000", ".999", ",000", ",9", ".0",
		"-", "_", "__", ".", ",", "T", "x", "a", "J", "Ja", "M", "Mo", "MS", "P", "p", "Z", "Z0", "-0", "0", "00", "7", "8", "9", "6", "20", "200"}
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 1))
	day := time.Date(2026, 11, 24, 0, 0, 0, 0, time.UTC)
	// Each probe moves one thing away from midnight in UTC.
	timeProbes := []time.Time{
		time.Date(2026, 11, 24, 13, 47, 31, 123456789, time.UTC),
		time.Date(2026, 11, 24, 1, 1, 1, 1, time.UTC),
		time.Date(2026, 11, 24, 12, 0, 0, 0, time.UTC),
		time.Date(2026, 11, 24, 23, 59, 59, 999999999, time.UTC),
	}
	zoneProbes := []time.Time{
		time.Date(2026, 11, 24, 0, 0, 0, 0, time.FixedZone("ABC", 5*3600+30*60+17)),
		time.Date(2026, 11, 24, 0, 0, 0, 0, time.FixedZone("", -11*3600)),
	}
	probes := append(append([]time.Time{day}, timeProbes...), zoneProbes...)
	for range 20000 {
		var b strings.Builder
		for range 1 + rng.IntN(5) {
			b.WriteString(pieces[rng.IntN(len(pieces))])
		}
		layout := b.String()
		chunks := splitLayout(layout)
		var joined strings.Builder
		for _, c := range chunks {
			joined.WriteString(c.text)
		}
		if joined.String() != layout {
			t.Fatalf("%q: chunks %+v make %q", layout, chunks, joined.String())
		}
		for _, p := range probes {
			var each strings.Builder
			for _, c := range chunks {
				if c.kind == layoutLiteral {
					each.WriteString(c.text) // alone, ",00" would be fractional seconds; before a digit it is text
				} else {
					each.WriteString(p.Format(c.text))
				}
			}
			if got := p.Format(layout); got != each.String() {
				t.Fatalf("%q at %v: Go prints %q, the chunks %+v one by one %q", layout, p, got, chunks, each.String())
			}
		}
		for _, c := range chunks {
			varies := func(ps []time.Time) bool {
				for _, p := range ps {
					if p.Format(c.text) != day.Format(c.text) {
						return true
					}
				}
				return false
			}
			switch c.kind {
			case layoutYear, layoutShortYear, layoutDate:
				if varies(timeProbes) || varies(zoneProbes) {
					t.Fatalf("%q: date element %q prints differently at another time of day or in another zone", layout, c.text)
				}
			case layoutTime:
				if !varies(timeProbes) {
					t.Fatalf("%q: time element %q prints the same at every time of day", layout, c.text)
				}
			case layoutZone:
				if !varies(zoneProbes) {
					t.Fatalf("%q: zone element %q prints the same in every zone", layout, c.text)
				}
			}
		}
	}
}

// TestProvePeriodsCoversTheCycle: the proof itself, without the refusal of
// two-digit years that checkDateLayout makes first, tells apart the
// periods of a whole 400-year cycle: a two-digit year reads back as 1969 from 2069
// on (Go reads 69..99 as 19xx), which a proof over fewer years would miss.
func TestProvePeriodsCoversTheCycle(t *testing.T) {
	for _, tc := range []struct {
		name   string
		layout string
		reset  Reset
	}{
		{"daily", "060102", ResetDay},
		{"daily with weekday", "Mon060102", ResetDay},
		{"monthly", "0601", ResetMonth},
		{"yearly", "06", ResetYear},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := provePeriods(tc.layout, tc.reset)
			if err == nil || !strings.Contains(err.Error(), "2069-01-01") {
				t.Fatalf("provePeriods(%q) = %v, want the period starting 2069-01-01 refused", tc.layout, err)
			}
		})
	}
}
