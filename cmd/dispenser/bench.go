package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/nats-io/nats.go"

	"github.com/dispenser-dev/dispenser/segment"
)

// `dispenser bench` measures, in one run with one load generator, a
// baseline responder, the segment endpoint and the snowflake endpoint, and
// prints requests/s, IDs/s, latency percentiles and each endpoint's ratio to
// the baseline. Every run's load comes from a child process
// (bench_load.go); the service runs in this process (bench_local.go) or is
// a deployment named by --nats-url.

// errBenchFailed means a run saw error replies, lost requests or
// duplicate IDs.
var errBenchFailed = errors.New("bench failed")

// benchConfig holds the flags of `dispenser bench`.
type benchConfig struct {
	URL         string
	Auth        serveConfig // NATS credential and TLS fields
	Prefix      string
	Tag         string
	PostgresURL string
	Warmup      time.Duration
	Duration    time.Duration
	Inflight    int
	Batch       int
	Formats     []string
	Modes       map[string]bool
	MemoryTags  int
	JSON        bool
	Smoke       bool
	CPUProfile  string
	SyncAlways  bool
}

// benchModes are the runs --modes selects from, in order.
var benchModes = []string{"pipelined", "sequential", "batch", "step", "fetch", "memory", "startup"}

// benchRun is one load run of the report.
type benchRun struct {
	Mode     string `json:"mode"`     // pipelined, sequential, batch_range, batch_list, step
	Endpoint string `json:"endpoint"` // baseline, segment, snowflake
	Label    string `json:"label"`
	space    string // ID space, for duplicates across runs
	loadResult
	// VsBaseline is the requests/s over the baseline's in the same mode.
	VsBaseline float64 `json:"vs_baseline,omitempty"`
	// For a segment tag of the local service: the store fetches during the
	// run and the requests that found both buffers empty and waited.
	Fetches *int64 `json:"fetches,omitempty"`
	Waits   *int64 `json:"waits,omitempty"`
}

// stepResult compares the p999 of a tag fetching every 100 IDs with one
// fetching every 1,000,000.
type stepResult struct {
	Inflight      int     `json:"inflight"`
	P999Step100US float64 `json:"p999_step100_us"`
	P999Step1MUS  float64 `json:"p999_step1m_us"`
	Ratio         float64 `json:"ratio"`
}

// benchTarget is one target of the issue, checked against the runs.
type benchTarget struct {
	Name string `json:"name"`
	Want string `json:"want"`
	Got  string `json:"got"`
	OK   bool   `json:"ok"`
}

// benchReport is the whole result; --json prints it.
type benchReport struct {
	Go      string `json:"go"`
	OS      string `json:"os"`
	CPUs    int    `json:"cpus"`
	NATSURL string `json:"nats_url,omitempty"` // only for --nats-url
	Local   bool   `json:"local"`
	Store   string `json:"store,omitempty"`
	// Sync is the embedded nats-server's JetStream sync: "always" or
	// "interval" (local runs only).
	Sync      string         `json:"jetstream_sync,omitempty"`
	Warmup    string         `json:"warmup"`
	Duration  string         `json:"duration"`
	Inflight  int            `json:"inflight"`
	Runs      []*benchRun    `json:"runs"`
	Step      []stepResult   `json:"step,omitempty"`
	Fetch     *fetchResult   `json:"fetch,omitempty"`
	Memory    *memoryResult  `json:"memory,omitempty"`
	Startup   *startupResult `json:"startup,omitempty"`
	Targets   []benchTarget  `json:"targets,omitempty"`
	Notes     []string       `json:"notes,omitempty"`
	Errors    uint64         `json:"errors"`
	Lost      uint64         `json:"lost"`
	Dups      uint64         `json:"duplicates"`
	Checked   uint64         `json:"checked_ids"`
	Smoke     bool           `json:"smoke"`
	StartedAt time.Time      `json:"started_at"`
}

