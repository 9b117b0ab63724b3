package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	neturl "net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/dispenser-dev/dispenser/client"
	"github.com/dispenser-dev/dispenser/internal/redact"
	"github.com/dispenser-dev/dispenser/protocol"
)

// The load generator. It runs in a process of its own (the program's
// hidden LoadCommand, which calls ServeLoad), so that it shares no runtime
// with the service it measures, and keeps a fixed number of requests in
// flight on one connection: requests go out with per-slot reply subjects
// under one wildcard subscription, a reply frees its slot, and the sender
// refills it.
//
// It loads its subjects in turn, a slice of time each, waiting for the
// replies still out before it switches, until each subject had its
// duration: noise from the rest of the machine falls on all of them alike.

// Errors of the load generator.
var (
	// errBadReply means a reply was not what the request asked for.
	errBadReply = errors.New("bad reply")
	// errErrorReply means the service answered with an error.
	errErrorReply = errors.New("error reply")
	// errLost means replies did not come within the drain time.
	errLost = errors.New("replies lost")
)

// LoadConfig describes one load run.
type LoadConfig struct {
	URL string
	// NATSOptions are the options of the load generator's connection
	// (credentials, TLS). A child process gets them from ChildArgs.
	NATSOptions []nats.Option
	// ChildArgs are flags that the command line of a child running this
	// load gets besides the load's own: those that give the child's
	// program NATSOptions (see Config.ChildArgs).
	ChildArgs []string
	Subjects  []string // loaded in turn
	Inflight  int
	Batch     int           // IDs per request; 1 sends an empty body
	Format    string        // "list" or "range"
	Warmup    time.Duration // per subject, not measured
	Duration  time.Duration // per subject, measured
	Slice     time.Duration // how long one subject is loaded before the next
	Drain     time.Duration // how long to wait for the replies still out
	Verify    bool          // parse every ID and check for duplicates
	// CPUProfile, if not empty, is the file of a CPU profile of the
	// load generator (the child's own process: the Go client's side).
	CPUProfile string
}

// LoadResult is what a load run measured for one subject. Requests and IDs
// count the replies received in its measured slices, Latency the round
// trips of the requests sent in them; Sent, Errors and Lost cover the whole
// run, warm-up included.
type LoadResult struct {
	Subject    string       `json:"subject"`
	Inflight   int          `json:"inflight"`
	Batch      int          `json:"batch"`
	Format     string       `json:"format"`
	Seconds    float64      `json:"seconds"`
	Requests   uint64       `json:"requests"`
	IDs        uint64       `json:"ids"`
	RPS        float64      `json:"requests_per_sec"`
	IDsPerSec  float64      `json:"ids_per_sec"`
	Latency    LatencyStats `json:"latency_us"`
	Sent       uint64       `json:"sent"`
	Errors     uint64       `json:"errors"`
	Lost       uint64       `json:"lost"`
	FirstError string       `json:"first_error,omitempty"`
	// With Verify: IDs checked, duplicates among them, and the IDs seen as
	// sorted, disjoint runs (for checks across runs).
	Checked    uint64     `json:"checked_ids,omitempty"`
	Duplicates uint64     `json:"duplicates"`
	Runs       [][2]int64 `json:"runs,omitempty"`
}

// progressPrefix starts the lines a load child writes to stderr twice a
// second: "progress SUBJECT_INDEX PHASE DONE_NS TOTAL_NS REPLIES ERRORS",
// PHASE warmup or measure, DONE_NS and TOTAL_NS the subject's time in it.
const progressPrefix = "progress "

// target is the state of one subject. The fields under mu are written by
// the subscription's goroutine and read at the end.
type target struct {
	subject string
	msgs    []*nats.Msg // each slot's request
	// client and tag, for a subject loaded through the Go client
	// (clientPrefix): each request is a SegmentN call of its own.
	client *client.Client
	tag    string
	// raw is the subject of a target loaded with plain
	// nc.RequestWithContext calls (rawPrefix), the Go client's baseline;
	// token: each with a new Id-Token, its echo checked (tokenPrefix).
	raw   string
	token bool

	// Lock order: no other lock is taken while mu is held; the package's
	// other mutexes (a tailBuffer's, parallel's) are leaves too.
	mu        sync.Mutex
	hist      *latencies
	ok, ids   uint64
	sent      uint64
	errors    uint64
	firstErr  string
	runs      []segmentRun // Verify: IDs seen, coalesced as they arrive
	checked   uint64
	measured  time.Duration
	warmedUp  time.Duration
	replies   atomic.Uint64 // for progress
	errsCount atomic.Uint64 // for progress
}

