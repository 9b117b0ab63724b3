package bench

import (
	"math"
	"math/bits"
)

// LatencyStats are percentiles of the round trips of a run, in µs.
type LatencyStats struct {
	P50  float64 `json:"p50"`
	P90  float64 `json:"p90"`
	P99  float64 `json:"p99"`
	P999 float64 `json:"p999"`
	Max  float64 `json:"max"`
	Mean float64 `json:"mean"`
}

// histogram counts latencies in nanoseconds in log-linear buckets: exact
// below 256 ns, then histSub buckets per power of two, so that a percentile
// is off by at most 1/256 (0.4%). Values from 2^40 ns (18 minutes) up share
// the last bucket. The zero value is empty; it does not allocate.
type histogram struct {
	counts [histBuckets]uint64
	n      uint64
	sum    float64
	max    int64
}

const (
	histSub     = 128
	histMaxBits = 40
	histBuckets = (histMaxBits - 6) * histSub
)

func histIndex(v int64) int {
	if v < 2*histSub {
		return int(max(v, 0))
	}
	v = min(v, 1<<histMaxBits-1)
	e := bits.Len64(uint64(v)) - 8 // v>>e is in [histSub, 2*histSub)
	return (e+1)*histSub + int(v>>e) - histSub
}

// histValue returns the middle of bucket i.
func histValue(i int) int64 {
	if i < 2*histSub {
		return int64(i)
	}
	e := i/histSub - 1
	m := int64(i%histSub + histSub)
	return m<<e + (1<<e)/2
}

func (h *histogram) record(ns int64) {
	h.counts[histIndex(ns)]++
	h.n++
	h.sum += float64(ns)
	h.max = max(h.max, ns)
}

// quantile returns the value at quantile q in ns: the middle of the bucket
// holding the ceil(q*n)-th value, at most the maximum.
func (h *histogram) quantile(q float64) int64 {
	if h.n == 0 {
		return 0
	}
	rank := uint64(math.Ceil(q * float64(h.n)))
	rank = max(rank, 1)
	var seen uint64
	for i, c := range h.counts {
		if seen += c; seen >= rank {
			return min(histValue(i), h.max)
		}
	}
	return h.max
}

func (h *histogram) stats() LatencyStats {
	us := func(ns int64) float64 { return math.Round(float64(ns)/10) / 100 }
	s := LatencyStats{
		P50:  us(h.quantile(0.50)),
		P90:  us(h.quantile(0.90)),
		P99:  us(h.quantile(0.99)),
		P999: us(h.quantile(0.999)),
		Max:  us(h.max),
	}
	if h.n > 0 {
		s.Mean = us(int64(h.sum / float64(h.n)))
	}
	return s
}
