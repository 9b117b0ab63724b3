// Command wrkbench measures Leaf's HTTP API (package leafhttp) with wrk, a
// standard HTTP load generator, against a bare net/http handler answering
// an atomic counter (the limit of HTTP in this process), and the NATS
// endpoints with dispenser's own load generator at the same concurrency:
//
//	go run ./internal/tests/wrkbench [-connections 64] [-duration 5s] [-rounds 5]
//	    [-bare-limits] [-bare-path /api/segment/get/bench] [-worker NAME=PATH ...] [-cpuprofile FILE]
//
// It starts, in its own process, an embedded nats-server, a worker (as
// `dispenser serve` runs one, KV store, tag "bench" with step 1,000,000,
// --http-addr, --metrics-addr), the bare HTTP handler and a bare NATS
// responder (an atomic counter too, the limit of NATS in this process).
// The bare HTTP handler is asked for the segment path, so that its server
// reads and parses the same request line as the worker's; -bare-limits
// adds a second bare server with the worker's HTTP limits (timeouts,
// header bound, connection cap). Each round loads, in an order that
// rotates from round to round: the bare HTTP handlers,
// /api/segment/get/bench and /api/snowflake/get/bench with `wrk -t1 -cC
// -d1s --latency` (C keep-alive connections, one request in flight on
// each), in turn, a second each, until each had D; then the NATS
// responder, id.segment.bench and id.snowflake with `wrkbench bench-load`
// (a child process running package bench's load generator: C requests in
// flight on one connection, logged in with the worker's key, as
// requesters without credentials may not ask bench.bare). It prints each
// round and the medians, with each path's ratio to its own transport's
// bare handler in the same round, and for HTTP the serving process's CPU
// time per request (from /proc) and its ratio to the bare handler's: the
// server's cost of a request, which moves less with the rest of the
// machine's load than the rate does.
//
// With -worker NAME=PATH (repeatable) it measures, over HTTP only, the
// dispenser binaries given (each `PATH serve` in a child process:
// embedded nats-server, KV store, tags created on first use with step
// 1,000,000, --http-addr, --metrics-addr) in place of the worker in this
// process, beside the bare handlers in this process: builds compared in
// one run. With -cpuprofile FILE it then loads each HTTP path for D in
// turn while writing this process's CPU profile to FILE.<path>.
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
	"cmp"
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
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"golang.org/x/net/netutil"

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
	var cfg config
	flag.IntVar(&cfg.conns, "connections", 64, "wrk's keep-alive connections, and the NATS load generator's requests in flight")
	flag.IntVar(&cfg.threads, "threads", 1, "wrk's threads")
	flag.DurationVar(&cfg.d, "duration", 5*time.Second, "measured time of each path in each round")
	flag.IntVar(&cfg.rounds, "rounds", 5, "rounds")
	flag.Func("worker", "NAME=PATH: measure Leaf's HTTP API of this dispenser binary, run as `PATH serve` in a child process, instead of the worker in this process (repeat to compare builds; HTTP only)", func(v string) error {
		name, bin, ok := strings.Cut(v, "=")
		if !ok || name == "" || bin == "" || strings.ContainsAny(name, " |") {
			return fmt.Errorf("%q: want NAME=PATH (NAME without spaces)", v)
		}
		cfg.workers = append(cfg.workers, &viewWorker{name: name, bin: bin})
		return nil
	})
	flag.BoolVar(&cfg.bareLimits, "bare-limits", false, "also measure the bare handler on a server with the worker's HTTP limits (timeouts, header bound, connection cap: worker.HTTPLimits' defaults)")
	flag.StringVar(&cfg.barePath, "bare-path", segmentPath, "the path the bare HTTP handler is asked for (it answers any); the segment path by default, so that its server parses the same request line as the worker's")
	flag.StringVar(&cfg.cpuprofile, "cpuprofile", "", "after the rounds, load each HTTP path for -duration in turn while writing this process's CPU profile to FILE.<path> (the worker in this process only)")
	flag.Parse()
	if err := run(cfg); err != nil {
		fmt.Fprintln(os.Stderr, "wrkbench:", err)
		os.Exit(1)
	}
}

