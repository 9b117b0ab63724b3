// Command wrkbench measures Leaf's HTTP API (package leafhttp) with wrk, a
// standard HTTP load generator, against a bare net/http handler answering
// an atomic counter (the limit of HTTP in this process), and the NATS
// endpoints with dispenser's own load generator at the same concurrency:
//
//	go run ./internal/tests/wrkbench [-connections 64] [-duration 5s] [-rounds 5]
//
// It starts, in its own process, an embedded nats-server, a worker (as
// `dispenser serve` runs one, KV store, tag "bench" with step 1,000,000,
// --http-addr), the bare HTTP handler and a bare NATS responder (an atomic
// counter too, the limit of NATS in this process). Each round loads, in
// an order that rotates from round to round: the bare HTTP handler,
// /api/segment/get/bench and /api/snowflake/get/bench with `wrk -t1 -cC
// -d1s --latency` (C keep-alive connections, one request in flight on
// each), in turn, a second each, until each had D; then the NATS responder, id.segment.bench and id.snowflake with
// `wrkbench bench-load` (a child process running package bench's load
// generator: C requests in flight on one connection). It prints each
// round and the medians, with each path's ratio to its own transport's
// bare handler in the same round.
//
// `wrkbench views` measures what a client looping the monitoring views
// costs the single-ID load over HTTP, in dispenser binaries built from
// the commits to compare (see views.go).
//
// Needs wrk (Debian: apt-get install --no-install-recommends wrk). It is
// not part of go test.
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/dispenser-dev/dispenser/bench"
	"github.com/dispenser-dev/dispenser/segment"
	"github.com/dispenser-dev/dispenser/worker"
)

func main() {
	if len(os.Args) > 1 && os.Args[1] == ViewsCommand {
		if err := viewsMain(os.Args[2:]); err != nil {
			fmt.Fprintln(os.Stderr, "wrkbench views:", err)
			os.Exit(1)
		}
		return
	}
	if len(os.Args) > 1 && os.Args[1] == bench.LoadCommand {
		if err := load(os.Args[2:]); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		return
	}
	conns := flag.Int("connections", 64, "wrk's keep-alive connections, and the NATS load generator's requests in flight")
	threads := flag.Int("threads", 1, "wrk's threads")
	duration := flag.Duration("duration", 5*time.Second, "measured time of each path in each round")
	rounds := flag.Int("rounds", 5, "rounds")
	flag.Parse()
	if err := run(*conns, *threads, *duration, *rounds); err != nil {
		fmt.Fprintln(os.Stderr, "wrkbench:", err)
		os.Exit(1)
	}
}

// load is the child that runs package bench's load generator.
func load(args []string) error {
	fs := flag.NewFlagSet(bench.LoadCommand, flag.ContinueOnError)
	var c bench.LoadConfig
	c.AddFlags(fs)
	if err := fs.Parse(args); err != nil {
		return err
	}
	return bench.ServeLoad(context.Background(), c, os.Stdout, io.Discard)
}

// result is one path's measurement in one round (or a slice of it).
type result struct {
	path           string
	rps            float64
	p50, p99, p999 float64 // µs
	requests       float64
	seconds        float64
}

// merge sums the slices of one path: requests per second over all of
// them, and the median of their latency percentiles (wrk reports
// percentiles, not histograms, so they cannot be merged exactly).
func merge(path string, rs []result) result {
	out := result{path: path}
	var p50, p99, p999 []float64
	for _, r := range rs {
		out.requests += r.requests
		out.seconds += r.seconds
		p50, p99, p999 = append(p50, r.p50), append(p99, r.p99), append(p999, r.p999)
	}
	out.rps = out.requests / out.seconds
	out.p50, out.p99, out.p999 = median(p50), median(p99), median(p999)
	return out
}

func median(v []float64) float64 {
	s := slices.Clone(v)
	slices.Sort(s)
	if len(s)%2 == 0 {
		return (s[len(s)/2-1] + s[len(s)/2]) / 2
	}
	return s[len(s)/2]
}

// paths, in the report's order; the bare handlers first.
var paths = []string{"http bare", "http segment", "http snowflake", "nats bare", "nats segment", "nats snowflake"}

