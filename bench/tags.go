package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/dispenser-dev/dispenser/segment"
	"github.com/dispenser-dev/dispenser/segment/kv"
	"github.com/dispenser-dev/dispenser/segment/postgres"
	"github.com/dispenser-dev/dispenser/tagmodel"
)

// The tags run (issue 12: many tags). One `dispenser serve` worker in a
// child process, on a store of its own, is asked for the first ID of
// Config.Tags tags it has never served, by tagsClients concurrent clients;
// then it holds them all warm. Measured:
//
//   - the rate of those first requests by block of tagsBlock tags, and the
//     last block's rate over the first's. With the KV store the tags are
//     created on first use (--auto-create-tags, as in zero-setup mode);
//     with PostgreSQL they are created beforehand, Config.TagsStore of
//     them, in one INSERT ... generate_series;
//   - the worker's resident size before and after, and the difference per
//     warm tag;
//   - the size of its /metrics scrape with all of them warm;
//   - the time of one refresh of the tag list by an allocator in this
//     process on the same store (incremental: tagmodel.ChangeLister), with
//     tagsChanged tags changed since the last, against a full listing of
//     the store (what every refresh cost before);
//   - request latency while the worker refreshes every tagsRefresh with
//     changes coming in, against a second worker on the same store that
//     does not refresh and the baseline, in one load run.

// Names of the tags run.
const (
	tagsPrefix     = "benchtags"  // the measured worker's subject prefix
	tagsCtlPrefix  = "benchtags0" // the control worker's, which does not refresh
	tagsBucket     = "dispenser_bench_tags"
	tagsNamePrefix = "bt_"
	// tagsClients is the number of concurrent first requests.
	tagsClients = 32
	// tagsBlock is the most tags in one block of the new-tag rate.
	tagsBlock = 5000
	// tagsChanged is the number of tags changed before the timed refresh.
	tagsChanged = 1000
	// tagsRefresh is the measured worker's --refresh-interval.
	tagsRefresh = 200 * time.Millisecond
	// tagsChurn is how many tags change every tagsRefresh during the load
	// run, so that each refresh has something to apply.
	tagsChurn = 100
)

// TagsResult is what the tags run measured.
type TagsResult struct {
	// Store is "kv" (tags created on first use) or "postgres" (created in
	// bulk beforehand; witness on).
	Store string `json:"store"`
	// NewTags tags were asked for the first time; StoreTags tags are in the
	// store (the PostgreSQL store keeps them from run to run).
	NewTags   int `json:"new_tags"`
	StoreTags int `json:"store_tags"`
	Clients   int `json:"clients"`
	// Block is the number of tags per block; BlocksPerSec the first
	// requests per second of each block, in order; LastOverFirst the last
	// block's rate over the first's.
	Block         int       `json:"block"`
	BlocksPerSec  []float64 `json:"blocks_per_sec"`
	FirstPerSec   float64   `json:"first_block_per_sec"`
	LastPerSec    float64   `json:"last_block_per_sec"`
	LastOverFirst float64   `json:"last_over_first"`
	NewSeconds    float64   `json:"new_tags_seconds"`
	// The worker's resident size with no tag and with NewTags tags warm,
	// and the difference per warm tag.
	RSSNoTagsBytes int64   `json:"rss_no_tags_bytes"`
	RSSWarmBytes   int64   `json:"rss_warm_bytes"`
	RSSPerTagBytes float64 `json:"rss_per_tag_bytes"`
	// HeapPerTagBytes is the same for the Go heap in use (the worker's
	// go_memstats_heap_inuse_bytes), which leaves out memory the runtime
	// holds but does not use; both include garbage not yet collected.
	HeapPerTagBytes float64 `json:"heap_per_tag_bytes"`
	// SettledGC reports that the memory with warm tags was measured after
	// two garbage collections of the idle worker (Config.TagsSettle; the Go
	// runtime collects at least every two minutes): the first frees the
	// warm-up's garbage, and the runtime returns freed memory to the
	// system over the cycle that follows, so RSS has settled by the
	// second.
	SettledGC bool `json:"settled_gc"`
	// SettledAfterS is how long after the last new tag the memory was
	// measured (with Config.TagsSettle: once two garbage collections ran
	// and RSS fell by less than 1% over three minutes, or the settle time
	// ran out); SettledRSS reports that RSS had stopped falling.
	SettledAfterS float64 `json:"settled_after_s,omitempty"`
	SettledRSS    bool    `json:"settled_rss,omitempty"`
	// ScrapeBytes and ScrapeSeries are the size of /metrics with NewTags
	// tags warm, and its samples (lines that are no comment).
	ScrapeBytes  int `json:"scrape_bytes"`
	ScrapeSeries int `json:"scrape_series"`
	// RefreshIdleMS is a refresh with nothing changed, RefreshMS one with
	// RefreshChanged tags changed since the last; FullListMS lists every
	// tag of the store (Store.Tags), what a refresh cost before it was
	// incremental.
	RefreshChanged int     `json:"refresh_changed"`
	RefreshIdleMS  float64 `json:"refresh_idle_ms"`
	RefreshMS      float64 `json:"refresh_ms"`
	FullListMS     float64 `json:"full_list_ms"`
	FullListTags   int     `json:"full_list_tags"`
	// RefreshInterval is the measured worker's --refresh-interval during
	// the load run (the "tags_refresh" runs of the report).
	RefreshInterval string `json:"refresh_interval"`
	// Churned is how many tag changes the store saw during the load runs.
	Churned int `json:"churned"`
}

