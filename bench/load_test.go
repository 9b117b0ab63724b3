package bench

import (
	"context"
	"flag"
	"fmt"
	"reflect"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"

	"github.com/dispenser-dev/dispenser/protocol"
	"github.com/dispenser-dev/dispenser/testenv"
)

// TestLoadFindsDuplicatesAndErrors points the load generator at broken
// responders.
func TestLoadFindsDuplicatesAndErrors(t *testing.T) {
	ns := testenv.NATS(t)
	nc := testenv.Connect(t, ns)
	nc.Subscribe("same", func(m *nats.Msg) { m.Respond([]byte("7")) })
	nc.Subscribe("overlap", func(m *nats.Msg) { m.Respond([]byte("1-10")) })
	nc.Subscribe("short", func(m *nats.Msg) { m.Respond([]byte("1\n2")) })
	nc.Subscribe("fail", func(m *nats.Msg) {
		r := nats.NewMsg(m.Reply)
		r.Header.Set(micro.ErrorCodeHeader, "503")
		r.Header.Set(micro.ErrorHeader, "no segment")
		nc.PublishMsg(r)
	})
	nc.Flush()
	cfg := LoadConfig{URL: ns.ClientURL(), Inflight: 4, Batch: 1, Format: "list", Warmup: 10 * time.Millisecond,
		Duration: 100 * time.Millisecond, Drain: time.Second, Verify: true}
	tests := []struct {
		subject, format string
		batch           int
		dups, errs      bool
		errText         string
	}{
		{"same", "list", 1, true, false, ""},
		{"overlap", "range", 10, true, false, ""},
		{"short", "list", 3, false, true, "2 IDs, want 3"},
		{"fail", "list", 1, false, true, "error reply 503: no segment"},
		{"nobody", "list", 1, false, true, "status 503"},
	}
	for _, tt := range tests {
		c := cfg
		c.Subjects, c.Format, c.Batch = []string{tt.subject}, tt.format, tt.batch
		rs, err := RunLoad(context.Background(), c, nil)
		if err != nil {
			t.Fatalf("%s: %v", tt.subject, err)
		}
		r := rs[0]
		if (r.Duplicates > 0) != tt.dups || (r.Errors > 0) != tt.errs || !strings.Contains(r.FirstError, tt.errText) {
			t.Errorf("%s: %d duplicates, %d errors (%q); want duplicates %v, errors %v (%q)", tt.subject, r.Duplicates, r.Errors, r.FirstError, tt.dups, tt.errs, tt.errText)
		}
		if r.Lost != 0 {
			t.Errorf("%s: %d lost", tt.subject, r.Lost)
		}
	}

	// Subjects loaded in turn keep their results apart.
	var counter int64
	nc.Subscribe("good", func(m *nats.Msg) { counter++; m.Respond(fmt.Appendf(nil, "%d", counter)) })
	nc.Flush()
	c := cfg
	c.Subjects, c.Slice = []string{"good", "fail", "good2"}, 20*time.Millisecond
	nc.Subscribe("good2", func(m *nats.Msg) { counter++; m.Respond(fmt.Appendf(nil, "%d", counter)) })
	nc.Flush()
	rs, err := RunLoad(context.Background(), c, nil)
	if err != nil {
		t.Fatal(err)
	}
	for i, r := range rs {
		if r.Subject != c.Subjects[i] || (r.Errors > 0) != (i == 1) || (r.Requests > 0) != (i != 1) || r.Duplicates != 0 {
			t.Errorf("result %d: %s: %d requests, %d errors, %d duplicates", i, r.Subject, r.Requests, r.Errors, r.Duplicates)
		}
		// A subject's time counts from the first reply of each of its own
		// slices to the slice's end: at most its Duration, however slow
		// the machine (the first reply of a slice may come late), and far
		// below the 0.3 s that counting the other subjects' slices would
		// give.
		if i != 1 && (r.Seconds <= 0 || r.Seconds > c.Duration.Seconds()) {
			t.Errorf("%s measured for %vs, want more than 0 and at most its %v", r.Subject, r.Seconds, c.Duration)
		}
	}
}

func TestMergeRuns(t *testing.T) {
	runs := []segmentRun{{10, 20}, {1, 5}, {21, 30}, {15, 16}, {30, 31}, {6, 6}}
	got, dups := mergeRuns(runs)
	want := []segmentRun{{1, 6}, {10, 31}}
	if fmt.Sprint(got) != fmt.Sprint(want) || dups != 3 { // 15, 16, 30
		t.Errorf("mergeRuns = %v, %d duplicates; want %v, 3", got, dups, want)
	}
}

func TestParseReplyParts(t *testing.T) {
	for s, want := range map[string]int{"x.y.0": 0, "_INBOX.abc.255": 255, "a.": -1, "a.b": -1, "a.1234567890": -1} {
		n, ok := slotOf(s)
		if (want >= 0) != ok || (ok && n != want) {
			t.Errorf("slotOf(%q) = %d, %v; want %d", s, n, ok, want)
		}
	}
	for s, want := range map[string]int64{"1": 1, "9223372036854775807": 1<<63 - 1, "0": -1, "": -1, "-1": -1, "9223372036854775808": -1, "1 ": -1} {
		n, ok := parseID([]byte(s))
		if (want > 0) != ok || (ok && n != want) {
			t.Errorf("parseID(%q) = %d, %v; want %d", s, n, ok, want)
		}
	}
}

