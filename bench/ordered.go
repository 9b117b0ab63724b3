package bench

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/dispenser-dev/dispenser/segment"
	"github.com/dispenser-dev/dispenser/tagmodel"
	"github.com/dispenser-dev/dispenser/worker"
)

// The ordered run (issue 11): workers of the service under test in this
// process, in a queue group and under a prefix of their own, serve an
// ordered tag and a plain tag of the same step. Two load runs load the
// baseline, the ordered tag and the plain tag in turn: first with one
// worker, the owner alone, then with three, over which the queue group
// spreads the requests: for the ordered tag the owner allocates and the
// other two forward to it, in batches, what reaches them (the three-worker
// run loads the ordered tag a second time through the Go client, which
// follows the owner's Id-Direct header and sends to it directly); for the plain tag
// each allocates from its own segments. The ordered tag against the baseline with three workers is the
// target; against the plain tag, and against the owner alone, the cost of
// forwarding.

// Names of the ordered run.
const (
	orderedPrefix  = "benchord"
	orderedWorkers = 3
	tagOrdered     = "bench_ordered"
	tagPlain       = "bench_ordered_plain"
	// clientBaselinePrefix is the prefix under which the baseline
	// responder answers the Go client's segment requests.
	clientBaselinePrefix = "benchbase"
)

// OrderedResult sums up the ordered run; the runs themselves are in the
// report's runs (mode "ordered").
type OrderedResult struct {
	Workers  int `json:"workers"`
	Inflight int `json:"inflight"`
	// VsBaseline and PlainVsBaseline are the ordered and the plain tag's
	// requests/s over the baseline's; VsPlain the ordered tag's over the
	// plain tag's (the cost of forwarding and of one allocating worker).
	VsBaseline      float64 `json:"vs_baseline"`
	PlainVsBaseline float64 `json:"plain_vs_baseline"`
	VsPlain         float64 `json:"vs_plain"`
	// ForwardP50US is the ordered tag's p50 minus the plain tag's.
	ForwardP50US float64 `json:"forward_p50_us"`
	// ClientVsBaseline is the ordered tag's requests/s through the Go
	// client (which sends to the owner's direct subject, protocol.
	// DirectHeader) over the baseline responder's through the Go client;
	// ClientP50US its p50 minus the plain NATS client's on the ordered
	// tag. Zero without that run.
	ClientVsBaseline float64 `json:"client_vs_baseline,omitempty"`
	ClientP50US      float64 `json:"client_p50_us,omitempty"`
	// ClientVsRaw is the ordered tag's requests/s through the Go client
	// over a raw nc.RequestWithContext's to the baseline responder, by as
	// many callers: what a user compares the Go client with (issue 38).
	ClientVsRaw float64 `json:"client_vs_raw,omitempty"`
	// AloneVsBaseline is the ordered tag's requests/s over the baseline's
	// with the owner alone (mode "ordered_alone"); VsAlone is VsBaseline
	// over it (each against the baseline of its own load run).
	AloneVsBaseline float64 `json:"alone_vs_baseline,omitempty"`
	VsAlone         float64 `json:"vs_alone,omitempty"`
}

// orderedSet is the three workers of the ordered run.
type orderedSet []*worker.Worker

// Close stops the workers.
func (ws orderedSet) Close() error {
	var errs []error
	for _, w := range ws {
		errs = append(errs, w.Close())
	}
	return errors.Join(errs...)
}

// orderedTags creates the ordered run's tags: the ordered one through
// Admin.CreateTag with Tag.Ordered, the plain one as any tag.
func (e *env) orderedTags(ctx context.Context, postgresURL string) error {
	st, closeStore, err := e.openStore(ctx, postgresURL)
	if err != nil {
		return err
	}
	defer closeStore()
	if err := ensureTag(ctx, st, tagPlain, tagStep); err != nil {
		return err
	}
	return ensureOrderedTag(ctx, st, tagOrdered, tagStep)
}