// loader is one load run in progress.
type loader struct {
	cfg     LoadConfig
	nc      *nats.Conn
	base    time.Time
	inbox   string
	targets []*target

	free     chan int32     // slots not in flight: the window
	sent     []atomic.Int64 // send time of each slot's request, ns since base
	busy     []atomic.Bool  // slot awaits a reply
	slotTgt  []atomic.Int32 // target of each slot's request
	slotMeas []atomic.Bool  // the slot's request was sent in a measured slice

	// The current slice: its target, and the window in which replies count
	// (zero outside measured slices). Throughput counts from the first reply
	// in the window, winFirst, when the pipeline is full, to its end.
	cur                        atomic.Int32
	winStart, winEnd, winFirst atomic.Int64

	reply []segmentRun // Verify: the IDs of the reply being checked
}

// segmentRun is a run of IDs, First through Last.
type segmentRun struct{ First, Last int64 }

func (l *loader) now() int64 { return int64(time.Since(l.base)) }

// RunLoad runs one load run in this process and returns a result per
// subject. progress, if not nil, receives a progress line twice a second.
func RunLoad(ctx context.Context, cfg LoadConfig, progress io.Writer) ([]*LoadResult, error) {
	if len(cfg.Subjects) == 0 || cfg.Inflight < 1 || cfg.Batch < 1 || cfg.Duration <= 0 || cfg.Warmup < 0 {
		return nil, fmt.Errorf("load: %d subjects, inflight %d, batch %d, duration %v, warm-up %v: want positive values",
			len(cfg.Subjects), cfg.Inflight, cfg.Batch, cfg.Duration, cfg.Warmup)
	}
	if cfg.Format != "list" && cfg.Format != "range" {
		return nil, fmt.Errorf("load: format %q: want list or range", cfg.Format)
	}
	if cfg.Slice <= 0 || cfg.Slice > cfg.Duration {
		cfg.Slice = cfg.Duration
	}
	nc, err := nats.Connect(cfg.URL, append(slices.Clip(cfg.NATSOptions), nats.Name("dispenser-bench-load"))...)
	if err != nil {
		return nil, connectError("load: ", cfg.URL, err)
	}
	defer nc.Close()
	l := &loader{
		cfg:      cfg,
		nc:       nc,
		inbox:    nats.NewInbox(),
		free:     make(chan int32, cfg.Inflight),
		sent:     make([]atomic.Int64, cfg.Inflight),
		busy:     make([]atomic.Bool, cfg.Inflight),
		slotTgt:  make([]atomic.Int32, cfg.Inflight),
		slotMeas: make([]atomic.Bool, cfg.Inflight),
	}
	var body []byte
	if cfg.Batch > 1 {
		body = []byte(strconv.Itoa(cfg.Batch))
	}
	for _, subj := range cfg.Subjects {
		t := &target{subject: subj, msgs: make([]*nats.Msg, cfg.Inflight), hist: newLatencies()}
		if prefix, tag, ok := clientTarget(subj); ok {
			if cfg.Format != "list" {
				return nil, fmt.Errorf("load: %s: the Go client's runs are in format list", subj)
			}
			if t.client, err = client.New(nc, client.WithPrefix(prefix)); err != nil {
				return nil, fmt.Errorf("load: %s: %w", subj, err)
			}
			t.tag = tag
		} else if strings.HasPrefix(subj, clientPrefix) {
			return nil, fmt.Errorf("load: %s: want %s<prefix>.segment.<tag>", subj, clientPrefix)
		} else if raw, ok := strings.CutPrefix(subj, rawPrefix); ok {
			if cfg.Format != "list" || cfg.Batch != 1 || raw == "" {
				return nil, fmt.Errorf("load: %s: want %s<subject>, one ID a request, in format list", subj, rawPrefix)
			}
			t.raw = raw
		} else if raw, ok := strings.CutPrefix(subj, tokenPrefix); ok {
			if cfg.Format != "list" || cfg.Batch != 1 || raw == "" {
				return nil, fmt.Errorf("load: %s: want %s<subject>, one ID a request, in format list", subj, tokenPrefix)
			}
			t.raw, t.token = raw, true
		}
		for i := range t.msgs {
			m := &nats.Msg{Subject: subj, Reply: l.inbox + "." + strconv.Itoa(i), Data: body}
			if cfg.Format == "range" {
				m.Header = nats.Header{protocol.FormatHeader: []string{"range"}}
			}
			t.msgs[i] = m
		}
		l.targets = append(l.targets, t)
	}
	for i := range cfg.Inflight {
		l.free <- int32(i)
	}
	sub, err := nc.Subscribe(l.inbox+".*", l.onReply)
	if err != nil {
		return nil, fmt.Errorf("load: subscribing: %w", err)
	}
	if err := sub.SetPendingLimits(-1, -1); err != nil {
		return nil, fmt.Errorf("load: %w", err)
	}
	if err := nc.Flush(); err != nil {
		return nil, fmt.Errorf("load: %w", err)
	}

	l.base = time.Now()
	stopProgress := l.reportProgress(progress)
	runErr := l.run(ctx)
	stopProgress()
	lost := uint64(cfg.Inflight - len(l.free))
	if err := sub.Unsubscribe(); err != nil && !errors.Is(err, nats.ErrConnectionClosed) {
		return nil, fmt.Errorf("load: %w", err)
	}
	if ctx.Err() != nil {
		return nil, ctx.Err()
	}

	var out []*LoadResult
	for i, t := range l.targets {
		t.mu.Lock()
		secs := t.measured.Seconds()
		r := &LoadResult{
			Subject:    t.subject,
			Inflight:   cfg.Inflight,
			Batch:      cfg.Batch,
			Format:     cfg.Format,
			Seconds:    round(secs, 3),
			Requests:   t.ok,
			IDs:        t.ids,
			Latency:    t.hist.stats(),
			Sent:       t.sent,
			Errors:     t.errors,
			FirstError: t.firstErr,
		}
		if secs > 0 {
			r.RPS, r.IDsPerSec = float64(t.ok)/secs, float64(t.ids)/secs
		}
		if runErr != nil && int(l.cur.Load()) == i {
			// The run stopped in this subject's slice.
			r.Lost = lost
			r.Errors++
			if r.FirstError == "" {
				r.FirstError = runErr.Error()
			}
		}
		if cfg.Verify {
			merged, dups := mergeRuns(t.runs)
			r.Checked, r.Duplicates = t.checked, dups
			r.Runs = make([][2]int64, len(merged))
			for i, m := range merged {
				r.Runs[i] = [2]int64{m.First, m.Last}
			}
		}
		t.mu.Unlock()
		out = append(out, r)
	}
	return out, nil
}

