package dispenser

import (
	"math"
	"testing"
)

// TestTimedIsUnbiased: without metrics, a subscription times its first
// timedExactly requests one by one and then a sample whose weights sum,
// over many requests, to the number of requests: the processing time
// stays an estimate of the whole. With metrics every request is timed.
func TestTimedIsUnbiased(t *testing.T) {
	for _, tt := range []struct {
		name     string
		all      bool
		requests int
	}{
		{name: "metrics: every request", all: true, requests: 100_000},
		{name: "no metrics: the first ones exactly", requests: timedExactly},
		{name: "no metrics: a sample after them", requests: 2_000_000},
	} {
		t.Run(tt.name, func(t *testing.T) {
			sc := &scratch{rng: 42}
			var weights, timed int64
			for i := range tt.requests {
				w := sc.timed(tt.all)
				if w != 0 && w != 1 && w != timedEvery {
					t.Fatalf("request %d: weight %d", i, w)
				}
				if (tt.all || i < timedExactly) && w != 1 {
					t.Fatalf("request %d: weight %d, want 1 (timed one by one)", i, w)
				}
				weights += w
				if w != 0 {
					timed++
				}
			}
			got := float64(weights) / float64(tt.requests)
			if math.Abs(got-1) > 0.01 {
				t.Errorf("weights sum to %.4f per request, want 1 within 1%%", got)
			}
			if !tt.all && tt.requests > 100*timedExactly {
				// The sample is what saves the clock readings.
				if share := float64(timed) / float64(tt.requests); share > 2.0/timedEvery {
					t.Errorf("%.3f of the requests timed, want about 1/%d", share, timedEvery)
				}
			}
		})
	}
}
