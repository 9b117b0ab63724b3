package main

// The views benchmark: what a client looping the monitoring views costs
// the single-ID load over HTTP.
//
//	go run ./internal/tests/wrkbench views -worker NAME=PATH [-worker NAME=PATH ...]
//	    [-tags 100000] [-connections 4] [-view-connections 4]
//	    [-views /cache,/db?format=json,/status] [-duration 5s] [-rounds 5]
//
// Each -worker is a dispenser binary (built from some commit: the
// benchmark compares builds, not code in this process). For each it starts
// `PATH serve` in a child process (embedded nats-server, KV store, tags
// created on first use without bound, --http-addr and --metrics-addr, no
// snowflake, the tag list reloaded hourly so that one worker's reload
// does not fall on another's measurement) and warms -tags tags: each is
// asked for one ID over HTTP, 32 at a time. Then each round, for each
// worker in turn (the order rotates from round to round), it runs the
// single-ID load, `wrk -t1 -cC --latency` on /api/segment/get/hot for
// -duration, twice: alone ("quiet"), and while a view client in this
// process loops over the -views on -view-connections connections (each
// connection asks for them in turn, as fast as they come; "views"; with
// sets of views separated by ";", a phase for each). The order of the
// phases rotates from round to round. It prints each
// round's p50, p99 and p99.9 of the single-ID load in both phases, their
// ratio (views over quiet), the worker's CPU time a second (from /proc)
// and the views the client got a second, and the medians over the rounds.

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// ViewsCommand is the first argument that runs the views benchmark.
const ViewsCommand = "views"

// viewWorker is one dispenser binary under test, running.
type viewWorker struct {
	name, bin     string
	dir           string
	http, metrics string // host:port
	cmd           *exec.Cmd
	stderr        *lockedBuffer
	done          chan struct{} // closed when cmd has exited
	waitErr       error         // set before done is closed
	warmed        time.Duration
	quiet         []phase
	withViews     [][]phase      // by set of views
	refused       int64          // views answered with another status than 200 while measured
	ratios        [][3][]float64 // by set of views: p50, p99, p99.9, views over quiet
}

// phase is one measurement of the single-ID load: wrk's figures, the
// worker's CPU time a second meanwhile, and the views the view client got
// a second (none in the quiet phase).
type phase struct {
	result
	cpu, views float64
}

// lockedBuffer is a bytes.Buffer for a child's stderr, read while it runs.
type lockedBuffer struct {
	mu  sync.Mutex // protects buf
	buf []byte
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if len(b.buf) < 1<<16 {
		b.buf = append(b.buf, p...)
	}
	return len(p), nil
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return string(b.buf)
}

