package bench

import (
	"bytes"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
)

// Result is one endpoint's load run of the report.
type Result struct {
	Mode     string `json:"mode"`     // pipelined, sequential, batch_range, batch_list, step
	Endpoint string `json:"endpoint"` // baseline, segment, snowflake
	Label    string `json:"label"`
	space    string // ID space, for duplicates across runs
	LoadResult
	// VsBaseline is the requests/s over the baseline's in the same mode.
	VsBaseline float64 `json:"vs_baseline,omitempty"`
	// For a segment tag of the local service: the store fetches during the
	// run and the requests that found both buffers empty and waited.
	Fetches *int64 `json:"fetches,omitempty"`
	Waits   *int64 `json:"waits,omitempty"`
}

// StepResult compares the p999 of a tag fetching every 100 IDs with one
// fetching every 1,000,000.
type StepResult struct {
	Inflight      int     `json:"inflight"`
	P999Step100US float64 `json:"p999_step100_us"`
	P999Step1MUS  float64 `json:"p999_step1m_us"`
	Ratio         float64 `json:"ratio"`
}

// Target is one performance target, checked against the runs.
type Target struct {
	Name string `json:"name"`
	Want string `json:"want"`
	Got  string `json:"got"`
	OK   bool   `json:"ok"`
}

// Report is the whole result; Config.JSON prints it as JSON.
type Report struct {
	Go      string `json:"go"`
	OS      string `json:"os"`
	CPUs    int    `json:"cpus"`
	NATSURL string `json:"nats_url,omitempty"` // only for Config.URL
	Local   bool   `json:"local"`
	Store   string `json:"store,omitempty"`
	// Sync is the embedded nats-server's JetStream sync: "always" or
	// "interval" (local runs only).
	Sync      string         `json:"jetstream_sync,omitempty"`
	Warmup    string         `json:"warmup"`
	Duration  string         `json:"duration"`
	Inflight  int            `json:"inflight"`
	Runs      []*Result      `json:"runs"`
	Step      []StepResult   `json:"step,omitempty"`
	Burst     *BurstResult   `json:"burst,omitempty"`
	Ordered   *OrderedResult `json:"ordered,omitempty"`
	Client    *ClientResult  `json:"client,omitempty"`
	Tags      *TagsResult    `json:"tags,omitempty"`
	Fetch     *FetchResult   `json:"fetch,omitempty"`
	Memory    *MemoryResult  `json:"memory,omitempty"`
	Startup   *StartupResult `json:"startup,omitempty"`
	Targets   []Target       `json:"targets,omitempty"`
	Notes     []string       `json:"notes,omitempty"`
	Errors    uint64         `json:"errors"`
	Lost      uint64         `json:"lost"`
	Dups      uint64         `json:"duplicates"`
	Checked   uint64         `json:"checked_ids"`
	Smoke     bool           `json:"smoke"`
	StartedAt time.Time      `json:"started_at"`
}

