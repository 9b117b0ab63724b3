package bench

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/dispenser-dev/dispenser/segment"
)

// The burst run (issue 24): two workers of the service under test in this
// process, under a prefix and in a queue group of their own, pinned at
// their tags' steps (--max-step 100), serve a tag of step 100 that neither
// has served yet and a warm tag of step 100,000. One load run loads the
// small-step tag first, from cold, then both in turn: the small step keeps
// up with the burst only through the multi-step fetch (see package
// segment), which the run measures against the large step.

// Names of the burst run.
const (
	burstPrefix    = "benchburst"
	burstWorkers   = 2
	tagBurstSmall  = "bench_burst_step100"
	tagBurstLarge  = "bench_burst_step100k"
	burstSmallStep = 100
	burstLargeStep = 100_000
)

// BurstResult sums up the burst run; the run itself is in the report's
// runs (mode "burst").
type BurstResult struct {
	Workers  int `json:"workers"`
	Inflight int `json:"inflight"`
	// VsLarge is the small step's requests/s over the large step's,
	// P999Ratio its p999 over the large step's.
	VsLarge   float64 `json:"vs_large"`
	P999Ratio float64 `json:"p999_ratio"`
	// Fetches and Waits are the small-step tag's store fetches and the
	// requests that found both its buffers empty, over both workers.
	Fetches int64 `json:"fetches"`
	Waits   int64 `json:"waits"`
	// Depth is the largest depth the small-step tag's last fetch had in a
	// worker.
	Depth int64 `json:"depth"`
}

// runBurst runs the burst run.
func runBurst(ctx context.Context, c Config, e *env, log *slog.Logger, p *progress, run func(*group) error, rep *Report) (err error) {
	p.note(fmt.Sprintf("burst: %d workers, a cold tag of step %d and a warm one of step %d", burstWorkers, burstSmallStep, burstLargeStep))
	st, closeStore, err := e.openStore(ctx, c.PostgresURL)
	if err != nil {
		return err
	}
	defer closeStore()
	if err := ensureTag(ctx, st, tagBurstSmall, burstSmallStep); err != nil {
		return err
	}
	if err := ensureTag(ctx, st, tagBurstLarge, burstLargeStep); err != nil {
		return err
	}
	var ws orderedSet
	defer func() {
		if cerr := ws.Close(); err == nil && cerr != nil {
			err = fmt.Errorf("stopping the burst workers: %w", cerr)
		}
	}()
	for i := range burstWorkers {
		w, err := startWorker(ctx, workerSettings{
			NATSURL:     e.url,
			Instance:    fmt.Sprintf("bench-burst-%d", i+1),
			PostgresURL: c.PostgresURL,
			Prefix:      burstPrefix,
			QueueGroup:  burstPrefix,
			Segment:     segment.Settings{MaxStep: localMaxStep, MaxWait: e.maxWait},
			Log:         log,
		})
		if err != nil {
			return fmt.Errorf("burst worker %d: %w", i+1, err)
		}
		ws = append(ws, w)
	}
	// Warm the large step in both workers (the queue group picks one at
	// random per request); the small one stays cold.
	for range 8 * burstWorkers {
		if _, err := requestID(ctx, e.ctlNC, burstPrefix+".segment."+tagBurstLarge, 15*time.Second); err != nil {
			return fmt.Errorf("warming %s: %w", tagBurstLarge, err)
		}
	}
	eps := []endpoint{
		{fmt.Sprintf("step %d, cold", burstSmallStep), burstPrefix + ".segment." + tagBurstSmall},
		{fmt.Sprintf("step %d, warm", burstLargeStep), burstPrefix + ".segment." + tagBurstLarge},
	}
	g := newGroup("burst", fmt.Sprintf("burst, %d workers, %d in flight, 1 ID", burstWorkers, c.Inflight), c.Inflight, 1, "list", eps)
	if err := run(g); err != nil {
		return err
	}
	small, large := g.runs[0], g.runs[1]
	if large.RPS <= 0 || large.Latency.P999 <= 0 {
		return errors.New("the large-step tag answered nothing")
	}
	b := &BurstResult{
		Workers:   burstWorkers,
		Inflight:  c.Inflight,
		VsLarge:   round(small.RPS/large.RPS, 3),
		P999Ratio: round(small.Latency.P999/large.Latency.P999, 2),
	}
	for _, w := range ws {
		for _, s := range w.SegmentStats() {
			if s.Tag == tagBurstSmall {
				b.Fetches += s.Fetches
				b.Waits += s.Waits
				b.Depth = max(b.Depth, s.Depth)
			}
		}
	}
	rep.Burst = b
	return nil
}
