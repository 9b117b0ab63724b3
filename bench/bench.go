// Package bench is the harness of `dispenser bench`: it measures, in one
// run with one load generator, a baseline responder, the segment endpoint
// and the snowflake endpoint, and reports requests/s, IDs/s, latency
// percentiles and each endpoint's ratio to the baseline.
//
// The parts:
//
//   - the load generator (load.go) keeps a fixed number of requests in
//     flight and checks every reply (loadcheck.go). It runs in a child
//     process, the program started again from os.Executable() with its
//     hidden LoadCommand (loadcmd.go), so that it shares no runtime with
//     the service it loads;
//   - the measurement: latencies in an HdrHistogram (latency.go), the local
//     set-up (local.go: an embedded nats-server, the baseline responder and
//     the service under test, workers of package worker as `dispenser serve`
//     runs them), child processes and idle memory (child.go), start-up time
//     (startup.go) and segment fetch latency (fetch.go);
//   - the feature runs: an ordered tag served by three workers (ordered.go)
//     and many tags: new-tag rate, memory and /metrics per warm tag,
//     refresh time and latency during refreshes (tags.go);
//   - the report (report.go): tables or JSON, targets, progress lines.
//
// The program (cmd/dispenser) defines its bench flags with Flags, which
// checks them into a Config and calls Run, and its LoadCommand's with
// LoadFlags (LoadConfig.AddFlags), which calls ServeLoad; it parses them.
package bench

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"slices"
	"strings"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/dispenser-dev/dispenser/internal/redact"
)

// ErrFailed means a run saw error replies, lost requests or duplicate IDs.
var ErrFailed = errors.New("bench failed")

// Modes are the measurements Config.Modes selects from, in the order they
// run: pipelined, sequential, batch and step are load runs; ordered (three
// workers, an ordered tag), client (the Go client's own cost), tags (many tags), fetch, memory and startup
// need the local set-up.
var Modes = []string{"pipelined", "sequential", "batch", "step", "burst", "ordered", "client", "tags", "fetch", "memory", "startup"}

// localModes are the modes that need the local set-up.
var localModes = []string{"step", "burst", "ordered", "client", "tags", "fetch", "memory", "startup"}

// Config describes one bench. The program's flags fill it; the flags in
// parentheses are those of `dispenser bench`.
type Config struct {
	// URL names a running deployment to load, starting nothing
	// (--nats-url); empty starts the local set-up in this process.
	URL string
	// NATSOptions are the options of the connections to URL: credentials
	// and TLS.
	NATSOptions []nats.Option
	// ChildArgs are flags that every load child's command line gets
	// besides its own: those that give the child the same NATSOptions.
	ChildArgs []string
	// Prefix is the subject prefix of the deployment (--prefix).
	Prefix string
	// Tag is the segment tag to load (--tag); with URL it must exist.
	Tag string
	// PostgresURL is the segment store of the local service under test
	// (--postgres-url); empty: a JetStream KV bucket.
	PostgresURL string
	// Warmup and Duration are the time per endpoint and run, not measured
	// and measured.
	Warmup, Duration time.Duration
	// Inflight is the number of requests in flight in the pipelined, batch
	// and step runs.
	Inflight int
	// Batch is the number of IDs per request of the batch runs, Formats
	// their Id-Formats ("range", "list").
	Batch   int
	Formats []string
	// Modes are the measurements to make, out of Modes.
	Modes map[string]bool
	// ClientRounds is the number of rounds of the client run, each a raw
	// request, the Go client and the service through it, loaded in turn
	// (--client-rounds).
	ClientRounds int
	// MemoryTags is the number of warm tags of the idle worker whose
	// memory is measured.
	MemoryTags int
	// Tags is the number of new tags of the tags run, which end up warm in
	// its worker (--tags); TagsStore the number of tags in its PostgreSQL
	// store, at least Tags (--tags-store; the KV store holds Tags).
	Tags, TagsStore int
	// TagsSettle, if not zero, makes the tags run wait up to this long for
	// a garbage collection of its idle worker before it measures the
	// worker's memory with warm tags (--tags-settle).
	TagsSettle time.Duration
	// JSON prints the report as JSON instead of tables.
	JSON bool
	// Smoke checks every ID for duplicates across runs and lets requests
	// wait for segments; the caller also shortens the runs.
	Smoke bool
	// CPUProfile, if not empty, is the file of a CPU profile of this
	// process during the runs.
	CPUProfile string
	// SyncAlways makes the embedded nats-server write every JetStream
	// message to disk before acknowledging it, as `dispenser serve`'s does.
	SyncAlways bool
}