// finish computes the ratios, the step comparison, the duplicates across
// runs, the totals and the targets.
func (rep *Report) finish() {
	// The baseline of a run is the one loaded in turn with it: the same
	// label.
	base := map[string]*Result{}
	for _, r := range rep.Runs {
		if r.Endpoint == "baseline" {
			base[r.Label] = r
		}
	}
	for _, r := range rep.Runs {
		if b := base[r.Label]; b != nil && b.RPS > 0 {
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

	find := func(mode, endpoint string) *Result {
		for _, r := range rep.Runs {
			if r.Mode == mode && r.Endpoint == endpoint {
				return r
			}
		}
		return nil
	}
	for _, r := range rep.Runs {
		if r.Mode != "step" || !strings.HasSuffix(r.Subject, "."+tagStep100) {
			continue
		}
		for _, o := range rep.Runs {
			if o.Mode == "step" && o.Inflight == r.Inflight && strings.HasSuffix(o.Subject, "."+tagStep1M) && o.Latency.P999 > 0 {
				rep.Step = append(rep.Step, StepResult{Inflight: r.Inflight, P999Step100US: r.Latency.P999, P999Step1MUS: o.Latency.P999,
					Ratio: round(r.Latency.P999/o.Latency.P999, 3)})
			}
		}
	}

	add := func(name, want, got string, ok bool) {
		rep.Targets = append(rep.Targets, Target{name, want, got, ok})
	}
	for _, ep := range []string{"segment", "snowflake"} {
		if r := find("pipelined", ep); r != nil && r.VsBaseline > 0 {
			add(ep+", "+r.Label+": requests/s", "≥ 0.95× baseline", fmt.Sprintf("%.3f×", r.VsBaseline), r.VsBaseline >= 0.95) // issue 38
		}
	}
	b := find("sequential", "baseline")
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
	if b := rep.Burst; b != nil {
		add(fmt.Sprintf("burst, %d workers, %d in flight: step %d from cold vs step %d warm, requests/s", b.Workers, b.Inflight, burstSmallStep, burstLargeStep),
			"≥ 0.8×", fmt.Sprintf("%.3f×", b.VsLarge), b.VsLarge >= 0.8)
		add(fmt.Sprintf("burst, %d workers, %d in flight: step %d from cold vs step %d warm, p999", b.Workers, b.Inflight, burstSmallStep, burstLargeStep),
			"≤ 2×", fmt.Sprintf("%.2f×", b.P999Ratio), b.P999Ratio <= 2)
	}
	if rep.Ordered = orderedSummary(rep.Runs); rep.Ordered != nil {
		o := rep.Ordered
		add(fmt.Sprintf("ordered tag, %d workers, %d in flight, 1 ID: requests/s", o.Workers, o.Inflight), "≥ 0.8× baseline", // issue 38
			fmt.Sprintf("%.3f×", o.VsBaseline), o.VsBaseline >= 0.8)
		if o.ClientVsRaw > 0 {
			add(fmt.Sprintf("ordered tag through the Go client (Id-Direct), %d workers, %d callers, 1 ID: requests/s", o.Workers, o.Inflight), "≥ 0.9× a raw request to the baseline",
				fmt.Sprintf("%.3f×", o.ClientVsRaw), o.ClientVsRaw >= 0.9)
		}
	}
	if rep.Client = clientSummary(rep.Runs); rep.Client != nil {
		cl := rep.Client
		add(fmt.Sprintf("Go client to a bare responder, %d callers, 1 ID: requests/s, median of %d rounds", cl.Callers, cl.Rounds), "≥ 0.95× raw request",
			fmt.Sprintf("%.3f× (%.3f-%.3f)", cl.ClientVsRaw.Median, cl.ClientVsRaw.Min, cl.ClientVsRaw.Max), cl.ClientVsRaw.Median >= 0.95)
	}
	if t := rep.Tags; t != nil {
		add(fmt.Sprintf("new tags, last %d of %d vs first %d: first requests/s", t.Block, t.NewTags, t.Block), "≥ 0.5×",
			fmt.Sprintf("%.2f×", t.LastOverFirst), t.LastOverFirst >= 0.5)
		add(fmt.Sprintf("RSS per warm tag (%d warm)", t.NewTags), "< 1 KB", fmt.Sprintf("%.0f B", t.RSSPerTagBytes), t.RSSPerTagBytes < 1024)
		if t.NewTags >= 100_000 {
			add(fmt.Sprintf("worker with %d warm tags: RSS", t.NewTags), "< 160 MB", fmtMB(t.RSSWarmBytes), t.RSSWarmBytes < 160<<20)
		}
		add(fmt.Sprintf("/metrics with %d warm tags", t.NewTags), "< 1 MB", fmt.Sprintf("%.1f KB", float64(t.ScrapeBytes)/1024), t.ScrapeBytes < 1<<20)
	}
	if m := rep.Memory; m != nil {
		add(fmt.Sprintf("idle worker, %d warm tags: RSS", m.Tags), "< 64 MB", fmtMB(m.RSSBytes), m.RSSBytes < 64<<20)
	}
	if s := rep.Startup; s != nil {
		add("zero-setup start-up to serving", "< 1s", fmt.Sprintf("%.0fms", s.ServingMS), s.ServingMS < 1000)
	}
}

// Print writes the report as tables.
func (rep *Report) Print(w io.Writer) error {
	var b bytes.Buffer
	rep.print(&b)
	_, err := w.Write(b.Bytes())
	return err
}

// print writes the report as tables to b.
func (rep *Report) print(w *bytes.Buffer) {
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
	if b := rep.Burst; b != nil {
		lines = append(lines, fmt.Sprintf("burst, %d workers: step %d from cold %.3f× the requests/s of step %d warm, p999 %.2f×; the small step's tag: %d fetches, %d requests waited, depth of its last fetch up to %d",
			b.Workers, burstSmallStep, b.VsLarge, burstLargeStep, b.P999Ratio, b.Fetches, b.Waits, b.Depth))
	}
	if o := rep.Ordered; o != nil {
		l := fmt.Sprintf("ordered tag, %d workers (one owner allocates, the others forward): %.3f× baseline; plain tag %.3f× baseline; ordered over plain %.3f×, p50 %+.0fµs (forwarding)",
			o.Workers, o.VsBaseline, o.PlainVsBaseline, o.VsPlain, o.ForwardP50US)
		if o.ClientVsBaseline > 0 {
			l += fmt.Sprintf("; through the Go client, straight to the owner (Id-Direct), %.3f× a raw request to the baseline (%.3f× the baseline through the Go client), p50 %+.0fµs over the plain NATS client's", o.ClientVsRaw, o.ClientVsBaseline, o.ClientP50US)
		}
		if o.AloneVsBaseline > 0 {
			l += fmt.Sprintf("; the owner alone %.3f× baseline, %d workers %.3f× of that", o.AloneVsBaseline, o.Workers, o.VsAlone)
		}
		lines = append(lines, l)
	}
	if cl := rep.Client; cl != nil {
		sp := func(s Spread) string { return fmt.Sprintf("%.3f× (%.3f-%.3f)", s.Median, s.Min, s.Max) }
		lines = append(lines, fmt.Sprintf("Go client's own cost (%d rounds, %d callers, one connection; baseline: raw nc.RequestWithContext to a bare counter responder): the Go client to the same responder %s, to the service %s; a raw request with a token %s; the Go client over that raw request with a token %s; medians (ranges)",
			cl.Rounds, cl.Callers, sp(cl.ClientVsRaw), sp(cl.ServiceVsRaw), sp(cl.TokenVsRaw), sp(cl.ClientVsToken)))
	}
	if t := rep.Tags; t != nil {
		how := "created on first use (KV, --auto-create-tags)"
		if t.Store == "postgres" {
			how = fmt.Sprintf("created beforehand (PostgreSQL with %s tags, witness on)", fmtCount(float64(t.StoreTags)))
		}
		settled := "no garbage collection awaited"
		if t.SettledGC {
			settled = "after the idle worker's next two garbage collections"
			if t.SettledRSS {
				settled = fmt.Sprintf("settled: two garbage collections, then RSS fell by less than 1%% over three minutes, %.0f s after the last new tag", t.SettledAfterS)
			} else if t.SettledAfterS > 0 {
				settled += fmt.Sprintf(", %.0f s after the last new tag (RSS still falling)", t.SettledAfterS)
			}
		}
		blocks := make([]string, len(t.BlocksPerSec))
		for i, b := range t.BlocksPerSec {
			blocks[i] = fmtCount(b)
		}
		lines = append(lines,
			fmt.Sprintf("new tags: first requests for %s tags %s, %d at a time, in %.1fs; per block of %s: %s/s; last/first %.2f×",
				fmtCount(float64(t.NewTags)), how, t.Clients, t.NewSeconds, fmtCount(float64(t.Block)), strings.Join(blocks, ", "), t.LastOverFirst),
			fmt.Sprintf("worker RSS: %s with no tag, %s with %s warm tags (%s): %.0f bytes per warm tag (Go heap in use: %.0f); /metrics %s bytes, %d samples",
				fmtMB(t.RSSNoTagsBytes), fmtMB(t.RSSWarmBytes), fmtCount(float64(t.NewTags)), settled, t.RSSPerTagBytes, t.HeapPerTagBytes, fmtCount(float64(t.ScrapeBytes)), t.ScrapeSeries),
			fmt.Sprintf("refresh on a store of %s tags: %.1fms with nothing changed, %.1fms with %d changed; a full listing (%s tags) %.0fms; the load runs saw %d changes, refreshed every %s",
				fmtCount(float64(t.StoreTags)), t.RefreshIdleMS, t.RefreshMS, t.RefreshChanged, fmtCount(float64(t.FullListTags)), t.FullListMS, t.Churned, t.RefreshInterval))
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

// gap is the space between two columns of a table.
const gap = "  "

// writeTable writes rows as columns, the first left of them aligned left,
// the others right, gap apart, with no trailing spaces. text/tabwriter
// aligns them, counting characters, not bytes ("µs", "×"). A tabwriter
// aligns all its columns one way, so the right-aligned columns are laid out
// first, by one with AlignRight and no padding, each cell but a row's first
// carrying the gap before it (padding would put it before the first too);
// each line of that becomes the last cell of its row in the left-aligned
// table. Writes to a bytes.Buffer do not fail.
func writeTable(w *bytes.Buffer, rows [][]string, left int) {
	var rb bytes.Buffer
	tw := tabwriter.NewWriter(&rb, 0, 0, 0, ' ', tabwriter.AlignRight)
	for _, row := range rows {
		for i, c := range row[min(left, len(row)):] {
			if i > 0 {
				tw.Write([]byte(gap))
			}
			tw.Write([]byte(c + "\t"))
		}
		tw.Write([]byte("\n"))
	}
	tw.Flush()
	right := strings.Split(strings.TrimSuffix(rb.String(), "\n"), "\n")

	tw = tabwriter.NewWriter(w, 0, 0, len(gap), ' ', 0)
	for i, row := range rows {
		cells := row[:min(left, len(row))]
		if right[i] != "" {
			cells = append(slices.Clip(cells), right[i])
		}
		// The last cell is not terminated: it is no column, so it gets no
		// padding after it.
		tw.Write([]byte(strings.Join(cells, "\t") + "\n"))
	}
	tw.Flush()
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