// startOrdered starts workers from+1 through to of the ordered run and
// takes IDs of both tags, so that the ordered tag has an owner (the first
// worker started) and the new workers are likely to have seen both tags
// before the load.
func (e *env) startOrdered(ctx context.Context, postgresURL string, maxWait time.Duration, log *slog.Logger, from, to int) (_ orderedSet, err error) {
	var ws orderedSet
	defer func() {
		if err != nil {
			ws.Close()
		}
	}()
	for i := from; i < to; i++ {
		w, err := startWorker(ctx, workerSettings{
			NATSURL:     e.url,
			Instance:    fmt.Sprintf("bench-ordered-%d", i+1),
			PostgresURL: postgresURL,
			Prefix:      orderedPrefix,
			QueueGroup:  orderedPrefix,
			Segment:     segment.Settings{MaxStep: localMaxStep, MaxWait: maxWait},
			Log:         log,
		})
		if err != nil {
			return ws, fmt.Errorf("ordered worker %d: %w", i+1, err)
		}
		ws = append(ws, w)
	}
	for _, tag := range []string{tagOrdered, tagPlain} {
		for range to {
			if _, err := requestID(ctx, e.ctlNC, orderedPrefix+".segment."+tag, 15*time.Second); err != nil {
				return ws, fmt.Errorf("warming %s: %w", tag, err)
			}
		}
	}
	return ws, nil
}

// ensureOrderedTag creates an ordered tag with step, or makes an existing
// tag ordered with step.
func ensureOrderedTag(ctx context.Context, store tagmodel.Store, name string, step int64) error {
	admin, ok := store.(tagmodel.Admin)
	if !ok {
		return fmt.Errorf("the store cannot create tags (%T)", store)
	}
	err := admin.CreateTag(ctx, tagmodel.Tag{Name: name, Step: step, MaxID: 1, Ordered: true, Description: "dispenser bench, ordered"})
	if errors.Is(err, tagmodel.ErrTagExists) {
		var t tagmodel.Tag
		if t, err = store.Tag(ctx, name); err == nil && (!t.Ordered || t.Step != step) {
			ordered := true
			err = admin.UpdateTag(ctx, name, tagmodel.Update{Step: &step, Ordered: &ordered})
		}
	}
	if err != nil {
		return fmt.Errorf("creating ordered tag %s: %w", name, err)
	}
	return nil
}

// orderedSummary sums up the ordered runs of runs; nil without them.
func orderedSummary(runs []*Result) *OrderedResult {
	var base, ord, plain, viaClient, baseClient, baseRaw, aloneBase, alone *Result
	for _, r := range runs {
		if r.Mode == "ordered_alone" {
			switch r.Endpoint {
			case "baseline":
				aloneBase = r
			case "ordered":
				alone = r
			}
		}
		if r.Mode != "ordered" {
			continue
		}
		switch r.Endpoint {
		case "baseline":
			base = r
		case "ordered":
			ord = r
		case "plain":
			plain = r
		case "ordered_client":
			viaClient = r
		case "baseline_client":
			baseClient = r
		case "baseline_raw":
			baseRaw = r
		}
	}
	if base == nil || ord == nil || plain == nil || base.RPS <= 0 || plain.RPS <= 0 {
		return nil
	}
	o := &OrderedResult{
		Workers:         orderedWorkers,
		Inflight:        ord.Inflight,
		VsBaseline:      round(ord.RPS/base.RPS, 3),
		PlainVsBaseline: round(plain.RPS/base.RPS, 3),
		VsPlain:         round(ord.RPS/plain.RPS, 3),
		ForwardP50US:    round(ord.Latency.P50-plain.Latency.P50, 1),
	}
	if viaClient != nil && baseClient != nil && baseClient.RPS > 0 {
		o.ClientVsBaseline = round(viaClient.RPS/baseClient.RPS, 3)
		o.ClientP50US = round(viaClient.Latency.P50-ord.Latency.P50, 1)
	}
	if viaClient != nil && baseRaw != nil && baseRaw.RPS > 0 {
		o.ClientVsRaw = round(viaClient.RPS/baseRaw.RPS, 3)
	}
	if aloneBase != nil && alone != nil && aloneBase.RPS > 0 && alone.RPS > 0 {
		o.AloneVsBaseline = round(alone.RPS/aloneBase.RPS, 3)
		o.VsAlone = round(ord.RPS/base.RPS/o.AloneVsBaseline, 3)
	}
	return o
}