// config is wrkbench's command line.
type config struct {
	conns, threads, rounds int
	d                      time.Duration
	workers                []*viewWorker // -worker: dispenser binaries; none: the worker in this process
	bareLimits             bool
	barePath               string
	cpuprofile             string
}

// load is the child that runs package bench's load generator.
func load(args []string) error {
	fs := flag.NewFlagSet(bench.LoadCommand, flag.ContinueOnError)
	var c bench.LoadConfig
	c.AddFlags(fs)
	seed := fs.String("nkey-seed", "", "log in with the NKey of this seed file")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *seed != "" {
		key, err := nats.NkeyOptionFromSeed(*seed)
		if err != nil {
			return err
		}
		c.NATSOptions = append(c.NATSOptions, key)
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
	// cpu is the serving process's CPU time meanwhile (s; HTTP only),
	// cpuPerReq that per request (µs): the server's cost of a request,
	// which depends little on what else the machine runs.
	cpu, cpuPerReq float64
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
		out.cpu += r.cpu
		p50, p99, p999 = append(p50, r.p50), append(p99, r.p99), append(p999, r.p999)
	}
	out.rps = out.requests / out.seconds
	out.cpuPerReq = out.cpu / out.requests * 1e6
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

// bareHandler answers an atomic counter in decimal: the limit of HTTP in
// this process, as a user would write it.
func bareHandler(counter *atomic.Int64) http.Handler {
	return http.HandlerFunc(func(rw http.ResponseWriter, _ *http.Request) {
		b := strconv.AppendInt(make([]byte, 0, 20), counter.Add(1), 10)
		rw.Header()["Content-Type"] = []string{"text/plain; charset=utf-8"}
		rw.Write(b)
	})
}

// segmentPath is the segment path of tag bench, which the bare HTTP
// handler is asked for by default: its server then reads and parses the
// same request line as the worker's (the handler ignores it; a request for
// "/" costs net/http's URL parser less than the API's path).
const segmentPath = "/api/segment/get/bench"

// serveBare serves h on a loopback port, with the worker's HTTP limits if
// limits (the settings of worker.HTTPLimits.serve with its defaults), and
// returns its URL for path.
func serveBare(h http.Handler, limits bool, path string) (*http.Server, string, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, "", err
	}
	s := &http.Server{Handler: h, ReadHeaderTimeout: 5 * time.Second}
	url := "http://" + ln.Addr().String() + path
	if limits {
		s.ReadHeaderTimeout = worker.DefaultReadHeaderTimeout
		s.ReadTimeout, s.WriteTimeout = worker.DefaultReadTimeout, worker.DefaultWriteTimeout
		s.IdleTimeout, s.MaxHeaderBytes = worker.DefaultIdleTimeout, worker.DefaultMaxHeaderBytes
		ln = netutil.LimitListener(ln, worker.DefaultMaxConns)
	}
	go s.Serve(ln)
	return s, url, nil
}