func viewsMain(args []string) error {
	fs := flag.NewFlagSet(ViewsCommand, flag.ContinueOnError)
	var workers []*viewWorker
	fs.Func("worker", "NAME=PATH: a dispenser binary to measure (repeat to compare builds)", func(v string) error {
		name, bin, ok := strings.Cut(v, "=")
		if !ok || name == "" || bin == "" {
			return fmt.Errorf("%q: want NAME=PATH", v)
		}
		workers = append(workers, &viewWorker{name: name, bin: bin})
		return nil
	})
	tags := fs.Int("tags", 100_000, "warm tags in each worker")
	conns := fs.Int("connections", 4, "wrk's keep-alive connections for the single-ID load")
	viewConns := fs.Int("view-connections", 4, "connections of the view client, each looping over the -views in turn")
	viewList := fs.String("views", "/cache,/db?format=json,/status", "comma-separated views the view client loops (/status is on --metrics-addr, the others on --http-addr); several sets separated by ; are measured in phases of their own")
	d := fs.Duration("duration", 5*time.Second, "measured time of each phase in each round")
	rounds := fs.Int("rounds", 5, "rounds")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if len(workers) == 0 {
		return errors.New("no -worker NAME=PATH given")
	}
	var sets [][]string
	var setNames []string
	for set := range strings.SplitSeq(*viewList, ";") {
		sets, setNames = append(sets, strings.Split(set, ",")), append(setNames, "views "+set)
	}
	if len(sets) == 1 {
		setNames[0] = "views"
	}
	if *tags < 1 || *conns < 1 || *viewConns < 1 || *rounds < 1 || *d < time.Second {
		return errors.New("-tags, -connections, -view-connections and -rounds must be positive, -duration at least 1s")
	}
	for _, set := range sets {
		for _, v := range set {
			if !strings.HasPrefix(v, "/") {
				return fmt.Errorf("-views: %q is not a path", v)
			}
		}
	}
	for _, w := range workers {
		w.withViews, w.ratios = make([][]phase, len(sets)), make([][3][]float64, len(sets))
	}
	wrk, err := exec.LookPath("wrk")
	if err != nil {
		return fmt.Errorf("wrk not found (%w): apt-get install --no-install-recommends wrk", err)
	}
	dir, err := os.MkdirTemp("", "viewbench")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	script = dir + "/p999.lua"
	if err := os.WriteFile(script, []byte(wrkScript), 0o644); err != nil {
		return err
	}
	defer func() {
		for _, w := range workers {
			w.stop()
		}
	}()
	// An error says why a worker that exited did.
	exitedWhy := func(err error) error {
		for _, w := range workers {
			if w.exited() {
				err = fmt.Errorf("%w\n%s exited: %v\n%s", err, w.name, w.waitErr, w.stderr)
			}
		}
		return err
	}
	for i, w := range workers {
		w.dir = fmt.Sprintf("%s/w%d", dir, i)
		if err := w.start(viewFlags...); err != nil {
			return fmt.Errorf("%s: %w", w.name, err)
		}
		start := time.Now()
		if err := w.warm(*tags); err != nil {
			return exitedWhy(fmt.Errorf("%s: warming %d tags: %w", w.name, *tags, err))
		}
		w.warmed = time.Since(start)
		fmt.Printf("%s (%s): %d tags warm in %v (the worker's CPU time so far: %v)\n", w.name, w.bin, *tags,
			w.warmed.Round(time.Millisecond), w.cpu().Round(time.Millisecond))
		// The hot tag, and a second of wrk to warm the path.
		if _, err := wrkRun(wrk, w.idURL(), 1, *conns, time.Second); err != nil {
			return fmt.Errorf("%s: %w", w.name, err)
		}
	}
	fmt.Printf("single-ID load: wrk -t1 -c%d -d%v --latency %s; views: %d connections looping %s; %d rounds\n",
		*conns, *d, "/api/segment/get/hot", *viewConns, *viewList, *rounds)
	for r := range *rounds {
		order := slices.Clone(workers)
		for range r % len(order) {
			order = append(order[1:], order[0])
		}
		fmt.Printf("\nround %d\n", r+1)
		for _, w := range order {
			if w.exited() {
				return exitedWhy(errors.New("a worker exited"))
			}
			// The phases: quiet (-1) and each set of views, in an
			// order that rotates from round to round.
			phases := []int{-1}
			for i := range sets {
				phases = append(phases, i)
			}
			for range r % len(phases) {
				phases = append(phases[1:], phases[0])
			}
			got := map[int]phase{}
			for _, i := range phases {
				var vs []string
				if i >= 0 {
					vs = sets[i]
				}
				ph, err := w.measure(wrk, *conns, *viewConns, *d, vs)
				if err != nil {
					return exitedWhy(fmt.Errorf("%s: %w", w.name, err))
				}
				got[i] = ph
			}
			quiet := got[-1]
			w.quiet = append(w.quiet, quiet)
			fmt.Printf("  %-8s quiet: %6.0f req/s p50 %5.0f p99 %6.0f p99.9 %6.0f µs cpu %.2f\n",
				w.name, quiet.rps, quiet.p50, quiet.p99, quiet.p999, quiet.cpu)
			for i := range sets {
				loud := got[i]
				w.withViews[i] = append(w.withViews[i], loud)
				ratio := [3]float64{loud.p50 / quiet.p50, loud.p99 / quiet.p99, loud.p999 / quiet.p999}
				for j := range ratio {
					w.ratios[i][j] = append(w.ratios[i][j], ratio[j])
				}
				fmt.Printf("  %-8s %s (%.1f/s): %6.0f req/s p50 %5.0f p99 %6.0f p99.9 %6.0f µs cpu %.2f | p99 %.1fx\n",
					w.name, setNames[i], loud.views, loud.rps, loud.p50, loud.p99, loud.p999, loud.cpu, ratio[1])
			}
		}
	}
	fmt.Printf("\nmedians (ranges) over %d rounds; latencies in µs; cpu: the worker's CPU seconds a second; ratio: with views over quiet, in the same round\n", *rounds)
	fmt.Println("| build | phase | req/s | p50 | p99 | p99.9 | cpu | views/s |")
	fmt.Println("|---|---|---:|---:|---:|---:|---:|---:|")
	col := func(ps []phase, digits int, f func(phase) float64) string {
		v := make([]float64, len(ps))
		for i, p := range ps {
			v[i] = f(p)
		}
		return medianRange(v, digits)
	}
	row := func(w *viewWorker, name string, ps []phase, views bool) {
		vps := "–"
		if views {
			vps = col(ps, 1, func(p phase) float64 { return p.views })
		}
		fmt.Printf("| %s | %s | %s | %s | %s | %s | %s | %s |\n", w.name, name,
			col(ps, 0, func(p phase) float64 { return p.rps }), col(ps, 0, func(p phase) float64 { return p.p50 }),
			col(ps, 0, func(p phase) float64 { return p.p99 }), col(ps, 0, func(p phase) float64 { return p.p999 }),
			col(ps, 2, func(p phase) float64 { return p.cpu }), vps)
	}
	for _, w := range workers {
		row(w, "quiet", w.quiet, false)
		for i := range sets {
			row(w, setNames[i], w.withViews[i], true)
			fmt.Printf("| %s | ratio | | %s | %s | %s | | |\n", w.name,
				medianRange(w.ratios[i][0], 1), medianRange(w.ratios[i][1], 1), medianRange(w.ratios[i][2], 1))
		}
	}
	for _, w := range workers {
		if w.refused > 0 {
			fmt.Printf("%s: %d views were answered with another status than 200 (a /db while another is read is 503)\n", w.name, w.refused)
		}
	}
	return nil
}