// Run runs the bench that c describes, writing the report to stdout and
// progress to stderr. It returns an error wrapping ErrFailed if a run saw
// errors, lost requests or duplicate IDs.
func Run(ctx context.Context, c Config, stdout, stderr io.Writer) (err error) {
	rep := &Report{
		Go: runtime.Version(), OS: runtime.GOOS + "/" + runtime.GOARCH, CPUs: runtime.NumCPU(),
		Local: c.URL == "", Warmup: c.Warmup.String(), Duration: c.Duration.String(),
		Inflight: c.Inflight, Smoke: c.Smoke, StartedAt: time.Now().UTC().Truncate(time.Second),
	}
	p := &progress{w: stderr, tty: isTerminal(stderr)}
	// Errors only: the service under test logs every closed connection as
	// a warning when it stops.
	log := slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelError}))

	url, prefix := c.URL, c.Prefix
	var e *env
	if rep.Local {
		p.note("starting nats-server, baseline responder and service under test")
		// A smoke run checks correctness, on machines as slow as CI with
		// the race detector: requests wait for segments instead of
		// failing with 503 after the default 100ms.
		var maxWait time.Duration
		if c.Smoke {
			maxWait = 5 * time.Second
		}
		e, err = startEnv(ctx, c.Tag, c.PostgresURL, maxWait, c.SyncAlways, log)
		if err != nil {
			return fmt.Errorf("local set-up: %w", err)
		}
		defer func() {
			if cerr := e.Close(); err == nil && cerr != nil {
				err = fmt.Errorf("stopping the local set-up: %w", cerr)
			}
		}()
		url, prefix, rep.Store = e.url, "id", e.store
		rep.Sync = "always"
		if !c.SyncAlways {
			rep.Sync = "interval"
		}
	} else {
		rep.NATSURL = redact.URL(c.URL)
		var skipped []string
		for _, m := range localModes {
			if c.Modes[m] {
				skipped = append(skipped, m)
			}
		}
		if len(skipped) > 0 {
			rep.Notes = append(rep.Notes, strings.Join(skipped, ", ")+": left out, they need the local set-up (no --nats-url)")
		}
	}

	eps, err := endpoints(ctx, c, url, prefix, rep)
	if err != nil {
		return err
	}
	groups := plan(c, eps, prefix)

	if c.CPUProfile != "" {
		f, err := os.Create(c.CPUProfile)
		if err != nil {
			return fmt.Errorf("CPU profile: %w", err)
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return fmt.Errorf("CPU profile: %w", err)
		}
		defer pprof.StopCPUProfile()
	}
	total := len(groups)
	if e != nil && c.Modes["burst"] {
		total++
	}
	if e != nil && c.Modes["ordered"] {
		total += 2
	}
	if e != nil && c.Modes["client"] {
		total += c.ClientRounds
	}
	if e != nil && c.Modes["tags"] {
		total += 2
	}
	done := 0
	run := func(g *group) error {
		done++
		return runGroup(ctx, c, e, g, url, prefix, fmt.Sprintf("[%d/%d] %s", done, total, g.label), p, rep)
	}
	for _, g := range groups {
		if err := run(g); err != nil {
			return err
		}
	}
	if e != nil && c.Modes["burst"] {
		if err := runBurst(ctx, c, e, log, p, run, rep); err != nil {
			return fmt.Errorf("burst: %w", err)
		}
	}
	if e != nil && c.Modes["ordered"] {
		if err := runOrdered(ctx, c, e, log, p, run); err != nil {
			return fmt.Errorf("ordered: %w", err)
		}
	}
	if e != nil && c.Modes["client"] {
		if err := runClient(ctx, c, e, p, run); err != nil {
			return fmt.Errorf("client: %w", err)
		}
	}
	if e != nil && c.Modes["tags"] {
		if err := runTags(ctx, c, e, rep, p, run); err != nil {
			return fmt.Errorf("tags: %w", err)
		}
	}
	if e != nil && c.Modes["fetch"] {
		if c.PostgresURL == "" {
			rep.Notes = append(rep.Notes, "fetch: left out, it times PostgreSQL fetches with and without the witness (needs --postgres-url)")
		} else {
			p.note("fetch: segment fetches from PostgreSQL, alone and through the witness")
			if rep.Fetch, err = e.measureFetch(ctx, c.PostgresURL, 300); err != nil {
				return fmt.Errorf("fetch: %w", err)
			}
		}
	}
	if e != nil && c.Modes["memory"] {
		p.note(fmt.Sprintf("memory: an idle worker with %d warm tags", c.MemoryTags))
		if rep.Memory, err = e.measureMemory(ctx, c.MemoryTags); err != nil {
			return fmt.Errorf("memory: %w", err)
		}
	}
	if e != nil && c.Modes["startup"] {
		p.note("start-up: dispenser serve in zero-setup mode")
		if rep.Startup, err = measureStartup(ctx, filepath.Join(e.dir, "startup")); err != nil {
			return fmt.Errorf("start-up: %w", err)
		}
	}
	p.clear()

	rep.finish()
	if c.JSON {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		if err := enc.Encode(rep); err != nil {
			return fmt.Errorf("writing the report: %w", err)
		}
	} else if err := rep.Print(stdout); err != nil {
		return fmt.Errorf("writing the report: %w", err)
	}
	if rep.Errors > 0 || rep.Lost > 0 || rep.Dups > 0 {
		return fmt.Errorf("%w: %d errors, %d lost requests, %d duplicate IDs", ErrFailed, rep.Errors, rep.Lost, rep.Dups)
	}
	return nil
}

