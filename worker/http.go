package worker

import (
	"errors"
	"fmt"
	"net"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/dispenser-dev/dispenser/segment"
)

// SegmentStats returns the allocator's state of every tag.
func (w *Worker) SegmentStats() []segment.TagStats {
	if w.alloc == nil {
		return nil
	}
	return w.alloc.Stats()
}

// serveHTTP serves /metrics, /healthz, /readyz and the status page
// /status on Config.MetricsAddr.
func (w *Worker) serveHTTP(reg *prometheus.Registry) error {
	ln, err := net.Listen("tcp", w.cfg.MetricsAddr)
	if err != nil {
		return fmt.Errorf("--metrics-addr: %w", err)
	}
	// dispenser_ready mirrors /readyz for alerts and dashboards: 1 when a
	// readiness check made at scrape time passes.
	ready := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "dispenser_ready",
		Help: "1 when the worker is ready to serve (as /readyz: both NATS connections up, a valid snowflake lease, the store reachable or IDs in memory), else 0.",
	}, func() float64 {
		if w.ready(w.ctx) != nil {
			return 0
		}
		return 1
	})
	if err := reg.Register(ready); err != nil {
		ln.Close()
		return fmt.Errorf("registering dispenser_ready: %w", err)
	}
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	mux.HandleFunc("GET /healthz", func(rw http.ResponseWriter, _ *http.Request) {
		fmt.Fprintln(rw, "ok")
	})
	mux.HandleFunc("GET /status", w.serveStatus)
	mux.HandleFunc("GET /readyz", func(rw http.ResponseWriter, r *http.Request) {
		if err := w.ready(r.Context()); err != nil {
			// The page names the part only: the error may name hosts and
			// users (a store's), and anyone reaching the port reads it.
			w.logNotReady(err)
			http.Error(rw, "not ready: "+err.part+"\n"+w.serving(), http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(rw, "ready\n"+w.serving())
	})
	w.http, ln = w.cfg.HTTP.serve(ln, mux, w.ctx)
	w.httpDone = make(chan struct{})
	go func() {
		defer close(w.httpDone)
		if err := w.http.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			w.log.Error("metrics server", "err", err)
		}
	}()
	w.httpAddr = ln.Addr().String()
	w.log.Info("metrics and health", "addr", w.httpAddr)
	return nil
}

// serving is /readyz's line of the endpoints the worker is in the queue
// group of, and those it has left until it can serve them
// (docs/reliability.md, "A worker that cannot serve is not asked"):
// "serving: segment snowflake_decode; left: snowflake".
func (w *Worker) serving() string {
	var in, out []string
	for name, ok := range w.svc.Serving() {
		if ok {
			in = append(in, name)
		} else {
			out = append(out, name)
		}
	}
	slices.Sort(in)
	slices.Sort(out)
	line := "serving: " + strings.Join(in, " ")
	if len(out) > 0 {
		line += "; left: " + strings.Join(out, " ")
	}
	return line
}

// fetchHistogram registers the segment fetch latency histogram and returns
// the allocator hook that feeds it.
func fetchHistogram(reg prometheus.Registerer) func(string, time.Duration, error) {
	h := prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    "dispenser_segment_fetch_duration_seconds",
		Help:    "Latency of segment fetches from the store, by result.",
		Buckets: prometheus.ExponentialBuckets(250e-6, 2, 14),
	}, []string{"result"})
	reg.MustRegister(h)
	ok, failed := h.WithLabelValues("ok"), h.WithLabelValues("error")
	return func(_ string, d time.Duration, err error) {
		if err != nil {
			failed.Observe(d.Seconds())
			return
		}
		ok.Observe(d.Seconds())
	}
}