func bench(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("bench", "dispenser bench [flags]", stderr)
	var c benchConfig
	var formats, modes string
	fs.StringVar(&c.URL, "nats-url", "", "NATS server URL(s) of a running deployment to load, starting nothing; empty starts an embedded nats-server, a baseline responder and the service under test in this process")
	benchAuthFlags(fs, &c.Auth)
	fs.StringVar(&c.Prefix, "prefix", "id", "subject prefix of the service (with --nats-url)")
	fs.StringVar(&c.Tag, "tag", "bench", "segment tag to load; with --nats-url it must exist")
	fs.StringVar(&c.PostgresURL, "postgres-url", "", "PostgreSQL segment store of the service under test; empty: a JetStream key-value bucket in the embedded nats-server. bench creates or updates the tags TAG, bench_step100 and bench_step1m")
	fs.DurationVar(&c.Warmup, "warmup", 500*time.Millisecond, "warm-up per endpoint and run, not measured")
	fs.DurationVar(&c.Duration, "duration", 3*time.Second, "measured time per endpoint and run; the endpoints of a run are loaded in turn, 250ms each")
	fs.IntVar(&c.Inflight, "inflight", 256, "requests in flight in the pipelined, batch and step runs")
	fs.IntVar(&c.Batch, "batch", 1000, "IDs per request in the batch runs")
	fs.StringVar(&formats, "format", "range,list", "Id-Format of the batch runs: range, list or both, comma-separated")
	fs.StringVar(&modes, "modes", strings.Join(benchModes, ","), "what to measure, comma-separated: "+strings.Join(benchModes, ", "))
	fs.IntVar(&c.MemoryTags, "memory-tags", 1000, "warm tags of the idle worker whose memory is measured")
	fs.BoolVar(&c.JSON, "json", false, "print the report as JSON")
	fs.BoolVar(&c.Smoke, "smoke", false, "a few seconds of every run, checking every ID; fails on errors or duplicates, never on speed")
	fs.BoolVar(&c.SyncAlways, "sync-always", true, "the embedded nats-server writes every JetStream message to disk before acknowledging it, as dispenser serve's does; false measures JetStream's default periodic sync for comparison")
	fs.StringVar(&c.CPUProfile, "cpuprofile", "", "write a CPU profile of this process (service, nats-server, baseline) during the runs to this file")
	pos, err := parse(fs, args)
	if err != nil {
		return err
	}
	if len(pos) > 0 {
		return fmt.Errorf("bench: unexpected argument %q", pos[0])
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	if c.Smoke {
		if !set["warmup"] {
			c.Warmup = 100 * time.Millisecond
		}
		if !set["duration"] {
			c.Duration = 300 * time.Millisecond
		}
		if !set["memory-tags"] {
			c.MemoryTags = 50
		}
	}
	c.Modes = map[string]bool{}
	for m := range strings.SplitSeq(modes, ",") {
		if m = strings.TrimSpace(m); !slices.Contains(benchModes, m) {
			return fmt.Errorf("bench: --modes: unknown mode %q: want %s", m, strings.Join(benchModes, ", "))
		}
		c.Modes[m] = true
	}
	for f := range strings.SplitSeq(formats, ",") {
		if f = strings.TrimSpace(f); f != "range" && f != "list" {
			return fmt.Errorf("bench: --format %q: want range, list or both", f)
		}
		if !slices.Contains(c.Formats, f) {
			c.Formats = append(c.Formats, f)
		}
	}
	switch {
	case c.Inflight < 1 || c.Inflight > 100_000:
		return fmt.Errorf("bench: --inflight %d: want 1..100000", c.Inflight)
	case c.Batch < 1 || c.Batch > 10_000:
		return fmt.Errorf("bench: --batch %d: want 1..10000 (the service's default --max-batch)", c.Batch)
	case c.Warmup < 0 || c.Duration <= 0:
		return fmt.Errorf("bench: --warmup %v, --duration %v: want a positive duration", c.Warmup, c.Duration)
	case c.MemoryTags < 1 || c.MemoryTags > 10_000:
		return fmt.Errorf("bench: --memory-tags %d: want 1..10000", c.MemoryTags)
	}
	if !segment.ValidTag(c.Tag) {
		return fmt.Errorf("bench: --tag %q: want 1-128 characters of [A-Za-z0-9_-]", c.Tag)
	}
	if c.URL != "" && c.PostgresURL != "" {
		return errors.New("bench: --postgres-url configures the local service; it does nothing with --nats-url")
	}
	return runBench(ctx, c, stdout, stderr)
}

func runBench(ctx context.Context, c benchConfig, stdout, stderr io.Writer) (err error) {
	rep := &benchReport{
		Go: runtime.Version(), OS: runtime.GOOS + "/" + runtime.GOARCH, CPUs: runtime.NumCPU(),
		Local: c.URL == "", Warmup: c.Warmup.String(), Duration: c.Duration.String(),
		Inflight: c.Inflight, Smoke: c.Smoke, StartedAt: time.Now().UTC().Truncate(time.Second),
	}
	p := &progress{w: stderr, tty: isTerminal(stderr)}
	// Errors only: the service under test logs every closed connection as
	// a warning when it stops.
	log := slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelError}))

	url, prefix := c.URL, c.Prefix
	var env *benchEnv
	if rep.Local {
		p.note("starting nats-server, baseline responder and service under test")
		// A smoke run checks correctness, on machines as slow as CI with
		// the race detector: requests wait for segments instead of
		// failing with 503 after the default 100ms.
		var maxWait time.Duration
		if c.Smoke {
			maxWait = 5 * time.Second
		}
		env, err = startBenchEnv(ctx, c.Tag, c.PostgresURL, maxWait, c.SyncAlways, log)
		if err != nil {
			return err
		}
		defer func() {
			if cerr := env.Close(); err == nil && cerr != nil {
				err = cerr
			}
		}()
		url, prefix, rep.Store = env.url, "id", env.store
		rep.Sync = "always"
		if !c.SyncAlways {
			rep.Sync = "interval"
		}
	} else {
		rep.NATSURL = c.URL
		var skipped []string
		for _, m := range []string{"step", "fetch", "memory", "startup"} {
			if c.Modes[m] {
				skipped = append(skipped, m)
			}
		}
		if len(skipped) > 0 {
			rep.Notes = append(rep.Notes, strings.Join(skipped, ", ")+": left out, they need the local set-up (no --nats-url)")
		}
	}

	endpoints, err := benchEndpoints(ctx, c, url, prefix, rep)
	if err != nil {
		return err
	}
	groups := benchPlan(c, endpoints, prefix)

	if c.CPUProfile != "" {
		f, err := os.Create(c.CPUProfile)
		if err != nil {
			return err
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return err
		}
		defer pprof.StopCPUProfile()
	}
	for i, g := range groups {
		lc := loadConfig{
			URL: url, Auth: c.Auth, Inflight: g.inflight, Batch: g.batch, Format: g.format,
			Warmup: c.Warmup, Duration: c.Duration, Slice: benchSlice, Drain: 2 * time.Second, Verify: c.Smoke,
		}
		for _, r := range g.runs {
			lc.Subjects = append(lc.Subjects, r.Subject)
		}
		p.start(fmt.Sprintf("[%d/%d] %s", i+1, len(groups), g.label), g.runs)
		before := env.segmentStats()
		res, err := runLoadChild(ctx, lc, p)
		if err != nil {
			return fmt.Errorf("%s: %w", g.label, err)
		}
		after := env.segmentStats()
		for j, r := range g.runs {
			r.loadResult = *res[j]
			if tag, ok := strings.CutPrefix(r.Subject, prefix+".segment."); ok && after != nil {
				a, b := after[tag], before[tag]
				fetches, waits := a.Fetches-b.Fetches, a.Waits-b.Waits
				r.Fetches, r.Waits = &fetches, &waits
			}
		}
		p.done()
		rep.Runs = append(rep.Runs, g.runs...)
	}
	if env != nil && c.Modes["fetch"] {
		if c.PostgresURL == "" {
			rep.Notes = append(rep.Notes, "fetch: left out, it times PostgreSQL fetches with and without the witness (needs --postgres-url)")
		} else {
			p.note("fetch: segment fetches from PostgreSQL, alone and through the witness")
			if rep.Fetch, err = env.measureFetch(ctx, c.PostgresURL, 300); err != nil {
				return fmt.Errorf("fetch: %w", err)
			}
		}
	}
	if env != nil && c.Modes["memory"] {
		p.note(fmt.Sprintf("memory: an idle worker with %d warm tags", c.MemoryTags))
		if rep.Memory, err = env.measureMemory(ctx, c.MemoryTags); err != nil {
			return fmt.Errorf("memory: %w", err)
		}
	}
	if env != nil && c.Modes["startup"] {
		p.note("start-up: dispenser serve in zero-setup mode")
		if rep.Startup, err = measureStartup(ctx, filepath.Join(env.dir, "startup")); err != nil {
			return fmt.Errorf("start-up: %w", err)
		}
	}
	p.clear()

	rep.finish()
	if c.JSON {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		if err := enc.Encode(rep); err != nil {
			return err
		}
	} else {
		rep.print(stdout)
	}
	if rep.Errors > 0 || rep.Lost > 0 || rep.Dups > 0 {
		return fmt.Errorf("%w: %d errors, %d lost requests, %d duplicate IDs", errBenchFailed, rep.Errors, rep.Lost, rep.Dups)
	}
	return nil
}

