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

	"github.com/nats-io/nats.go/jetstream"

	"github.com/dispenser-dev/dispenser/bench"
	"github.com/dispenser-dev/dispenser/protocol"
	"github.com/dispenser-dev/dispenser/segment/kv"
	"github.com/dispenser-dev/dispenser/tagmodel"
	"github.com/dispenser-dev/dispenser/testenv"
	"github.com/dispenser-dev/dispenser/worker"
)

// testMain runs the tests, or, in a process that `dispenser bench` started
// from this test binary (benchChildEnv is set), the command line instead.
func testMain(m *testing.M) int {
	if os.Getenv(benchChildEnv) == "" {
		code := testenv.Run(m)
		if binDir != "" { // dispenserBinary's build
			os.RemoveAll(binDir)
		}
		return code
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Args[1:], os.Stdout, os.Stderr); err != nil {
		fmt.Fprintln(os.Stderr, "dispenser:", protocol.Describe(err))
		return 1
	}
	return 0
}

// TestBenchSmoke is the CI smoke run of `dispenser bench`: every mode for a
// few hundred milliseconds, every ID checked. It fails on errors and
// duplicates, never on speed.
func TestBenchSmoke(t *testing.T) {
	t.Parallel() // one of the package's slow tests: they run beside each other
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var out, errOut bytes.Buffer
	start := time.Now()
	err := run(ctx, []string{"bench", "--smoke", "--json"}, &out, &errOut)
	t.Logf("bench --smoke took %v; progress:\n%s", time.Since(start).Round(time.Millisecond), errOut.String())
	if err != nil {
		t.Fatalf("bench --smoke: %v\n%s", err, out.String())
	}
	var rep bench.Report
	if err := json.Unmarshal(out.Bytes(), &rep); err != nil {
		t.Fatalf("--json output: %v\n%s", err, out.String())
	}
	// 3 endpoints × (pipelined, sequential, range, list) + 4 step runs
	// + 2 burst runs + 3 + 6 ordered (baseline, ordered, plain; one worker,
	// then three, also a raw request to the baseline and, through the Go
	// client, the baseline and the ordered tag) + 2 × 3
	// client (two rounds of a raw request, one with a token and the Go
	// client to a bare responder, the Go client to the service) + 2 × 3
	// tags_refresh.
	if len(rep.Runs) != 41 {
		t.Errorf("%d runs, want 41", len(rep.Runs))
	}
	// Every run got IDs, each checked. How many requests fell into a
	// run's 300 ms window is speed, which a smoke run does not judge: on a
	// machine at a load of 20, the ordered run through the Go client (p50
	// above 200 ms) once had none in it, with 856 IDs checked.
	for _, r := range rep.Runs {
		if r.Checked == 0 {
			t.Errorf("%s %s: %d requests, %d IDs checked", r.Endpoint, r.Label, r.Requests, r.Checked)
		}
	}
	if rep.Errors != 0 || rep.Lost != 0 || rep.Dups != 0 {
		t.Errorf("errors %d, lost %d, duplicates %d", rep.Errors, rep.Lost, rep.Dups)
	}
	if rep.Memory == nil || rep.Memory.RSSBytes == 0 || rep.Startup == nil || rep.Startup.ServingMS == 0 || len(rep.Step) != 2 {
		t.Errorf("memory %+v, start-up %+v, step %+v: want all measured", rep.Memory, rep.Startup, rep.Step)
	}
	if o := rep.Ordered; o == nil || o.Workers != 3 || o.VsBaseline <= 0 || o.VsPlain <= 0 || o.VsAlone <= 0 || o.ClientVsBaseline <= 0 {
		t.Errorf("ordered %+v: want three workers measured against the baseline, the plain tag, the owner alone and through the Go client", o)
	}
	if cl := rep.Client; cl == nil || cl.Rounds != 2 || cl.ClientVsRaw.Median <= 0 || cl.ServiceVsRaw.Median <= 0 || cl.TokenVsRaw.Median <= 0 || cl.ClientVsToken.Median <= 0 {
		t.Errorf("client %+v: want two rounds, the Go client measured against raw requests, with and without a token", cl)
	}
	if b := rep.Burst; b == nil || b.Workers != 2 || b.VsLarge <= 0 || b.P999Ratio <= 0 || b.Fetches == 0 {
		t.Errorf("burst %+v: want two workers, the cold small step measured against the large one", b)
	}
	if tg := rep.Tags; tg == nil || tg.NewTags != 200 || len(tg.BlocksPerSec) != 4 || tg.FirstPerSec <= 0 || tg.LastPerSec <= 0 ||
		tg.RSSWarmBytes == 0 || tg.ScrapeBytes == 0 || tg.FullListTags < 200 || tg.RefreshChanged == 0 {
		t.Errorf("tags %+v: want 200 new tags in 4 blocks, memory, scrape and refresh measured", tg)
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
	if err := st.CreateTag(context.Background(), tagmodel.Tag{Name: "orders", Step: 1000, MaxID: 1}); err != nil {
		t.Fatal(err)
	}
	srv, err := worker.New(context.Background(), worker.Config{NATS: worker.NATS{URL: ns.ClientURL()}, Instance: "w1", ShutdownTimeout: 10 * time.Second,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
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

// TestBenchPostgres runs the local service under test on PostgreSQL: the
// step runs, the burst run, the ordered run and the tags run with tags
// created in bulk.
func TestBenchPostgres(t *testing.T) {
	t.Parallel() // one of the package's slow tests: they run beside each other
	url := testenv.Postgres(t)
	var out bytes.Buffer
	err := run(context.Background(), []string{"bench", "--postgres-url", url, "--modes", "sequential,step,burst,ordered,tags",
		"--inflight", "16", "--warmup", "50ms", "--duration", "200ms", "--tags", "100", "--tags-store", "500", "--smoke"}, &out, io.Discard)
	if err != nil {
		t.Fatalf("bench: %v\n%s", err, out.String())
	}
	for _, want := range []string{"store postgres (witness on)", "step 100", "step 100 from cold", "ordered over plain",
		"created beforehand (PostgreSQL with 500 tags, witness on)", "refresh on a store of 500 tags"} {
		if text := out.String(); !strings.Contains(text, want) {
			t.Errorf("output lacks %q:\n%s", want, text)
		}
	}
}

func TestBenchFlags(t *testing.T) {
	for _, args := range [][]string{
		{"--modes", "fast"}, {"--format", "json"}, {"--inflight", "0"}, {"--batch", "10001"},
		{"--duration", "0s"}, {"--tag", "a.b"}, {"--tags", "3"}, {"--tags-store", "10000001"}, {"--nats-url", "nats://x", "--postgres-url", "postgres://y"}, {"extra"},
	} {
		err := run(context.Background(), append([]string{"bench"}, args...), io.Discard, io.Discard)
		if err == nil || errors.Is(err, bench.ErrFailed) {
			t.Errorf("bench %v: err = %v, want a usage error", args, err)
		}
	}
}

// TestBenchHidesThePassword: bench against a deployment it cannot reach,
// or whose URL does not parse, fails with an error that shows no part of
// the URL's password.
func TestBenchHidesThePassword(t *testing.T) {
	const secret = "s3cret"
	tests := []struct {
		name, url string
	}{
		{"unreachable", "nats://alice:" + secret + "@127.0.0.1:1"},
		{"unparsable", "nats://alice:" + secret + "%zz@127.0.0.1:1"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var out, errOut bytes.Buffer
			err := run(context.Background(), []string{"bench", "--nats-url", tt.url, "--tag", "orders", "--duration", "100ms"}, &out, &errOut)
			for _, s := range []string{fmt.Sprint(err), out.String(), errOut.String()} {
				if err == nil || strings.Contains(s, secret) || strings.Contains(s, "%zz") {
					t.Fatalf("bench = %v (output %q, %q), want an error without the password", err, out.String(), errOut.String())
				}
			}
		})
	}
}