// run loads the subjects in turn: first a warm-up slice each, then slices
// of cfg.Slice until each had cfg.Duration. It stops at the first publish
// error or when replies do not come within the drain time.
func (l *loader) run(ctx context.Context) error {
	n := len(l.targets)
	for i := range n {
		if err := l.slice(ctx, i, l.cfg.Warmup, false); err != nil {
			return err
		}
	}
	for left := l.cfg.Duration; left > 0; left -= l.cfg.Slice {
		for i := range n {
			if err := l.slice(ctx, i, min(l.cfg.Slice, left), true); err != nil {
				return err
			}
		}
	}
	return nil
}

// slice loads target i for d, then waits for its replies.
func (l *loader) slice(ctx context.Context, i int, d time.Duration, measured bool) error {
	if d <= 0 {
		return nil
	}
	t := l.targets[i]
	l.cur.Store(int32(i))
	start := l.now()
	end := start + int64(d)
	if measured {
		l.winFirst.Store(0)
		l.winStart.Store(start)
		l.winEnd.Store(end)
	}
	var sent uint64
	var err error
	done := ctx.Done()
	if t.client != nil || t.raw != "" {
		sent = l.callers(ctx, t, i, end, measured)
	}
send:
	for t.client == nil && t.raw == "" {
		var slot int32
		select {
		case slot = <-l.free:
		case <-done:
			break send
		}
		now := l.now()
		if now >= end {
			l.free <- slot
			break
		}
		l.sent[slot].Store(now)
		l.slotTgt[slot].Store(int32(i))
		l.slotMeas[slot].Store(measured)
		l.busy[slot].Store(true)
		if err = l.nc.PublishMsg(t.msgs[slot]); err != nil {
			l.busy[slot].Store(false)
			l.free <- slot
			err = fmt.Errorf("load: publishing: %w", err)
			break
		}
		sent++
	}
	// Wait for the replies still out.
	deadline := time.Now().Add(l.cfg.Drain)
	for len(l.free) < l.cfg.Inflight && time.Now().Before(deadline) && ctx.Err() == nil {
		time.Sleep(100 * time.Microsecond)
	}
	l.winStart.Store(0)
	l.winEnd.Store(0)
	t.mu.Lock()
	t.sent += sent
	if first := l.winFirst.Load(); measured && first > 0 {
		t.measured += time.Duration(end - first)
	} else if !measured {
		t.warmedUp += time.Duration(end - start)
	}
	t.mu.Unlock()
	if err == nil && len(l.free) < l.cfg.Inflight && ctx.Err() == nil {
		err = fmt.Errorf("%w: %d replies did not come within %v", errLost, l.cfg.Inflight-len(l.free), l.cfg.Drain)
	}
	return err
}