// endpoint is an endpoint to load.
type endpoint struct {
	name    string // baseline, segment, snowflake
	subject string
}

// endpoints returns the endpoints to load: the baseline when local, the
// segment tag, and the snowflake endpoint if it answers.
func endpoints(ctx context.Context, c Config, url, prefix string, rep *Report) ([]endpoint, error) {
	var eps []endpoint
	if rep.Local {
		eps = append(eps, endpoint{"baseline", baselineSubject})
	}
	nc, err := nats.Connect(url, append(slices.Clip(c.NATSOptions), nats.Name("dispenser-bench"))...)
	if err != nil {
		return nil, connectError("", url, err)
	}
	defer nc.Close()
	seg := prefix + ".segment." + c.Tag
	if _, err := requestID(ctx, nc, seg, 5*time.Second); err != nil {
		return nil, fmt.Errorf("segment tag %s: %w (create it with: dispenser tags create %s --step 1000000)", c.Tag, err, c.Tag)
	}
	eps = append(eps, endpoint{"segment", seg})
	sf := prefix + ".snowflake"
	if _, err := requestID(ctx, nc, sf, 2*time.Second); err != nil {
		rep.Notes = append(rep.Notes, fmt.Sprintf("snowflake left out: %s: %v", sf, err))
	} else {
		eps = append(eps, endpoint{"snowflake", sf})
	}
	return eps, nil
}

// loadProfiles counts the load children that wrote a CPU profile (only
// Run's goroutine starts them).
var loadProfiles int

// runGroup runs the load run g, showing it as label, and appends its results
// to rep.
func runGroup(ctx context.Context, c Config, e *env, g *group, url, prefix, label string, p *progress, rep *Report) error {
	lc := LoadConfig{
		URL: url, ChildArgs: c.ChildArgs, Inflight: g.inflight, Batch: g.batch, Format: g.format,
		Warmup: c.Warmup, Duration: c.Duration, Slice: slice, Drain: 2 * time.Second, Verify: c.Smoke,
	}
	if c.CPUProfile != "" {
		// Each load child profiles itself: the Go client's side.
		loadProfiles++
		lc.CPUProfile = fmt.Sprintf("%s.load-%d", c.CPUProfile, loadProfiles)
	}
	for _, r := range g.runs {
		lc.Subjects = append(lc.Subjects, r.Subject)
	}
	p.start(label, g.runs)
	before := e.segmentStats()
	res, err := runLoadChild(ctx, lc, p)
	if err != nil {
		return fmt.Errorf("%s: %w", g.label, err)
	}
	after := e.segmentStats()
	for j, r := range g.runs {
		r.LoadResult = *res[j]
		if tag, ok := strings.CutPrefix(r.Subject, prefix+".segment."); ok && after != nil {
			a, b := after[tag], before[tag]
			fetches, waits := a.Fetches-b.Fetches, a.Waits-b.Waits
			r.Fetches, r.Waits = &fetches, &waits
		}
	}
	p.done()
	rep.Runs = append(rep.Runs, g.runs...)
	return nil
}