// tagName is the name of the i-th tag of the tags run.
func tagName(i int) string { return tagsNamePrefix + strconv.Itoa(i) }

// blockRates returns the rate of each block of block completions: done
// holds the completion times (any order) as offsets from the start. The
// last block may be shorter; a block that took no time counts as the
// fastest block's rate.
func blockRates(done []time.Duration, block int) []float64 {
	if block < 1 || len(done) == 0 {
		return nil
	}
	t := slices.Clone(done)
	slices.Sort(t)
	var rates []float64
	var prev time.Duration
	for i := 0; i < len(t); i += block {
		j := min(i+block, len(t))
		d := t[j-1] - prev
		prev = t[j-1]
		r := 0.0
		if d > 0 {
			r = float64(j-i) / d.Seconds()
		}
		rates = append(rates, r)
	}
	return rates
}

// tagsStore opens the store of the tags run: with postgresURL PostgreSQL,
// with storeTags tags bt_0... created in one statement if missing (their
// update_time set a day back, so that they are no recent change); else the
// KV bucket tagsBucket, empty (the local set-up's nats-server is new).
func (e *env) tagsStore(ctx context.Context, postgresURL string, storeTags int) (tagmodel.Store, func(), error) {
	if postgresURL == "" {
		st, err := kv.New(ctx, e.js, kv.Settings{Bucket: tagsBucket})
		if err != nil {
			return nil, nil, fmt.Errorf("tags bucket: %w", err)
		}
		return st, func() {}, nil
	}
	pool, err := openMigrated(ctx, postgresURL)
	if err != nil {
		return nil, nil, err
	}
	_, err = pool.Exec(ctx, `INSERT INTO leaf_alloc (biz_tag, max_id, step, description, update_time)
SELECT $1 || g, 1, 1000, 'dispenser bench', now() - interval '1 day' FROM generate_series(0, $2::int - 1) g
ON CONFLICT (biz_tag) DO NOTHING`, tagsNamePrefix, storeTags)
	if err != nil {
		pool.Close()
		return nil, nil, fmt.Errorf("creating %d tags in bulk: %w", storeTags, err)
	}
	return postgres.New(pool), pool.Close, nil
}