// benchEndpoint is an endpoint to load.
type benchEndpoint struct {
	name    string // baseline, segment, snowflake
	subject string
}

// benchEndpoints returns the endpoints to load: the baseline when local,
// the segment tag, and the snowflake endpoint if it answers.
func benchEndpoints(ctx context.Context, c benchConfig, url, prefix string, rep *benchReport) ([]benchEndpoint, error) {
	var eps []benchEndpoint
	if rep.Local {
		eps = append(eps, benchEndpoint{"baseline", benchBaselineSubject})
	}
	opts, err := c.Auth.natsOptions()
	if err != nil {
		return nil, err
	}
	nc, err := nats.Connect(url, append(opts, nats.Name("dispenser-bench"))...)
	if err != nil {
		return nil, fmt.Errorf("connecting to %s: %w", url, err)
	}
	defer nc.Close()
	seg := prefix + ".segment." + c.Tag
	if _, err := requestID(ctx, nc, seg, 5*time.Second); err != nil {
		return nil, fmt.Errorf("segment tag %s: %w (create it with: dispenser tags create %s --step 1000000)", c.Tag, err, c.Tag)
	}
	eps = append(eps, benchEndpoint{"segment", seg})
	sf := prefix + ".snowflake"
	if _, err := requestID(ctx, nc, sf, 2*time.Second); err != nil {
		rep.Notes = append(rep.Notes, fmt.Sprintf("snowflake left out: %s: %v", sf, err))
	} else {
		eps = append(eps, benchEndpoint{"snowflake", sf})
	}
	return eps, nil
}

