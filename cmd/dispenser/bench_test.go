package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nats.go/micro"

	"github.com/dispenser-dev/dispenser/segment"
	"github.com/dispenser-dev/dispenser/segment/kv"
	"github.com/dispenser-dev/dispenser/testenv"
)

// testMain runs the tests, or, in a process that `dispenser bench` started
// from this test binary (benchChildEnv is set), the command line instead.
func testMain(m *testing.M) int {
	if os.Getenv(benchChildEnv) == "" {
		return testenv.Run(m)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Args[1:], os.Stdout, os.Stderr); err != nil {
		fmt.Fprintln(os.Stderr, "dispenser:", err)
		return 1
	}
	return 0
}

// TestBenchSmoke is the CI smoke run of `dispenser bench`: every mode for a
// few hundred milliseconds, every ID checked. It fails on errors and
// duplicates, never on speed.
func TestBenchSmoke(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var out, errOut bytes.Buffer
	start := time.Now()
	err := run(ctx, []string{"bench", "--smoke", "--json"}, &out, &errOut)
	t.Logf("bench --smoke took %v; progress:\n%s", time.Since(start).Round(time.Millisecond), errOut.String())
	if err != nil {
		t.Fatalf("bench --smoke: %v\n%s", err, out.String())
	}
	var rep benchReport
	if err := json.Unmarshal(out.Bytes(), &rep); err != nil {
		t.Fatalf("--json output: %v\n%s", err, out.String())
	}
	// 3 endpoints × (pipelined, sequential, range, list) + 4 step runs.
	if len(rep.Runs) != 16 {
		t.Errorf("%d runs, want 16", len(rep.Runs))
	}
	for _, r := range rep.Runs {
		if r.Requests == 0 || r.Checked == 0 {
			t.Errorf("%s %s: %d requests, %d IDs checked", r.Endpoint, r.Label, r.Requests, r.Checked)
		}
	}
	if rep.Errors != 0 || rep.Lost != 0 || rep.Dups != 0 {
		t.Errorf("errors %d, lost %d, duplicates %d", rep.Errors, rep.Lost, rep.Dups)
	}
	if rep.Memory == nil || rep.Memory.RSSBytes == 0 || rep.Startup == nil || rep.Startup.ServingMS == 0 || len(rep.Step) != 2 {
		t.Errorf("memory %+v, start-up %+v, step %+v: want all measured", rep.Memory, rep.Startup, rep.Step)
	}
}

// TestBenchDeployment loads a running worker through --nats-url: nothing
// is started, there is no baseline.
func TestBenchDeployment(t *testing.T) {
	ns := testenv.NATS(t)
	js, err := jetstream.New(testenv.Connect(t, ns))
	if err != nil {
		t.Fatal(err)
	}
	st, err := kv.New(context.Background(), js, kv.Settings{})
	if err != nil {
		t.Fatal(err)
	}
	if err := st.CreateTag(context.Background(), segment.Tag{Name: "orders", Step: 1000, MaxID: 1}); err != nil {
		t.Fatal(err)
	}
	srv := NewServer(serveConfig{NATSURL: ns.ClientURL(), Instance: "w1", Snowflake: true, ShutdownTimeout: 10 * time.Second},
		slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err := srv.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	var out, errOut bytes.Buffer
	err = run(context.Background(), []string{"bench", "--nats-url", ns.ClientURL(), "--tag", "orders",
		"--modes", "pipelined,sequential,step,memory,startup", "--inflight", "16", "--warmup", "50ms", "--duration", "200ms", "--smoke"}, &out, &errOut)
	if err != nil {
		t.Fatalf("bench: %v\n%s\n%s", err, out.String(), errOut.String())
	}
	text := out.String()
	for _, want := range []string{"deployment " + ns.ClientURL(), "16 in flight, 1 ID", "segment", "snowflake", "duplicates 0",
		"step, memory, startup: left out"} {
		if !strings.Contains(text, want) {
			t.Errorf("output lacks %q:\n%s", want, text)
		}
	}
	for _, unwanted := range []string{"baseline", "step 100", "idle worker", "first segment ID"} {
		if strings.Contains(text, unwanted) {
			t.Errorf("output has %q, which needs the local set-up:\n%s", unwanted, text)
		}
	}
	err = run(context.Background(), []string{"bench", "--nats-url", ns.ClientURL(), "--tag", "nope", "--duration", "100ms"}, &out, &errOut)
	if err == nil || !strings.Contains(err.Error(), "tags create") {
		t.Errorf("bench on an invalid tag: %v, want a hint to create it", err)
	}
}

// TestBenchPostgres runs the local service under test on PostgreSQL.
func TestBenchPostgres(t *testing.T) {
	url := testenv.Postgres(t)
	var out bytes.Buffer
	err := run(context.Background(), []string{"bench", "--postgres-url", url, "--modes", "sequential,step",
		"--inflight", "16", "--warmup", "50ms", "--duration", "200ms", "--smoke"}, &out, io.Discard)
	if err != nil {
		t.Fatalf("bench: %v\n%s", err, out.String())
	}
	if text := out.String(); !strings.Contains(text, "store postgres") || !strings.Contains(text, "step 100") {
		t.Errorf("output:\n%s", text)
	}
}

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
	cfg := loadConfig{URL: ns.ClientURL(), Inflight: 4, Batch: 1, Format: "list", Warmup: 10 * time.Millisecond,
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
		rs, err := runLoad(context.Background(), c, nil)
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
	rs, err := runLoad(context.Background(), c, nil)
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

func TestHistogram(t *testing.T) {
	var h histogram
	for v := int64(1); v <= 100_000; v++ {
		h.record(v * 1000) // 1µs .. 100ms
	}
	for _, tt := range []struct{ q, want float64 }{{0.5, 50_000}, {0.99, 99_000}, {0.999, 99_900}} {
		got := float64(h.quantile(tt.q)) / 1000
		if got < tt.want*0.995 || got > tt.want*1.005 {
			t.Errorf("quantile %v = %vµs, want %vµs ± 0.5%%", tt.q, got, tt.want)
		}
	}
	if s := h.stats(); s.Max != 100_000 || s.Mean < 50_000 || s.Mean > 50_001 {
		t.Errorf("stats %+v", s)
	}
	for _, v := range []int64{0, 1, 255, 256, 257, 1 << 20, 1<<40 - 1, 1 << 50} {
		i := histIndex(v)
		if i < 0 || i >= histBuckets {
			t.Fatalf("histIndex(%d) = %d out of range", v, i)
		}
		if mid := histValue(i); v < 1<<40 && (mid < v-v/200-1 || mid > v+v/200+1) {
			t.Errorf("histValue(histIndex(%d)) = %d: off by more than 0.5%%", v, mid)
		}
	}
	if n := testing.AllocsPerRun(100, func() { h.record(12345) }); n != 0 {
		t.Errorf("record allocates %v times", n)
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

func TestBenchFlags(t *testing.T) {
	for _, args := range [][]string{
		{"--modes", "fast"}, {"--format", "json"}, {"--inflight", "0"}, {"--batch", "10001"},
		{"--duration", "0s"}, {"--tag", "a.b"}, {"--nats-url", "nats://x", "--postgres-url", "postgres://y"}, {"extra"},
	} {
		err := run(context.Background(), append([]string{"bench"}, args...), io.Discard, io.Discard)
		if err == nil || errors.Is(err, errBenchFailed) {
			t.Errorf("bench %v: err = %v, want a usage error", args, err)
		}
	}
}