func run(conns, threads int, d time.Duration, rounds int) error {
	wrk, err := exec.LookPath("wrk")
	if err != nil {
		return fmt.Errorf("wrk not found (%w): apt-get install --no-install-recommends wrk", err)
	}
	dir, err := os.MkdirTemp("", "wrkbench")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	script = dir + "/p999.lua"
	if err := os.WriteFile(script, []byte(wrkScript), 0o644); err != nil {
		return err
	}
	ctx := context.Background()
	w, err := worker.New(ctx, worker.Config{
		Embedded: worker.Embedded{Listen: "127.0.0.1:-1", DataDir: dir},
		Logger:   slog.New(slog.DiscardHandler),
		Segment:  segment.Settings{AutoCreateStep: 1_000_000},
		HTTPAddr: "127.0.0.1:0",
	})
	if err != nil {
		return err
	}
	defer w.Close()
	// The bare handlers: an atomic counter, over HTTP and over NATS.
	var counter atomic.Int64
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	bare := &http.Server{Handler: http.HandlerFunc(func(rw http.ResponseWriter, _ *http.Request) {
		b := strconv.AppendInt(make([]byte, 0, 20), counter.Add(1), 10)
		rw.Header()["Content-Type"] = []string{"text/plain; charset=utf-8"}
		rw.Write(b)
	}), ReadHeaderTimeout: 5 * time.Second}
	go bare.Serve(ln)
	defer bare.Close()
	// Answering bench.bare needs the worker's rights on its embedded
	// server: requesters without credentials may only ask the service.
	key, err := nats.NkeyOptionFromSeed(filepath.Join(dir, worker.KeyFile))
	if err != nil {
		return err
	}
	nc, err := nats.Connect(w.URL(), key)
	if err != nil {
		return err
	}
	defer nc.Close()
	if _, err := nc.Subscribe("bench.bare", func(m *nats.Msg) {
		nc.Publish(m.Reply, strconv.AppendInt(make([]byte, 0, 20), counter.Add(1), 10))
	}); err != nil {
		return err
	}
	if err := nc.Flush(); err != nil {
		return err
	}
	leaf := "http://" + w.LeafAddr()
	urls := map[string]string{
		"http bare":      "http://" + ln.Addr().String() + "/",
		"http segment":   leaf + "/api/segment/get/bench",
		"http snowflake": leaf + "/api/snowflake/get/bench",
	}
	subjects := map[string]string{"nats bare": "bench.bare", "nats segment": "id.segment.bench", "nats snowflake": "id.snowflake"}
	// Create the tag and warm everything up.
	for _, u := range urls {
		if _, err := wrkRun(wrk, u, threads, conns, time.Second); err != nil {
			return err
		}
	}
	self, err := os.Executable()
	if err != nil {
		return err
	}
	fmt.Printf("wrk -t%d -c%d, %v per path per round, %d rounds; NATS: %d requests in flight on one connection\n",
		threads, conns, d, rounds, conns)
	all := map[string][]result{}
	ratios := map[string][]float64{}
	units := [][]string{{"http bare", "http segment", "http snowflake"}, {"nats bare", "nats segment", "nats snowflake"}}
	for r := range rounds {
		got := map[string]result{}
		// Rotate the order of the HTTP paths, and whether HTTP or NATS goes
		// first, from round to round.
		order := slices.Clone(units[0])
		for range r % 3 {
			order = append(order[1:], order[0])
		}
		steps := []func() error{
			func() error {
				// wrk in slices of a second, the paths in turn, so that
				// noise from the rest of the machine falls on all alike.
				var bySlice = map[string][]result{}
				for range max(1, int(d/time.Second)) {
					for _, p := range order {
						res, err := wrkRun(wrk, urls[p], threads, conns, time.Second)
						if err != nil {
							return fmt.Errorf("%s: %w", p, err)
						}
						bySlice[p] = append(bySlice[p], res)
					}
				}
				for p, rs := range bySlice {
					got[p] = merge(p, rs)
				}
				return nil
			},
			func() error {
				subs := units[1]
				for range r % 3 {
					subs = append(slices.Clone(subs[1:]), subs[0])
				}
				var lc []string
				for _, p := range subs {
					lc = append(lc, "--subject", subjects[p])
				}
				res, err := natsRun(self, w.URL(), conns, d, lc)
				if err != nil {
					return err
				}
				for _, lr := range res {
					for p, s := range subjects {
						if s == lr.Subject {
							if lr.Errors > 0 || lr.Lost > 0 {
								return fmt.Errorf("%s: %d errors, %d lost: %s", p, lr.Errors, lr.Lost, lr.FirstError)
							}
							got[p] = result{path: p, rps: lr.RPS, p50: lr.Latency.P50, p99: lr.Latency.P99, p999: lr.Latency.P999}
						}
					}
				}
				return nil
			},
		}
		if r%2 == 1 {
			steps[0], steps[1] = steps[1], steps[0]
		}
		for _, s := range steps {
			if err := s(); err != nil {
				return err
			}
		}
		fmt.Printf("\nround %d\n", r+1)
		for _, unit := range units {
			base := got[unit[0]].rps
			for _, p := range unit {
				res := got[p]
				all[p] = append(all[p], res)
				ratio := res.rps / base
				ratios[p] = append(ratios[p], ratio)
				fmt.Printf("  %-15s %9.0f req/s  p50 %7.0f µs  p99 %7.0f µs  p999 %7.0f µs  %.2fx\n", p, res.rps, res.p50, res.p99, res.p999, ratio)
			}
		}
	}
	fmt.Printf("\nmedians (ranges) over %d rounds; ratio: req/s against the same transport's bare handler in the same round\n", rounds)
	fmt.Println("| path | req/s | p50 µs | p99 µs | p999 µs | ratio |")
	fmt.Println("|---|---|---|---|---|---|")
	for _, p := range paths {
		rs := all[p]
		col := func(f func(result) float64, digits int) string {
			v := make([]float64, len(rs))
			for i, r := range rs {
				v[i] = f(r)
			}
			return medianRange(v, digits)
		}
		fmt.Printf("| %s | %s | %s | %s | %s | %s |\n", p, col(func(r result) float64 { return r.rps }, 0),
			col(func(r result) float64 { return r.p50 }, 0), col(func(r result) float64 { return r.p99 }, 0),
			col(func(r result) float64 { return r.p999 }, 0),
			medianRange(ratios[p], 2))
	}
	return nil
}

