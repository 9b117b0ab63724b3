package bench

import "testing"

func TestHistogram(t *testing.T) {
	var h histogram
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
	for _, v := range []int64{0, 1, 255, 256, 257, 1 << 20, 1<<40 - 1, 1 << 50} {
		i := histIndex(v)
		if i < 0 || i >= histBuckets {
			t.Fatalf("histIndex(%d) = %d out of range", v, i)
		}
		if mid := histValue(i); v < 1<<40 && (mid < v-v/200-1 || mid > v+v/200+1) {
			t.Errorf("histValue(histIndex(%d)) = %d: off by more than 0.5%%", v, mid)
		}
	}
	if n := testing.AllocsPerRun(100, func() { h.record(12345) }); n != 0 {
		t.Errorf("record allocates %v times", n)
	}
}
