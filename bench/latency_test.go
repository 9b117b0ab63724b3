package bench

import (
	"testing"
)

func TestLatencies(t *testing.T) {
	h := newLatencies()
	for v := int64(1); v <= 100_000; v++ {
		h.record(v * 1000) // 1µs .. 100ms
	}
	for _, tt := range []struct{ q, want float64 }{{0.5, 50_000}, {0.99, 99_000}, {0.999, 99_900}} {
		got := float64(h.quantile(tt.q)) / 1000
		if got < tt.want*0.995 || got > tt.want*1.005 {
			t.Errorf("quantile %v = %vµs, want %vµs ± 0.5%%", tt.q, got, tt.want)
		}
	}
	if s := h.stats(); s.Max != 100_000 || s.Mean < 50_000 || s.Mean > 50_001 {
		t.Errorf("stats %+v", s)
	}
	// Every value, from 0 to beyond the range (clamped to latencyMax),
	// comes back within 0.5%: the median of v, v and 2v, which the maximum
	// does not cap.
	for _, v := range []int64{0, 1, 255, 256, 257, 1 << 20, 1<<40 - 1, 1 << 50} {
		h := newLatencies()
		h.record(v)
		h.record(v)
		h.record(2 * v)
		want := min(v, latencyMax)
		if got := h.quantile(0.5); got < want-want/200-1 || got > want+want/200+1 {
			t.Errorf("median of %d, %d, %d = %d: off by more than 0.5%% from %d", v, v, 2*v, got, want)
		}
	}
	neg := newLatencies()
	neg.record(-5)
	if neg.quantile(1) != 0 || neg.count() != 1 {
		t.Errorf("a negative round trip is recorded as %d (%d values), want 0", neg.quantile(1), neg.count())
	}
	if n := testing.AllocsPerRun(100, func() { h.record(12345) }); n != 0 {
		t.Errorf("record allocates %v times", n)
	}
}

// BenchmarkLatencyRecord is the cost of timing one reply in the load
// generator: round trips between 50µs and 5ms.
func BenchmarkLatencyRecord(b *testing.B) {
	h := newLatencies()
	var v int64 = 50_000
	for b.Loop() {
		h.record(v)
		if v += 7919; v > 5_000_000 {
			v = 50_000
		}
	}
}