func run(cfg config) error {
	conns, threads, d, rounds := cfg.conns, cfg.threads, cfg.d, cfg.rounds
	if conns < 1 || threads < 1 || rounds < 1 || d < time.Second {
		return errors.New("-connections, -threads and -rounds must be positive, -duration at least 1s")
	}
	if !strings.HasPrefix(cfg.barePath, "/") {
		return fmt.Errorf("-bare-path %q: want a path (/...)", cfg.barePath)
	}
	if cfg.cpuprofile != "" && len(cfg.workers) > 0 {
		return errors.New("-cpuprofile profiles the worker in this process: not with -worker")
	}
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
	// The bare handlers: an atomic counter, over HTTP and over NATS.
	var counter atomic.Int64
	bare, bareURL, err := serveBare(bareHandler(&counter), false, cfg.barePath)
	if err != nil {
		return err
	}
	defer bare.Close()
	httpUnit := []string{"http bare"}
	urls := map[string]string{"http bare": bareURL}
	// pids are the processes serving the HTTP paths, whose CPU time
	// is measured: this one but for the -worker binaries.
	pids := map[string]int{}
	if cfg.bareLimits {
		bl, u, err := serveBare(bareHandler(&counter), true, cfg.barePath)
		if err != nil {
			return err
		}
		defer bl.Close()
		httpUnit = append(httpUnit, "http bare limits")
		urls["http bare limits"] = u
	}
	units := [][]string{httpUnit}
	subjects := map[string]string{"nats bare": "bench.bare", "nats segment": "id.segment.bench", "nats snowflake": "id.snowflake"}
	var natsURL string
	if len(cfg.workers) > 0 {
		defer func() {
			for _, w := range cfg.workers {
				w.stop()
			}
		}()
		for i, w := range cfg.workers {
			w.dir = fmt.Sprintf("%s/w%d", dir, i)
			if err := w.start("--auto-create-tags", "--auto-create-step", "1000000"); err != nil {
				return fmt.Errorf("%s: %w", w.name, err)
			}
			for _, p := range []string{"segment", "snowflake"} {
				name := w.name + " " + p
				units[0] = append(units[0], name)
				urls[name] = "http://" + w.http + "/api/" + p + "/get/bench"
				pids[name] = w.cmd.Process.Pid
			}
		}
	} else {
		ctx := context.Background()
		w, err := worker.New(ctx, worker.Config{
			Embedded: worker.Embedded{Listen: "127.0.0.1:-1", DataDir: dir},
			Logger:   slog.New(slog.DiscardHandler),
			Segment:  segment.Settings{AutoCreateStep: 1_000_000},
			HTTPAddr: "127.0.0.1:0",
			// As the -worker binaries: the metrics (transport="http")
			// are recorded.
			MetricsAddr: "127.0.0.1:0",
		})
		if err != nil {
			return err
		}
		defer w.Close()
		natsURL = w.URL()
		// Answering bench.bare needs the worker's rights on its embedded
		// server: requesters without credentials may only ask the service.
		key, err := nats.NkeyOptionFromSeed(filepath.Join(dir, worker.KeyFile))
		if err != nil {
			return err
		}
		nc, err := nats.Connect(natsURL, key)
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
		units[0] = append(units[0], "http segment", "http snowflake")
		urls["http segment"] = leaf + segmentPath
		urls["http snowflake"] = leaf + "/api/snowflake/get/bench"
		units = append(units, []string{"nats bare", "nats segment", "nats snowflake"})
	}
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
	fmt.Printf("wrk -t%d -c%d, %v per path per round, %d rounds; the bare HTTP handler asked for %s", threads, conns, d, rounds, cfg.barePath)
	if len(units) > 1 {
		fmt.Printf("; NATS: %d requests in flight on one connection", conns)
	}
	fmt.Println()
	for _, w := range cfg.workers {
		fmt.Printf("%s: %s serve (embedded nats-server, KV store, --http-addr, --metrics-addr)\n", w.name, w.bin)
	}
	all := map[string][]result{}
	ratios, cpuRatios := map[string][]float64{}, map[string][]float64{}
	for r := range rounds {
		got := map[string]result{}
		// Rotate the order of the HTTP paths, and whether HTTP or NATS goes
		// first, from round to round.
		order := slices.Clone(units[0])
		for range r % len(order) {
			order = append(order[1:], order[0])
		}
		steps := []func() error{
			func() error {
				// wrk in slices of a second, the paths in turn, so that
				// noise from the rest of the machine falls on all alike.
				var bySlice = map[string][]result{}
				for range max(1, int(d/time.Second)) {
					for _, p := range order {
						pid := cmp.Or(pids[p], os.Getpid())
						cpu := procCPU(pid)
						res, err := wrkRun(wrk, urls[p], threads, conns, time.Second)
						if err != nil {
							return fmt.Errorf("%s: %w", p, err)
						}
						res.cpu = (procCPU(pid) - cpu).Seconds()
						bySlice[p] = append(bySlice[p], res)
					}
				}
				for p, rs := range bySlice {
					got[p] = merge(p, rs)
				}
				return nil
			},
		}
		if len(units) > 1 {
			steps = append(steps, func() error {
				subs := units[1]
				for range r % 3 {
					subs = append(slices.Clone(subs[1:]), subs[0])
				}
				var lc []string
				for _, p := range subs {
					lc = append(lc, "--subject", subjects[p])
				}
				// The worker's key: a requester without credentials may
				// publish to the service's subjects only, not to
				// bench.bare, whose requests would go unanswered.
				lc = append(lc, "--nkey-seed", filepath.Join(dir, worker.KeyFile))
				res, err := natsRun(self, natsURL, conns, d, lc)
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
			})
			if r%2 == 1 {
				steps[0], steps[1] = steps[1], steps[0]
			}
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
				if res.cpuPerReq > 0 {
					cpuRatios[p] = append(cpuRatios[p], res.cpuPerReq/got[unit[0]].cpuPerReq)
				}
				fmt.Printf("  %-20s %9.0f req/s  p50 %7.0f µs  p99 %7.0f µs  p999 %7.0f µs  %.2fx", p, res.rps, res.p50, res.p99, res.p999, ratio)
				if res.cpuPerReq > 0 {
					fmt.Printf("  cpu %5.1f µs/req %.2fx", res.cpuPerReq, res.cpuPerReq/got[unit[0]].cpuPerReq)
				}
				fmt.Println()
			}
		}
	}
	fmt.Printf("\nmedians (ranges) over %d rounds; ratio: req/s against the same transport's bare handler (\"http bare\", \"nats bare\") in the same round; cpu: the serving process's CPU time per request (HTTP only), and its ratio to the bare handler's in the same round\n", rounds)
	fmt.Println("| path | req/s | p50 µs | p99 µs | p999 µs | ratio | cpu µs/req | cpu ratio |")
	fmt.Println("|---|---|---|---|---|---|---|---|")
	for _, unit := range units {
		for _, p := range unit {
			rs := all[p]
			col := func(f func(result) float64, digits int) string {
				v := make([]float64, len(rs))
				for i, r := range rs {
					v[i] = f(r)
				}
				return medianRange(v, digits)
			}
			cpu, cpuRatio := "–", "–"
			if len(cpuRatios[p]) > 0 {
				cpu, cpuRatio = col(func(r result) float64 { return r.cpuPerReq }, 1), medianRange(cpuRatios[p], 2)
			}
			fmt.Printf("| %s | %s | %s | %s | %s | %s | %s | %s |\n", p, col(func(r result) float64 { return r.rps }, 0),
				col(func(r result) float64 { return r.p50 }, 0), col(func(r result) float64 { return r.p99 }, 0),
				col(func(r result) float64 { return r.p999 }, 0),
				medianRange(ratios[p], 2), cpu, cpuRatio)
		}
	}
	if cfg.cpuprofile != "" {
		return profile(cfg, wrk, units[0], urls)
	}
	return nil
}

// profile loads each HTTP path with wrk for -duration in turn while it
// writes this process's CPU profile to -cpuprofile's file with the path
// after a dot (FILE.http-bare, FILE.http-segment, ...): the worker's HTTP
// path beside the bare handler's, the rest of the process idle meanwhile.
func profile(cfg config, wrk string, paths []string, urls map[string]string) error {
	fmt.Printf("\nCPU profiles of %v of wrk on each path:\n", cfg.d)
	for _, p := range paths {
		name := cfg.cpuprofile + "." + strings.ReplaceAll(p, " ", "-")
		f, err := os.Create(name)
		if err != nil {
			return err
		}
		if err := pprof.StartCPUProfile(f); err != nil {
			f.Close()
			return err
		}
		res, err := wrkRun(wrk, urls[p], cfg.threads, cfg.conns, cfg.d)
		pprof.StopCPUProfile()
		if err := errors.Join(err, f.Close()); err != nil {
			return fmt.Errorf("%s: %w", p, err)
		}
		fmt.Printf("  %-20s %9.0f req/s  %s\n", p, res.rps, name)
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