// onReply handles one reply: it times it, checks it and frees its slot.
// Only the subscription's goroutine calls it.
func (l *loader) onReply(m *nats.Msg) {
	now := l.now()
	slot, ok := slotOf(m.Subject)
	if !ok || slot >= len(l.sent) || !l.busy[slot].CompareAndSwap(true, false) {
		l.targets[l.cur.Load()].fail(fmt.Errorf("%w: unexpected reply on %s", errBadReply, m.Subject))
		return
	}
	l.reply = l.reply[:0]
	ids, err := l.check(m)
	l.finish(now, slot, ids, l.reply, err)
}

// clientPrefix marks a subject loaded through the Go client (package
// client, which follows protocol.DirectHeader to an ordered tag's owner):
// "client:<prefix>.segment.<tag>".
const clientPrefix = "client:"

// finish records slot's reply (see record) and frees the slot.
func (l *loader) finish(now int64, slot, ids int, reply []segmentRun, err error) {
	l.record(now, slot, ids, reply, err)
	l.free <- int32(slot)
}

// record records slot's reply, received at now, holding ids IDs (reply:
// their runs, with Verify) or failed with err.
func (l *loader) record(now int64, slot, ids int, reply []segmentRun, err error) {
	t := l.targets[l.slotTgt[slot].Load()]
	lat := now - l.sent[slot].Load()
	measured := l.slotMeas[slot].Load()
	// The first reply of a window starts its clock and is not counted.
	inWindow := now >= l.winStart.Load() && now < l.winEnd.Load() && !l.winFirst.CompareAndSwap(0, now)
	t.replies.Add(1)
	if err != nil {
		t.fail(err)
	} else {
		t.mu.Lock()
		if measured {
			t.hist.record(lat)
		}
		if inWindow {
			t.ok++
			t.ids += uint64(ids)
		}
		for _, r := range reply {
			t.checked += uint64(r.Last - r.First + 1)
			if n := len(t.runs); n > 0 && t.runs[n-1].Last+1 == r.First {
				t.runs[n-1].Last = r.Last
			} else {
				t.runs = append(t.runs, r)
			}
		}
		t.mu.Unlock()
	}
}

func (t *target) fail(err error) {
	t.errsCount.Add(1)
	t.mu.Lock()
	t.errors++
	if t.firstErr == "" {
		t.firstErr = err.Error()
	}
	t.mu.Unlock()
}

// reportProgress writes a progress line to w twice a second until the
// returned function is called.
func (l *loader) reportProgress(w io.Writer) (stop func()) {
	if w == nil {
		return func() {}
	}
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		tick := time.NewTicker(500 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-done:
				return
			case <-tick.C:
			}
			i := l.cur.Load()
			t := l.targets[i]
			t.mu.Lock()
			phase, at, total := "measure", t.measured, l.cfg.Duration
			if t.warmedUp < l.cfg.Warmup {
				phase, at, total = "warmup", t.warmedUp, l.cfg.Warmup
			}
			t.mu.Unlock()
			fmt.Fprintf(w, "%s%d %s %d %d %d %d\n", progressPrefix, i, phase, at, total, t.replies.Load(), t.errsCount.Load())
		}
	}()
	return func() { close(done); wg.Wait() }
}

// connectError is the error of a failed connection to url: url masked
// (redact.URL), and without nats.go's error for a URL it cannot parse,
// which quotes the URL whole, password and all.
func connectError(prefix, url string, err error) error {
	if perr := (*neturl.Error)(nil); errors.As(err, &perr) {
		return fmt.Errorf("%sconnecting to %s: the URL does not parse: percent-encode the special characters (%%, @, :, /, space) of its user and password", prefix, redact.URL(url))
	}
	return fmt.Errorf("%sconnecting to %s: %w", prefix, redact.URL(url), err)
}