// benchSlice is how long the load generator loads one endpoint before it
// turns to the next of its run.
const benchSlice = 250 * time.Millisecond

// benchGroup is a load run of one mode: its endpoints are loaded in turn by
// one load generator.
type benchGroup struct {
	label           string
	inflight, batch int
	format          string
	runs            []*benchRun // one per endpoint
}

// benchPlan lists the runs of c's modes.
func benchPlan(c benchConfig, eps []benchEndpoint, prefix string) []*benchGroup {
	var groups []*benchGroup
	add := func(mode, label string, inflight, batch int, format string, eps []benchEndpoint) {
		g := &benchGroup{label: label, inflight: inflight, batch: batch, format: format}
		for _, ep := range eps {
			g.runs = append(g.runs, &benchRun{Mode: mode, Endpoint: ep.name, Label: label, space: ep.subject,
				loadResult: loadResult{Subject: ep.subject, Inflight: inflight, Batch: batch, Format: format}})
		}
		groups = append(groups, g)
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
		steps := []benchEndpoint{{"step 100", prefix + ".segment." + benchStep100}, {"step 1,000,000", prefix + ".segment." + benchStep1M}}
		for _, inflight := range []int{1, c.Inflight} {
			add("step", fmt.Sprintf("segment switches, %d in flight", inflight), inflight, 1, "list", steps)
		}
	}
	return groups
}