// runOrdered runs the ordered run (ordered.go): the owner alone, then three
// workers.
func runOrdered(ctx context.Context, c Config, e *env, log *slog.Logger, p *progress, run func(*group) error) (err error) {
	p.note("ordered: an ordered and a plain tag, one worker")
	if err := e.orderedTags(ctx, c.PostgresURL); err != nil {
		return err
	}
	ws, err := e.startOrdered(ctx, c.PostgresURL, e.maxWait, log, 0, 1)
	if err != nil {
		return err
	}
	defer func() {
		if cerr := ws.Close(); err == nil && cerr != nil {
			err = fmt.Errorf("stopping the ordered workers: %w", cerr)
		}
	}()
	eps := []endpoint{{"baseline", baselineSubject}, {"ordered", orderedPrefix + ".segment." + tagOrdered}, {"plain", orderedPrefix + ".segment." + tagPlain}}
	if err := run(newGroup("ordered_alone", fmt.Sprintf("1 worker (owner alone), %d in flight, 1 ID", c.Inflight), c.Inflight, 1, "list", eps)); err != nil {
		return err
	}
	p.note(fmt.Sprintf("ordered: %d more workers", orderedWorkers-1))
	more, err := e.startOrdered(ctx, c.PostgresURL, e.maxWait, log, 1, orderedWorkers)
	ws = append(ws, more...)
	if err != nil {
		return err
	}
	// The Go client follows the owner's Id-Direct header: straight to the
	// owner. The plain NATS client's run ignores it. What a user compares
	// the Go client with is a raw nc.RequestWithContext to the baseline
	// responder, by as many callers (baseline_raw); the baseline through the
	// Go client (its segment subjects under a prefix of their own) is
	// reported beside it, to tell the client's own cost from the service's.
	if err := startBaseline(e.baseNC, clientBaselinePrefix+".segment.*"); err != nil {
		return err
	}
	eps = append(eps,
		endpoint{"baseline_raw", rawPrefix + clientBaselinePrefix + ".segment.base"},
		endpoint{"baseline_client", clientPrefix + clientBaselinePrefix + ".segment.base"},
		endpoint{"ordered_client", clientPrefix + orderedPrefix + ".segment." + tagOrdered})
	return run(newGroup("ordered", fmt.Sprintf("%d workers, %d in flight, 1 ID", orderedWorkers, c.Inflight), c.Inflight, 1, "list", eps))
}

// runTags runs the tags run (tags.go): the measurements of measureTags,
// then the load runs of the refreshing worker, at 1 and at c.Inflight in
// flight, while tags change in the store.
func runTags(ctx context.Context, c Config, e *env, rep *Report, p *progress, run func(*group) error) (err error) {
	r, workers, err := e.measureTags(ctx, c.PostgresURL, c.Tags, c.TagsStore, c.TagsSettle, p)
	if err != nil {
		return err
	}
	defer func() {
		for _, w := range workers {
			w.stop()
		}
	}()
	rep.Tags = r
	st, closeStore, err := e.tagsStore(ctx, c.PostgresURL, r.StoreTags)
	if err != nil {
		return err
	}
	defer closeStore()
	cctx, stop := context.WithCancel(ctx)
	type churned struct {
		n   int
		err error
	}
	ch := make(chan churned, 1)
	go func() {
		n, err := churn(cctx, st, r.StoreTags)
		ch <- churned{n, err}
	}()
	eps := []endpoint{{"baseline", baselineSubject}, {"refreshing", tagsPrefix + ".segment." + tagName(0)},
		{"not refreshing", tagsCtlPrefix + ".segment." + tagName(0)}}
	for _, inflight := range []int{1, c.Inflight} {
		g := newGroup("tags_refresh", fmt.Sprintf("refresh every %v, %d in flight", tagsRefresh, inflight), inflight, 1, "list", eps)
		if err = run(g); err != nil {
			break
		}
	}
	stop()
	res := <-ch
	if err != nil {
		return err
	}
	if res.err != nil {
		return fmt.Errorf("changing tags during the load: %w", res.err)
	}
	r.Churned = res.n
	for _, w := range workers {
		if w.gone() {
			return fmt.Errorf("a tags worker exited: %s", strings.TrimSpace(w.stderr.String()))
		}
	}
	return nil
}

