package snowflake

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"testing"
	"time"
)

func quiet() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

func reportRate(b *testing.B, ids int) {
	b.ReportMetric(float64(ids)/b.Elapsed().Seconds(), "ids/s")
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(ids), "ns/id")
}

// BenchmarkNext measures the hot path of one ID per call on the real clock.
// MaxBorrow is large so that the 4096 IDs/ms cap of the layout does not make
// it wait: this is the cost per call, not the sustainable rate.
func BenchmarkNext(b *testing.B) {
	g, err := New(Settings{WorkerID: 1, MaxBorrow: 365 * 24 * time.Hour, Logger: quiet()})
	if err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	for b.Loop() {
		if _, err := g.Next(); err != nil {
			b.Fatal(err)
		}
	}
	reportRate(b, b.N)
}

// BenchmarkAppendIDs measures batches appended to a reused slice.
func BenchmarkAppendIDs(b *testing.B) {
	for _, n := range []int{1, 10, 100, 1000, 10000} {
		b.Run(fmt.Sprintf("n=%d", n), func(b *testing.B) {
			g, err := New(Settings{WorkerID: 1, MaxBorrow: 365 * 24 * time.Hour, Logger: quiet()})
			if err != nil {
				b.Fatal(err)
			}
			dst := make([]int64, 0, n)
			b.ReportAllocs()
			for b.Loop() {
				if dst, err = g.AppendIDs(dst[:0], n); err != nil {
					b.Fatal(err)
				}
			}
			reportRate(b, b.N*n)
		})
	}
}

// BenchmarkNextParallel measures contention on the mutex.
func BenchmarkNextParallel(b *testing.B) {
	g, err := New(Settings{WorkerID: 1, MaxBorrow: 365 * 24 * time.Hour, Logger: quiet()})
	if err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if _, err := g.Next(); err != nil {
				b.Error(err)
				return
			}
		}
	})
	reportRate(b, b.N)
}

// BenchmarkSustained uses the default MaxBorrow: once 100 ms are borrowed
// the generator waits for the clock, so ids/s shows the sustainable rate,
// capped by the layout at 4,096,000 per second.
func BenchmarkSustained(b *testing.B) { benchSustained(b, DefaultLayout) }

// benchSustained takes 100 IDs at a time from a generator in layout, as
// fast as it gives them, and reports the rate.
func benchSustained(b *testing.B, layout Layout) {
	g, err := New(Settings{WorkerID: 1, Layout: layout, Logger: quiet()})
	if err != nil {
		b.Fatal(err)
	}
	dst := make([]int64, 0, 100)
	b.ReportAllocs()
	for b.Loop() {
		if dst, err = g.AppendIDs(dst[:0], 100); err != nil {
			b.Fatal(err)
		}
	}
	reportRate(b, b.N*100)
}

// BenchmarkSustainedJS is BenchmarkSustained in JSLayout: capped by the
// layout at 128,000 IDs per second.
func BenchmarkSustainedJS(b *testing.B) { benchSustained(b, JSLayout) }

// BenchmarkWorkerAppendIDs issues through a leased Node (embedded NATS,
// default lease and borrowing): the lease adds a check per call.
func BenchmarkWorkerAppendIDs(b *testing.B) {
	js := newJetStream(b)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	w, err := Start(ctx, js, NodeSettings{Instance: "bench", Settings: Settings{Logger: quiet()}})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = w.Close(context.Background()) })
	dst := make([]int64, 0, 100)
	b.ReportAllocs()
	for b.Loop() {
		if dst, err = w.AppendIDs(dst[:0], 100); err != nil {
			b.Fatal(err)
		}
	}
	reportRate(b, b.N*100)
}