// runLoadChild runs one load run in a child process, showing its progress,
// and returns a result per subject.
func runLoadChild(ctx context.Context, lc loadConfig, p *progress) ([]*loadResult, error) {
	cmd, err := childCommand(ctx, lc.args()...)
	if err != nil {
		return nil, err
	}
	var out bytes.Buffer
	cmd.Stdout = &out
	errPipe, err := cmd.StderrPipe()
	if err != nil {
		return nil, err
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
	var rs []*loadResult
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

// progress shows what runs: on a terminal one line, rewritten as the load
// generator reports; elsewhere one line per finished endpoint.
type progress struct {
	w     io.Writer
	tty   bool
	label string
	runs  []*benchRun
	width int
}

func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}

func (p *progress) show(s string) {
	if !p.tty {
		return
	}
	pad := max(p.width-len(s), 0)
	p.width = len(s)
	fmt.Fprintf(p.w, "\r%s%s", s, strings.Repeat(" ", pad))
}

func (p *progress) clear() {
	if p.tty && p.width > 0 {
		fmt.Fprintf(p.w, "\r%s\r", strings.Repeat(" ", p.width))
		p.width = 0
	}
}

// note shows a step that is not a load run.
func (p *progress) note(s string) {
	if p.tty {
		p.show(s + " ...")
		return
	}
	fmt.Fprintln(p.w, s)
}

// start begins a load run of runs.
func (p *progress) start(label string, runs []*benchRun) {
	p.label, p.runs = label, runs
	p.show(label + " ...")
}

// update shows a progress line of a load child and reports whether line
// was one.
func (p *progress) update(line string) bool {
	rest, ok := strings.CutPrefix(line, progressPrefix)
	if !ok {
		return false
	}
	f := strings.Fields(rest)
	if len(f) != 6 {
		return false
	}
	var v [5]int64
	for i, s := range append(f[:1:1], f[2:]...) {
		n, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			return false
		}
		v[i] = n
	}
	idx, at, total, errs := v[0], time.Duration(v[1]), time.Duration(v[2]), v[4]
	if idx < 0 || int(idx) >= len(p.runs) {
		return false
	}
	phase := "warm-up "
	if f[1] == "measure" {
		phase = ""
	}
	p.show(fmt.Sprintf("%s  %s: %s%.1f/%.1fs, %d errors", p.label, p.runs[idx].Endpoint, phase, at.Seconds(), total.Seconds(), errs))
	return true
}

// done shows the results of the finished load run.
func (p *progress) done() {
	for _, r := range p.runs {
		s := fmt.Sprintf("%s  %-14s %s req/s  p50 %s  p999 %s", p.label, r.Endpoint, fmtCount(r.RPS), fmtLatency(r.Latency.P50), fmtLatency(r.Latency.P999))
		if r.Errors+r.Lost+r.Duplicates > 0 {
			s += fmt.Sprintf("  %d errors, %d lost, %d duplicates (%s)", r.Errors, r.Lost, r.Duplicates, r.FirstError)
		}
		if p.tty {
			p.show(s)
			fmt.Fprintln(p.w)
			p.width = 0
			continue
		}
		fmt.Fprintln(p.w, s)
	}
}