// TestLoadArgs checks that a load child's flags read back the LoadConfig
// that its command line was written from.
func TestLoadArgs(t *testing.T) {
	want := LoadConfig{URL: "nats://a:4222,nats://b:4222", Subjects: []string{"id.segment.x", "id.snowflake"},
		Inflight: 7, Batch: 3, Format: "range", Warmup: 10 * time.Millisecond, Duration: 2 * time.Second,
		Slice: 20 * time.Millisecond, Drain: time.Second, Verify: true}
	args := want.args()
	if args[0] != LoadCommand {
		t.Fatalf("args start with %q, want %q", args[0], LoadCommand)
	}
	fs := flag.NewFlagSet(LoadCommand, flag.ContinueOnError)
	var got LoadConfig
	got.AddFlags(fs)
	if err := fs.Parse(args[1:]); err != nil {
		t.Fatalf("parsing %q: %v", args, err)
	}
	if !reflect.DeepEqual(got, want) || fs.NArg() != 0 {
		t.Errorf("%q reads back as %+v (%d arguments left), want %+v", args, got, fs.NArg(), want)
	}

	// ChildArgs come last, for the program's own flags.
	want.ChildArgs = []string{"--nats-creds", "x.creds"}
	if args := want.args(); !slices.Equal(args[len(args)-2:], want.ChildArgs) {
		t.Errorf("args %q do not end with ChildArgs %q", args, want.ChildArgs)
	}
}

// TestLoadCallers: raw request targets (rawPrefix), loaded by callers of
// their own, count their replies and find errors and duplicates as the
// pipelined targets do.
func TestLoadCallers(t *testing.T) {
	ns := testenv.NATS(t)
	nc := testenv.Connect(t, ns)
	var counter atomic.Int64
	// good and same echo the token of a request that has one, in the
	// body's first line (tokenPrefix sends it in the body).
	echo := func(m *nats.Msg, data []byte) {
		var head []byte
		if tok, inBody := protocol.RequestToken(m.Header, m.Data); inBody {
			head = protocol.AppendTokenLine(nil, tok, "")
		}
		m.Respond(append(head, data...))
	}
	nc.Subscribe("good", func(m *nats.Msg) { echo(m, fmt.Appendf(nil, "%d", counter.Add(1))) })
	nc.Subscribe("same", func(m *nats.Msg) { echo(m, []byte("7")) })
	nc.Subscribe("deaf", func(m *nats.Msg) { m.Respond(fmt.Appendf(nil, "%d", counter.Add(1))) }) // no token
	nc.Subscribe("junk", func(m *nats.Msg) { m.Respond([]byte("7x")) })
	nc.Subscribe("fail", func(m *nats.Msg) {
		r := nats.NewMsg(m.Reply)
		r.Header.Set(micro.ErrorCodeHeader, "503")
		r.Header.Set(micro.ErrorHeader, "no segment")
		nc.PublishMsg(r)
	})
	nc.Flush()
	cfg := LoadConfig{URL: ns.ClientURL(), Inflight: 4, Batch: 1, Format: "list", Warmup: 10 * time.Millisecond,
		Duration: 100 * time.Millisecond, Slice: 20 * time.Millisecond, Drain: time.Second, Verify: true,
		Subjects: []string{"raw:good", "raw:same", "raw:junk", "raw:fail", "raw:nobody", "token:good", "token:same", "token:deaf"}}
	rs, err := RunLoad(context.Background(), cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct {
		name       string
		dups, errs bool
		errText    string
	}{
		{name: "good"},
		{name: "same", dups: true},
		{name: "junk", errs: true, errText: `"7x" is no ID`},
		{name: "fail", errs: true, errText: "error reply 503: no segment"},
		{name: "nobody", errs: true, errText: "no responders"},
		{name: "token:good"},
		{name: "token:same", dups: true},
		{name: "token:deaf", errs: true, errText: `token line "", want the request's`},
	} {
		if !strings.Contains(tt.name, ":") {
			tt.name = "raw:" + tt.name
		}
		var r *LoadResult
		for _, x := range rs {
			if x.Subject == tt.name {
				r = x
			}
		}
		if r == nil {
			t.Fatalf("no result for %s", tt.name)
		}
		if (r.Duplicates > 0) != tt.dups || (r.Errors > 0) != tt.errs || !strings.Contains(r.FirstError, tt.errText) || r.Lost != 0 {
			t.Errorf("%s: %d duplicates, %d errors (%q), %d lost; want duplicates %v, errors %v (%q)", tt.name, r.Duplicates, r.Errors, r.FirstError, r.Lost, tt.dups, tt.errs, tt.errText)
		}
		if !tt.errs && (r.Requests == 0 || r.Checked == 0) {
			t.Errorf("%s: %d requests, %d IDs checked; want some", tt.name, r.Requests, r.Checked)
		}
	}
}

func TestSpread(t *testing.T) {
	for _, tt := range []struct {
		name string
		in   []float64
		want Spread
	}{
		{name: "odd", in: []float64{0.9, 0.7, 0.8}, want: Spread{Median: 0.8, Min: 0.7, Max: 0.9}},
		{name: "even", in: []float64{0.9, 0.7, 0.8, 1}, want: Spread{Median: 0.85, Min: 0.7, Max: 1}},
	} {
		got := spread(tt.in)
		if got.Median != tt.want.Median || got.Min != tt.want.Min || got.Max != tt.want.Max || !slices.Equal(got.Rounds, tt.in) {
			t.Errorf("%s: spread(%v) = %+v, want %+v", tt.name, tt.in, got, tt.want)
		}
	}
}