// slice is how long the load generator loads one endpoint before it turns
// to the next of its run.
const slice = 250 * time.Millisecond

// group is a load run of one mode: its endpoints are loaded in turn by one
// load generator.
type group struct {
	label           string
	inflight, batch int
	format          string
	runs            []*Result // one per endpoint
}

// plan lists the load runs of c's modes.
func plan(c Config, eps []endpoint, prefix string) []*group {
	var groups []*group
	add := func(mode, label string, inflight, batch int, format string, eps []endpoint) {
		groups = append(groups, newGroup(mode, label, inflight, batch, format, eps))
	}
	if c.Modes["pipelined"] {
		add("pipelined", fmt.Sprintf("%d in flight, 1 ID", c.Inflight), c.Inflight, 1, "list", eps)
	}
	if c.Modes["sequential"] {
		add("sequential", "1 in flight, 1 ID", 1, 1, "list", eps)
	}
	if c.Modes["batch"] {
		for _, f := range c.Formats {
			add("batch_"+f, fmt.Sprintf("%d in flight, %d IDs, %s", c.Inflight, c.Batch, f), c.Inflight, c.Batch, f, eps)
		}
	}
	if c.Modes["step"] && c.URL == "" {
		steps := []endpoint{{"step 100", prefix + ".segment." + tagStep100}, {"step 1,000,000", prefix + ".segment." + tagStep1M}}
		for _, inflight := range []int{1, c.Inflight} {
			add("step", fmt.Sprintf("segment switches, %d in flight", inflight), inflight, 1, "list", steps)
		}
	}
	return groups
}

// newGroup returns a load run of mode that loads eps in turn.
func newGroup(mode, label string, inflight, batch int, format string, eps []endpoint) *group {
	g := &group{label: label, inflight: inflight, batch: batch, format: format}
	for _, ep := range eps {
		g.runs = append(g.runs, &Result{Mode: mode, Endpoint: ep.name, Label: label, space: ep.subject,
			LoadResult: LoadResult{Subject: ep.subject, Inflight: inflight, Batch: batch, Format: format}})
	}
	return g
}

// runLoadChild runs one load run in a child process, showing its progress,
// and returns a result per subject.
func runLoadChild(ctx context.Context, lc LoadConfig, p *progress) ([]*LoadResult, error) {
	cmd, err := childCommand(ctx, lc.args()...)
	if err != nil {
		return nil, err
	}
	var out bytes.Buffer
	cmd.Stdout = &out
	errPipe, err := cmd.StderrPipe()
	if err != nil {
		return nil, fmt.Errorf("load generator: %w", err)
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("starting the load generator: %w", err)
	}
	var other tailBuffer // stderr lines that are not progress
	sc := bufio.NewScanner(errPipe)
	for sc.Scan() {
		line := sc.Text()
		if !p.update(line) {
			fmt.Fprintln(&other, line)
		}
	}
	if err := cmd.Wait(); err != nil {
		return nil, fmt.Errorf("load generator: %w: %s", err, strings.TrimSpace(other.String()))
	}
	var rs []*LoadResult
	if err := json.Unmarshal(out.Bytes(), &rs); err != nil {
		return nil, fmt.Errorf("load generator's result %q: %w", truncateBytes(out.Bytes()), err)
	}
	if len(rs) != len(lc.Subjects) {
		return nil, fmt.Errorf("load generator returned %d results for %d subjects", len(rs), len(lc.Subjects))
	}
	for i, r := range rs {
		if r.Subject != lc.Subjects[i] {
			return nil, fmt.Errorf("load generator's result %d is for %s, want %s", i, r.Subject, lc.Subjects[i])
		}
	}
	return rs, nil
}
