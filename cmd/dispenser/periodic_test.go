package main

import (
	"testing"
)

// TestPeriodicTagCommands: tags create and update with --reset,
// --time-zone, --format and --retention-days, and the RESET, TIME ZONE,
// RETENTION and FORMAT columns of tags list, on every store; bad values
// fail and change nothing.
func TestPeriodicTagCommands(t *testing.T) {
	stores := cliStores(t, "periodic_cli")
	// state is what tags list must show after a step: per tag "RESET|TIME
	// ZONE|RETENTION|FORMAT".
	type state map[string]string
	steps := []struct {
		name    string
		args    []string
		wantErr string // "": success
		want    string // in the output of a success
		state   state  // after a success; after an error, the list must be as before
	}{
		{name: "create daily", args: []string{"create", "orders", "--step", "10", "--reset", "day", "--time-zone", "Asia/Shanghai", "--format", "ORD{date:20060102}{seq:6}"},
			want:  "created tag orders: first ID 1, step 10, ordered no, reset every day (Asia/Shanghai), format ORD{date:20060102}{seq:6}",
			state: state{"orders": "day|Asia/Shanghai|7d|ORD{date:20060102}{seq:6}"}},
		{name: "create plain", args: []string{"create", "plain", "--step", "10"},
			want: "created tag plain: first ID 1, step 10, ordered no\n", state: state{"orders": "day|Asia/Shanghai|7d|ORD{date:20060102}{seq:6}", "plain": "none|||"}},
		{name: "create with a format without date", args: []string{"create", "daily2", "--step", "10", "--reset", "day", "--format", "D{seq}"}, wantErr: "needs {date:LAYOUT}"},
		{name: "create with a bad zone", args: []string{"create", "daily2", "--step", "10", "--reset", "day", "--time-zone", "Mars/Base"}, wantErr: "time zone"},
		{name: "create with a bad reset", args: []string{"create", "daily2", "--step", "10", "--reset", "week"}, wantErr: "want day, month, year or none"},
		{name: "create ordered with reset", args: []string{"create", "daily2", "--step", "10", "--reset", "year", "--ordered"}, wantErr: "cannot be ordered"},
		{name: "create with a bad retention", args: []string{"create", "daily2", "--step", "10", "--reset", "year", "--retention-days", "-2"}, wantErr: "retention"},
		{name: "none to month", args: []string{"update", "plain", "--reset", "month", "--retention-days", "40"},
			want: "updated tag plain: reset month, retention 40 days", state: state{"orders": "day|Asia/Shanghai|7d|ORD{date:20060102}{seq:6}", "plain": "month|UTC|40d|"}},
		{name: "reset changed", args: []string{"update", "orders", "--reset", "month", "--format", "M{date:200601}{seq}"}, wantErr: "cannot be changed"},
		{name: "reset removed", args: []string{"update", "plain", "--reset", "none"}, wantErr: "cannot be changed"},
		{name: "format without date", args: []string{"update", "orders", "--format", "{seq}"}, wantErr: "needs {date:LAYOUT}"},
		{name: "format removed", args: []string{"update", "orders", "--format", ""}, wantErr: "cannot be removed"},
		{name: "format changed", args: []string{"update", "orders", "--format", "INV{date:20060102}{seq:6}"}, wantErr: "create a new tag"},
		{name: "two-digit year", args: []string{"update", "orders", "--format", "ORD{date:060102}{seq:6}"}, wantErr: "use the four-digit year 2006"},
		{name: "time zone and width of seq", args: []string{"update", "orders", "--time-zone", "", "--format", "ORD{date:20060102}{seq:8}"},
			want: `time zone "", format "ORD{date:20060102}{seq:8}"`, state: state{"orders": "day|UTC|7d|ORD{date:20060102}{seq:8}", "plain": "month|UTC|40d|"}},
		{name: "period name", args: []string{"update", "orders=20260101", "--retention-days", "3"}, wantErr: "invalid tag"},
	}
	for _, st := range stores {
		t.Run(st.name, func(t *testing.T) {
			for _, s := range steps {
				tagStep(t, st.args, s.name, s.args, nil, s.wantErr, s.want, s.state, func(row map[string]string) string {
					return row["RESET"] + "|" + row["TIME ZONE"] + "|" + row["RETENTION"] + "|" + row["FORMAT"]
				})
			}
		})
	}
}