// medianRange writes the median of v and its range.
func medianRange(v []float64, digits int) string {
	s := slices.Clone(v)
	slices.Sort(s)
	m := median(s)
	f := "%." + strconv.Itoa(digits) + "f"
	return fmt.Sprintf(f+" ("+f+"–"+f+")", m, s[0], s[len(s)-1])
}

// script is the path of wrkScript, written at the start.
var script string

// wrkScript makes wrk print its 99.9th latency percentile in µs.
const wrkScript = `done = function(summary, latency, requests)
  io.write(string.format("p999 %d\n", latency:percentile(99.9)))
end
`

// wrkRun runs wrk against url and reads its requests per second and
// latency percentiles. Non-2xx answers fail it.
func wrkRun(wrk, url string, threads, conns int, d time.Duration) (result, error) {
	secs := max(1, int(d.Round(time.Second)/time.Second))
	out, err := exec.Command(wrk, "-t"+strconv.Itoa(threads), "-c"+strconv.Itoa(conns), "-d"+strconv.Itoa(secs)+"s", "--latency",
		"-s", script, url).CombinedOutput()
	if err != nil {
		return result{}, fmt.Errorf("wrk: %w\n%s", err, out)
	}
	s := string(out)
	if strings.Contains(s, "Non-2xx") || strings.Contains(s, "Socket errors") {
		return result{}, fmt.Errorf("wrk saw errors:\n%s", s)
	}
	var res result
	m := regexp.MustCompile(`Requests/sec:\s+([0-9.]+)`).FindStringSubmatch(s)
	if m == nil {
		return result{}, fmt.Errorf("no Requests/sec in wrk's output:\n%s", s)
	}
	res.rps, _ = strconv.ParseFloat(m[1], 64)
	m = regexp.MustCompile(`(\d+) requests in ([0-9.]+)(us|ms|s)`).FindStringSubmatch(s)
	if m == nil {
		return result{}, fmt.Errorf("no request count in wrk's output:\n%s", s)
	}
	res.requests, _ = strconv.ParseFloat(m[1], 64)
	res.seconds, _ = strconv.ParseFloat(m[2], 64)
	res.seconds /= map[string]float64{"us": 1e6, "ms": 1e3, "s": 1}[m[3]]
	m = regexp.MustCompile(`(?m)^p999 ([0-9]+)$`).FindStringSubmatch(s)
	if m == nil {
		return result{}, fmt.Errorf("no p999 in wrk's output:\n%s", s)
	}
	res.p999, _ = strconv.ParseFloat(m[1], 64)
	for q, dst := range map[string]*float64{"50": &res.p50, "99": &res.p99} {
		m := regexp.MustCompile(`(?m)^\s+` + q + `%\s+([0-9.]+)(us|ms|s)\s*$`).FindStringSubmatch(s)
		if m == nil {
			return result{}, fmt.Errorf("no %s%% latency in wrk's output:\n%s", q, s)
		}
		v, _ := strconv.ParseFloat(m[1], 64)
		*dst = v * map[string]float64{"us": 1, "ms": 1e3, "s": 1e6}[m[2]]
	}
	return res, nil
}

// natsRun runs the load generator child against the subjects of args.
func natsRun(self, url string, inflight int, d time.Duration, args []string) ([]bench.LoadResult, error) {
	args = append([]string{bench.LoadCommand, "--nats-url", url, "--inflight", strconv.Itoa(inflight), "--batch", "1",
		"--warmup", "500ms", "--duration", d.String(), "--slice", "250ms"}, args...)
	var stdout, stderr bytes.Buffer
	cmd := exec.Command(self, args...)
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return nil, fmt.Errorf("load generator: %w\n%s", err, stderr.String())
	}
	var res []bench.LoadResult
	if err := json.Unmarshal(stdout.Bytes(), &res); err != nil {
		return nil, fmt.Errorf("load generator's results: %w", err)
	}
	if len(res) == 0 {
		return nil, errors.New("load generator: no results")
	}
	return res, nil
}