// tagsWorker starts `dispenser serve` in a child process for the tags run
// with prefix, refreshing every refresh; metricsAddr, if not empty, serves
// /metrics.
func (e *env) tagsWorker(ctx context.Context, postgresURL, prefix, metricsAddr string, refresh time.Duration) (*child, error) {
	args := []string{"serve", "--nats-url", e.url, "--prefix", prefix, "--queue-group", prefix, "--instance", "bench-" + prefix,
		"--snowflake=false", "--refresh-interval", refresh.String(), "--max-wait", "5s", "--log-level", "warn"}
	if postgresURL != "" {
		args = append(args, "--postgres-url", postgresURL)
	} else {
		// No bound on the tags created on first use: the run creates
		// --tags of them (the default bound, 1,000, would refuse the rest).
		args = append(args, "--segment-bucket", tagsBucket, "--auto-create-tags", "--auto-create-step", "1000", "--auto-create-max", "-1")
	}
	if metricsAddr != "" {
		args = append(args, "--metrics-addr", metricsAddr, "--metrics-tags", tagName(0))
	}
	c, err := startChild(ctx, args...)
	if err != nil {
		return nil, err
	}
	// Serving once it answers on its own prefix: ask for an invalid tag,
	// which it refuses with 400 (no responders is a status 503).
	deadline := time.Now().Add(20 * time.Second)
	for {
		m, err := e.ctlNC.Request(prefix+".segment.not.a.tag", nil, 200*time.Millisecond)
		if err == nil && m.Header.Get("Status") == "" {
			return c, nil
		}
		if c.gone() || time.Now().After(deadline) {
			c.stop()
			return nil, fmt.Errorf("worker %s did not serve within 20s: %s", prefix, strings.TrimSpace(c.stderr.String()))
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// measureTags runs the tags run but its load runs: new-tag rate, memory,
// scrape size and refresh time. It returns the result and the started
// workers (measured, control), which the caller loads and stops.
func (e *env) measureTags(ctx context.Context, postgresURL string, newTags, storeTags int, settle time.Duration, p *progress) (_ *TagsResult, workers []*child, err error) {
	defer func() {
		if err != nil {
			for _, c := range workers {
				c.stop()
			}
			workers = nil
		}
	}()
	r := &TagsResult{Store: "kv", NewTags: newTags, StoreTags: newTags, Clients: tagsClients, RefreshInterval: tagsRefresh.String()}
	if postgresURL != "" {
		r.Store, r.StoreTags = "postgres", storeTags
		p.note(fmt.Sprintf("tags: %d tags in PostgreSQL (created in bulk where missing)", storeTags))
	}
	st, closeStore, err := e.tagsStore(ctx, postgresURL, r.StoreTags)
	if err != nil {
		return nil, nil, err
	}
	defer closeStore()

	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, nil, err
	}
	metricsAddr := ln.Addr().String()
	ln.Close()
	w, err := e.tagsWorker(ctx, postgresURL, tagsPrefix, metricsAddr, tagsRefresh)
	if err != nil {
		return nil, nil, err
	}
	workers = append(workers, w)
	time.Sleep(time.Second)
	if r.RSSNoTagsBytes, err = processRSS(strconv.Itoa(w.cmd.Process.Pid)); err != nil {
		return nil, workers, err
	}
	_, _, heap0, err := scrape(ctx, "http://"+metricsAddr+"/metrics")
	if err != nil {
		return nil, workers, err
	}

	p.note(fmt.Sprintf("tags: first requests for %d new tags, %d at a time", newTags, tagsClients))
	names := make([]string, newTags)
	for i := range names {
		names[i] = tagName(i)
	}
	done := make([]time.Duration, newTags)
	var n atomic.Int64
	start := time.Now()
	err = parallel(ctx, names, tagsClients, func(tag string) error {
		id, err := requestID(ctx, e.ctlNC, tagsPrefix+".segment."+tag, 30*time.Second)
		if err != nil {
			return fmt.Errorf("first ID of %s: %w", tag, err)
		}
		if _, ok := parseID([]byte(id)); !ok {
			return fmt.Errorf("first ID of %s: %w: %q", tag, errBadReply, id)
		}
		done[n.Add(1)-1] = time.Since(start)
		return nil
	})
	if err != nil {
		if w.gone() {
			err = fmt.Errorf("%w (the worker exited: %s)", err, strings.TrimSpace(w.stderr.String()))
		}
		return nil, workers, err
	}
	r.NewSeconds = round(time.Since(start).Seconds(), 3)
	r.Block = max(1, min(tagsBlock, newTags/4))
	r.BlocksPerSec = blockRates(done, r.Block)
	for i := range r.BlocksPerSec {
		r.BlocksPerSec[i] = round(r.BlocksPerSec[i], 1)
	}
	// The last full block: a short last block has too few tags to time.
	last := len(r.BlocksPerSec) - 1
	if newTags%r.Block != 0 && last > 0 {
		last--
	}
	r.FirstPerSec, r.LastPerSec = r.BlocksPerSec[0], r.BlocksPerSec[last]
	if r.FirstPerSec > 0 {
		r.LastOverFirst = round(r.LastPerSec/r.FirstPerSec, 3)
	}

	time.Sleep(time.Second)
	if settle > 0 {
		warm := time.Now()
		p.note(fmt.Sprintf("tags: waiting up to %v for the worker's next two garbage collections and its RSS to stop falling", settle))
		if r.SettledGC, err = awaitGC(ctx, "http://"+metricsAddr+"/metrics", settle, 2); err != nil {
			return nil, workers, err
		}
		if r.SettledRSS, err = awaitRSS(ctx, strconv.Itoa(w.cmd.Process.Pid), warm.Add(settle)); err != nil {
			return nil, workers, err
		}
		r.SettledAfterS = round(time.Since(warm).Seconds(), 1)
	}
	if r.RSSWarmBytes, err = processRSS(strconv.Itoa(w.cmd.Process.Pid)); err != nil {
		return nil, workers, err
	}
	r.RSSPerTagBytes = round(float64(r.RSSWarmBytes-r.RSSNoTagsBytes)/float64(newTags), 1)
	var heap int64
	if r.ScrapeBytes, r.ScrapeSeries, heap, err = scrape(ctx, "http://"+metricsAddr+"/metrics"); err != nil {
		return nil, workers, err
	}
	r.HeapPerTagBytes = round(float64(heap-heap0)/float64(newTags), 1)

	p.note("tags: refresh of the tag list, incremental and full")
	if err := measureRefresh(ctx, st, r); err != nil {
		return nil, workers, fmt.Errorf("refresh: %w", err)
	}

	ctl, err := e.tagsWorker(ctx, postgresURL, tagsCtlPrefix, "", time.Hour)
	if err != nil {
		return nil, workers, err
	}
	workers = append(workers, ctl)
	for _, prefix := range []string{tagsPrefix, tagsCtlPrefix} {
		if _, err := requestID(ctx, e.ctlNC, prefix+".segment."+tagName(0), 10*time.Second); err != nil {
			return nil, workers, fmt.Errorf("warming %s: %w", prefix, err)
		}
	}
	return r, workers, nil
}

// measureRefresh times refreshes of an allocator on st and a full listing
// of st, filling r's refresh fields.
func measureRefresh(ctx context.Context, st tagmodel.Store, r *TagsResult) error {
	a, err := segment.New(segment.Settings{Store: st, RefreshInterval: time.Hour, FetchTimeout: time.Minute,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		return err
	}
	defer a.Close(context.Background())
	select {
	case <-a.Loaded(): // the first refresh takes the store's cursor
	case <-time.After(time.Minute):
		return errors.New("the allocator's first refresh took over a minute")
	case <-ctx.Done():
		return ctx.Err()
	}
	t := time.Now()
	if err := a.Refresh(ctx); err != nil {
		return err
	}
	r.RefreshIdleMS = msSince(t)
	r.RefreshChanged = min(tagsChanged, r.StoreTags)
	if err := changeTags(ctx, st, r.StoreTags, r.RefreshChanged, "refresh"); err != nil {
		return err
	}
	t = time.Now()
	if err := a.Refresh(ctx); err != nil {
		return err
	}
	r.RefreshMS = msSince(t)
	t = time.Now()
	names, err := st.Tags(ctx)
	if err != nil {
		return fmt.Errorf("listing all tags: %w", err)
	}
	r.FullListMS, r.FullListTags = msSince(t), len(names)
	return nil
}

// changeTags changes the description of n of the first total tags (from a
// random-looking start), so that they show as changed to a refresh.
func changeTags(ctx context.Context, st tagmodel.Store, total, n int, what string) error {
	admin, ok := st.(tagmodel.Admin)
	if !ok {
		return fmt.Errorf("the store cannot change tags (%T)", st)
	}
	off := int(time.Now().UnixNano() % int64(total))
	names := make([]string, n)
	for i := range names {
		names[i] = tagName((off + i*7919) % total)
	}
	desc := "dispenser bench " + what + " " + time.Now().Format(time.RFC3339Nano)
	return parallel(ctx, names, 8, func(tag string) error {
		if err := admin.UpdateTag(ctx, tag, tagmodel.Update{Description: &desc}); err != nil {
			return fmt.Errorf("changing tag %s: %w", tag, err)
		}
		return nil
	})
}

// churn changes tagsChurn tags every tagsRefresh until ctx ends, so that
// the measured worker's refreshes have changes to apply; it returns how
// many it changed and the first error.
func churn(ctx context.Context, st tagmodel.Store, total int) (int, error) {
	changed := 0
	t := time.NewTicker(tagsRefresh)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return changed, nil
		case <-t.C:
		}
		n := min(tagsChurn, total)
		if err := changeTags(ctx, st, total, n, "churn"); err != nil {
			if ctx.Err() != nil {
				return changed, nil
			}
			return changed, err
		}
		changed += n
	}
}

// scrape fetches a /metrics page and returns its size, its samples and the
// value of go_memstats_heap_inuse_bytes (0 if missing).
func scrape(ctx context.Context, url string) (size, samples int, heap int64, err error) {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return 0, 0, 0, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, 0, 0, fmt.Errorf("scraping %s: %w", url, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return 0, 0, 0, fmt.Errorf("scraping %s: %w", url, err)
	}
	if resp.StatusCode != http.StatusOK {
		return 0, 0, 0, fmt.Errorf("scraping %s: %s", url, resp.Status)
	}
	return len(b), countSamples(b), sampleValue(b, "go_memstats_heap_inuse_bytes"), nil
}

// awaitRSS waits until the RSS of process pid fell by less than 1% over
// the last three minutes (the Go runtime returns freed memory to the system
// after garbage collections, which an idle worker runs at least every two
// minutes), polling every 10 s, or until deadline; it reports whether RSS
// stopped falling.
func awaitRSS(ctx context.Context, pid string, deadline time.Time) (bool, error) {
	var samples []int64 // one every 10 s
	for {
		rss, err := processRSS(pid)
		if err != nil {
			return false, err
		}
		samples = append(samples, rss)
		if n := len(samples); n > 18 && samples[n-19]-rss < samples[n-19]/100 {
			return true, nil
		}
		if time.Now().Add(10 * time.Second).After(deadline) {
			return false, nil
		}
		select {
		case <-ctx.Done():
			return false, ctx.Err()
		case <-time.After(10 * time.Second):
		}
	}
}

// awaitGC waits until the worker whose metrics are at url has run n
// garbage collections since the call, polling every second, for at most
// d; it reports whether they ran.
func awaitGC(ctx context.Context, url string, d time.Duration, n int64) (bool, error) {
	gcs := func() (int64, error) {
		ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		if err != nil {
			return 0, err
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return 0, fmt.Errorf("scraping %s: %w", url, err)
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		if err != nil {
			return 0, fmt.Errorf("scraping %s: %w", url, err)
		}
		return sampleValue(b, "go_gc_duration_seconds_count"), nil
	}
	start, err := gcs()
	if err != nil {
		return false, err
	}
	deadline := time.Now().Add(d)
	for time.Now().Before(deadline) {
		select {
		case <-ctx.Done():
			return false, ctx.Err()
		case <-time.After(time.Second):
		}
		now, err := gcs()
		if err != nil {
			return false, err
		}
		if now >= start+n {
			time.Sleep(time.Second) // let the background sweep finish
			return true, nil
		}
	}
	return false, nil
}

// sampleValue returns the value of the unlabeled sample name of a
// Prometheus text page, or 0.
func sampleValue(b []byte, name string) int64 {
	for line := range strings.SplitSeq(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, name+" "); ok {
			f, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
			if err == nil {
				return int64(f)
			}
		}
	}
	return 0
}

// countSamples counts the lines of a Prometheus text page that are samples:
// not empty, not comments.
func countSamples(b []byte) int {
	n := 0
	for line := range strings.SplitSeq(string(b), "\n") {
		if line != "" && !strings.HasPrefix(line, "#") {
			n++
		}
	}
	return n
}