// finish computes the ratios, the step comparison, the duplicates across
// runs, the totals and the targets.
func (rep *benchReport) finish() {
	base := map[string]*benchRun{}
	for _, r := range rep.Runs {
		if r.Endpoint == "baseline" {
			base[r.Mode] = r
		}
	}
	for _, r := range rep.Runs {
		if b := base[r.Mode]; b != nil && b.RPS > 0 {
			r.VsBaseline = round(r.RPS/b.RPS, 3)
		}
		rep.Errors += r.Errors
		rep.Lost += r.Lost
		rep.Dups += r.Duplicates
		rep.Checked += r.Checked
	}
	// Duplicates across runs of one ID space.
	spaces := map[string][]segmentRun{}
	for _, r := range rep.Runs {
		for _, x := range r.Runs {
			spaces[r.space] = append(spaces[r.space], segmentRun{x[0], x[1]})
		}
		r.Runs = nil
	}
	for _, runs := range spaces {
		_, dups := mergeRuns(runs) // each run's runs are disjoint already
		rep.Dups += dups
	}

	find := func(mode, endpoint string) *benchRun {
		for _, r := range rep.Runs {
			if r.Mode == mode && r.Endpoint == endpoint {
				return r
			}
		}
		return nil
	}
	for _, r := range rep.Runs {
		if r.Mode != "step" || !strings.HasSuffix(r.Subject, "."+benchStep100) {
			continue
		}
		for _, o := range rep.Runs {
			if o.Mode == "step" && o.Inflight == r.Inflight && strings.HasSuffix(o.Subject, "."+benchStep1M) && o.Latency.P999 > 0 {
				rep.Step = append(rep.Step, stepResult{Inflight: r.Inflight, P999Step100US: r.Latency.P999, P999Step1MUS: o.Latency.P999,
					Ratio: round(r.Latency.P999/o.Latency.P999, 3)})
			}
		}
	}

	add := func(name, want, got string, ok bool) {
		rep.Targets = append(rep.Targets, benchTarget{name, want, got, ok})
	}
	for _, ep := range []string{"segment", "snowflake"} {
		if r := find("pipelined", ep); r != nil && r.VsBaseline > 0 {
			add(ep+", "+r.Label+": requests/s", "≥ 0.9× baseline", fmt.Sprintf("%.3f×", r.VsBaseline), r.VsBaseline >= 0.9)
		}
	}
	b := base["sequential"]
	for _, ep := range []string{"segment", "snowflake"} {
		r := find("sequential", ep)
		if r == nil {
			continue
		}
		if b != nil {
			d := r.Latency.P50 - b.Latency.P50
			add(ep+", 1 in flight: p50", "≤ baseline + 20µs", fmt.Sprintf("%+.1fµs", d), d <= 20)
		}
		add(ep+", 1 in flight: p999", "< 1ms", fmtLatency(r.Latency.P999), r.Latency.P999 < 1000)
	}
	for _, st := range rep.Step {
		add(fmt.Sprintf("step 100 vs 1,000,000, %d in flight: p999 ratio", st.Inflight), "≤ 1.5", fmt.Sprintf("%.2f", st.Ratio), st.Ratio <= 1.5)
	}
	if r := find("batch_range", "segment"); r != nil && r.VsBaseline > 0 {
		add("segment, "+r.Label+": requests/s", "≥ 0.8× baseline", fmt.Sprintf("%.3f×", r.VsBaseline), r.VsBaseline >= 0.8)
	}
	if r := find("batch_list", "segment"); r != nil {
		add("segment, "+r.Label+": IDs/s", "≥ 20,000,000", fmtCount(r.IDsPerSec), r.IDsPerSec >= 20e6)
	}
	if m := rep.Memory; m != nil {
		add(fmt.Sprintf("idle worker, %d warm tags: RSS", m.Tags), "< 64 MB", fmtMB(m.RSSBytes), m.RSSBytes < 64<<20)
	}
	if s := rep.Startup; s != nil {
		add("zero-setup start-up to serving", "< 1s", fmt.Sprintf("%.0fms", s.ServingMS), s.ServingMS < 1000)
	}
}

