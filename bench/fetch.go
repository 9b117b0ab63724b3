package bench

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/dispenser-dev/dispenser/segment/postgres"
	"github.com/dispenser-dev/dispenser/segment/witness"
	"github.com/dispenser-dev/dispenser/tagmodel"
	"github.com/dispenser-dev/dispenser/worker/pgstore"
)

// fetchTag is the tag whose fetches the fetch run times; no request
// uses it.
const fetchTag = "bench_fetch"

// FetchResult compares the latency of a segment fetch from PostgreSQL alone
// with one through the witness (PostgreSQL, then one KV compare-and-swap).
type FetchResult struct {
	Fetches      int     `json:"fetches"` // of each kind
	PlainP50US   float64 `json:"plain_p50_us"`
	PlainP99US   float64 `json:"plain_p99_us"`
	WitnessP50US float64 `json:"witness_p50_us"`
	WitnessP99US float64 `json:"witness_p99_us"`
}

// measureFetch times n fetches of each kind, alternating, so that noise
// from the rest of the machine falls on both alike.
func (e *env) measureFetch(ctx context.Context, postgresURL string, n int) (*FetchResult, error) {
	pool, err := pgstore.Connect(ctx, postgresURL)
	if err != nil {
		return nil, err
	}
	defer pool.Close()
	pg := postgres.New(pool)
	if err := ensureTag(ctx, pg, fetchTag, 100); err != nil {
		return nil, err
	}
	w, err := witness.Open(ctx, e.js, pg, witness.Settings{})
	if err != nil {
		return nil, err
	}
	var plain, witnessed []float64
	for i := range 2 * n {
		var st tagmodel.Store = pg
		if i%2 == 1 {
			st = w
		}
		t0 := time.Now()
		if _, err := st.Fetch(ctx, fetchTag, 0); err != nil {
			return nil, fmt.Errorf("fetch %s: %w", fetchTag, err)
		}
		us := float64(time.Since(t0).Microseconds())
		if i%2 == 1 {
			witnessed = append(witnessed, us)
		} else {
			plain = append(plain, us)
		}
	}
	slices.Sort(plain)
	slices.Sort(witnessed)
	q := func(xs []float64, p float64) float64 { return xs[min(len(xs)-1, int(p*float64(len(xs))))] }
	return &FetchResult{
		Fetches:    n,
		PlainP50US: q(plain, 0.5), PlainP99US: q(plain, 0.99),
		WitnessP50US: q(witnessed, 0.5), WitnessP99US: q(witnessed, 0.99),
	}, nil
}
