package segment

import (
	"errors"
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