// print writes the report as tables.
func (rep *benchReport) print(w io.Writer) {
	where := "local: embedded nats-server (JetStream sync " + rep.Sync + "), baseline responder and service in one process, store " + rep.Store
	if !rep.Local {
		where = "deployment " + rep.NATSURL
	}
	fmt.Fprintf(w, "dispenser bench: %s %s, %d CPUs; %s; load from a child process; warm-up %s, %s per endpoint and run\n\n",
		rep.Go, rep.OS, rep.CPUs, where, rep.Warmup, rep.Duration)
	rows := [][]string{{"run", "endpoint", "req/s", "IDs/s", "p50", "p99", "p999", "max", "vs base"}}
	prev := ""
	for _, r := range rep.Runs {
		label := r.Label
		if label == prev {
			label = ""
		}
		prev = r.Label
		ratio := "-"
		if r.VsBaseline > 0 {
			ratio = fmt.Sprintf("%.2f×", r.VsBaseline)
		}
		rows = append(rows, []string{label, r.Endpoint, fmtCount(r.RPS), fmtCount(r.IDsPerSec),
			fmtLatency(r.Latency.P50), fmtLatency(r.Latency.P99), fmtLatency(r.Latency.P999), fmtLatency(r.Latency.Max), ratio})
	}
	if len(rep.Runs) > 0 {
		writeTable(w, rows, 2)
	}

	var lines []string
	for _, r := range rep.Runs {
		if r.Fetches != nil && *r.Fetches > 0 {
			lines = append(lines, fmt.Sprintf("%s, %s: %d store fetches, %d requests found both buffers empty and waited", r.Label, r.Endpoint, *r.Fetches, *r.Waits))
		}
	}
	for _, s := range rep.Step {
		lines = append(lines, fmt.Sprintf("segment switches, %d in flight: p999 with step 100 %s, with step 1,000,000 %s: ratio %.2f",
			s.Inflight, fmtLatency(s.P999Step100US), fmtLatency(s.P999Step1MUS), s.Ratio))
	}
	if f := rep.Fetch; f != nil {
		lines = append(lines, fmt.Sprintf("segment fetch latency (%d each, alternating): PostgreSQL alone p50 %s p99 %s; through the witness p50 %s p99 %s",
			f.Fetches, fmtLatency(f.PlainP50US), fmtLatency(f.PlainP99US), fmtLatency(f.WitnessP50US), fmtLatency(f.WitnessP99US)))
	}
	if m := rep.Memory; m != nil {
		lines = append(lines, fmt.Sprintf("idle worker (dispenser serve, %s store) with %d warm tags: RSS %s", m.Store, m.Tags, fmtMB(m.RSSBytes)))
	}
	if s := rep.Startup; s != nil {
		lines = append(lines, fmt.Sprintf("zero-setup start-up (new data directory): serving after %.0fms, first segment ID after %.0fms, first snowflake ID after %.0fms; RSS with the embedded nats-server %s",
			s.ServingMS, s.SegmentIDMS, s.SnowflakeIDMS, fmtMB(s.RSSBytes)))
	}
	for _, n := range rep.Notes {
		lines = append(lines, "note: "+n)
	}
	if len(lines) > 0 {
		fmt.Fprintf(w, "\n%s\n", strings.Join(lines, "\n"))
	}
	if len(rep.Targets) > 0 {
		rows := [][]string{{"", "target", "want", "got"}}
		for _, t := range rep.Targets {
			mark := "ok"
			if !t.OK {
				mark = "MISS"
			}
			rows = append(rows, []string{mark, t.Name, t.Want, t.Got})
		}
		fmt.Fprintln(w)
		writeTable(w, rows, 4)
	}
	fmt.Fprintf(w, "\nerrors %d, lost %d, duplicates %d", rep.Errors, rep.Lost, rep.Dups)
	if rep.Checked > 0 {
		fmt.Fprintf(w, " (%s IDs checked)", fmtCount(float64(rep.Checked)))
	}
	fmt.Fprintln(w)
}

// writeTable writes rows in columns padded by characters, not bytes; the
// first left columns are aligned left, the others right.
func writeTable(w io.Writer, rows [][]string, left int) {
	var width []int
	for _, row := range rows {
		for i, c := range row {
			if i == len(width) {
				width = append(width, 0)
			}
			width[i] = max(width[i], utf8.RuneCountInString(c))
		}
	}
	for _, row := range rows {
		var b strings.Builder
		for i, c := range row {
			pad := strings.Repeat(" ", width[i]-utf8.RuneCountInString(c))
			if i > 0 {
				b.WriteString("  ")
			}
			if i < left {
				b.WriteString(c + pad)
			} else {
				b.WriteString(pad + c)
			}
		}
		fmt.Fprintln(w, strings.TrimRight(b.String(), " "))
	}
}

// fmtCount formats a count with thousands separators.
func fmtCount(v float64) string {
	s := strconv.FormatInt(int64(v+0.5), 10)
	var b strings.Builder
	for i, c := range s {
		if i > 0 && (len(s)-i)%3 == 0 {
			b.WriteByte(',')
		}
		b.WriteRune(c)
	}
	return b.String()
}

// fmtLatency formats µs.
func fmtLatency(us float64) string {
	switch {
	case us < 10:
		return fmt.Sprintf("%.1fµs", us)
	case us < 1000:
		return fmt.Sprintf("%.0fµs", us)
	case us < 10_000:
		return fmt.Sprintf("%.2fms", us/1000)
	}
	return fmt.Sprintf("%.1fms", us/1000)
}

func fmtMB(b int64) string { return fmt.Sprintf("%.1f MB", float64(b)/(1<<20)) }

func round(v float64, digits int) float64 {
	p := 1.0
	for range digits {
		p *= 10
	}
	return float64(int64(v*p+0.5)) / p
}