// freeAddr returns a loopback address with a port free a moment ago.
func freeAddr() (string, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer ln.Close()
	return ln.Addr().String(), nil
}

// viewFlags are the flags of `serve` for the views benchmark: tags
// created on first use without bound, no snowflake, the tag list
// reloaded hourly rather than every minute: with several workers up at
// once, one's reload of 100,000 tags would fall on another's measurement.
var viewFlags = []string{"--auto-create-tags", "--auto-create-max", "-1", "--snowflake=false", "--refresh-interval", "1h"}

// start runs `bin serve` with an embedded nats-server, --http-addr,
// --metrics-addr and flags, and waits until its /readyz says ready.
func (w *viewWorker) start(flags ...string) error {
	var addrs [3]string
	for i := range addrs {
		a, err := freeAddr()
		if err != nil {
			return err
		}
		addrs[i] = a
	}
	w.http, w.metrics = addrs[1], addrs[2]
	w.cmd = exec.Command(w.bin, append([]string{"serve", "--data-dir", w.dir, "--nats-listen", addrs[0],
		"--http-addr", w.http, "--metrics-addr", w.metrics, "--log-level", "warn"}, flags...)...)
	// The worker dies with this process, however it ends.
	w.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	w.stderr = &lockedBuffer{}
	w.cmd.Stdout, w.cmd.Stderr = w.stderr, w.stderr
	if err := w.cmd.Start(); err != nil {
		return err
	}
	w.done = make(chan struct{})
	go func() {
		w.waitErr = w.cmd.Wait()
		close(w.done)
	}()
	deadline := time.Now().Add(60 * time.Second)
	for {
		resp, err := http.Get("http://" + w.metrics + "/readyz")
		if err == nil {
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		if w.exited() {
			return fmt.Errorf("exited: %v\n%s", w.waitErr, w.stderr)
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("not ready after 60s (%v)\n%s", err, w.stderr)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// cpu returns the worker's CPU time so far (user and system), from
// /proc; 0 where there is none.
func (w *viewWorker) cpu() time.Duration { return procCPU(w.cmd.Process.Pid) }

// procCPU returns the CPU time so far (user and system) of process pid,
// from /proc; 0 where there is none.
func procCPU(pid int) time.Duration {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	// The fields after the command name (which may hold spaces).
	f := strings.Fields(string(b[bytes.LastIndexByte(b, ')')+1:]))
	if len(f) < 13 {
		return 0
	}
	utime, _ := strconv.ParseInt(f[11], 10, 64)
	stime, _ := strconv.ParseInt(f[12], 10, 64)
	return time.Duration(utime+stime) * time.Second / 100 // USER_HZ
}

func (w *viewWorker) exited() bool {
	select {
	case <-w.done:
		return true
	default:
		return false
	}
}

// stop ends the worker with SIGTERM (a graceful shutdown), or kills it.
func (w *viewWorker) stop() {
	if w.cmd == nil || w.cmd.Process == nil || w.exited() {
		return
	}
	w.cmd.Process.Signal(os.Interrupt)
	select {
	case <-w.done:
	case <-time.After(10 * time.Second):
		w.cmd.Process.Kill()
		<-w.done
	}
}

func (w *viewWorker) idURL() string { return "http://" + w.http + "/api/segment/get/hot" }

// warm asks for one ID of each of n tags (created on first use), 64 at a
// time,
// again if 503.
func (w *viewWorker) warm(n int) error {
	const par = 32
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: par}, Timeout: 30 * time.Second}
	defer client.CloseIdleConnections()
	var next, retries atomic.Int64
	errs := make(chan error, par)
	for range par {
		go func() {
			for {
				i := next.Add(1) - 1
				if i >= int64(n) {
					errs <- nil
					return
				}
				var resp *http.Response
				var body []byte
				var err error
				// A cold tag waits --cold-wait for its first segment,
				// then is 503: try again.
				for try := 0; try < 10; try++ {
					resp, err = client.Get("http://" + w.http + "/api/segment/get/" + viewTag(int(i)))
					if err != nil {
						errs <- err
						return
					}
					body, _ = io.ReadAll(resp.Body)
					resp.Body.Close()
					if resp.StatusCode != http.StatusServiceUnavailable {
						break
					}
					retries.Add(1)
				}
				if resp.StatusCode != http.StatusOK {
					errs <- fmt.Errorf("tag %s: %s %s", viewTag(int(i)), resp.Status, body)
					return
				}
			}
		}()
	}
	var first error
	for range par {
		if err := <-errs; err != nil && first == nil {
			first = err
			next.Store(int64(n)) // stop the others
		}
	}
	if r := retries.Load(); r > 0 && first == nil {
		fmt.Printf("%s: %d first requests were 503 and asked again\n", w.name, r)
	}
	return first
}

// viewTag is the name of the i-th warm tag.
func viewTag(i int) string { return fmt.Sprintf("t%06d", i) }

// measure runs the single-ID load for d, with the view client looping
// over views (none if nil) on viewConns connections.
func (w *viewWorker) measure(wrk string, conns, viewConns int, d time.Duration, views []string) (phase, error) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	urls := make([]string, len(views))
	for i, v := range views {
		host := w.http
		if strings.HasPrefix(v, "/status") {
			host = w.metrics
		}
		urls[i] = "http://" + host + v
	}
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: viewConns, MaxConnsPerHost: viewConns}}
	defer client.CloseIdleConnections()
	var got, refused atomic.Int64 // 200s, and other answers (a busy /db is 503)
	var wg sync.WaitGroup
	var errMu sync.Mutex // protects viewErr
	var viewErr error    // the first failed request
	for c := range viewConns {
		if len(urls) == 0 {
			break
		}
		wg.Go(func() {
			for i := c; ctx.Err() == nil; i++ {
				req, _ := http.NewRequestWithContext(ctx, http.MethodGet, urls[i%len(urls)], nil)
				resp, err := client.Do(req)
				ok := false
				if err == nil {
					_, err = io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
					ok = resp.StatusCode == http.StatusOK
				}
				if ctx.Err() != nil {
					return
				}
				if err != nil {
					errMu.Lock()
					if viewErr == nil {
						viewErr = err
					}
					errMu.Unlock()
					continue
				}
				if !ok {
					refused.Add(1)
					continue
				}
				got.Add(1)
			}
		})
	}
	if len(urls) > 0 {
		// Let the view loop reach its pace before the load starts.
		time.Sleep(time.Second)
	}
	before, refusedBefore, cpuBefore, start := got.Load(), refused.Load(), w.cpu(), time.Now()
	res, err := wrkRun(wrk, w.idURL(), 1, conns, d)
	elapsed := time.Since(start).Seconds()
	ph := phase{result: res, views: float64(got.Load()-before) / elapsed, cpu: (w.cpu() - cpuBefore).Seconds() / elapsed}
	w.refused += refused.Load() - refusedBefore
	cancel()
	wg.Wait()
	if err == nil && viewErr != nil {
		err = fmt.Errorf("view client: %w", viewErr)
	}
	return ph, err
}
