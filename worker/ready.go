package worker

import (
	"context"
	"fmt"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/dispenser-dev/dispenser/snowflake"
)

// notReady says which part of a worker is not ready (part: "nats",
// "snowflake" or "store", what /readyz shows) and why (err, only logged).
type notReady struct {
	part string
	err  error
}

func (e *notReady) Error() string { return e.part + ": " + e.err.Error() }
func (e *notReady) Unwrap() error { return e.err }

// readyLogEvery bounds how often /readyz logs why the worker is not
// ready: a probe, or anyone reaching the port, may ask many times a
// second.
const readyLogEvery = 10 * time.Second

// logNotReady logs why the worker is not ready, at most every
// readyLogEvery.
func (w *Worker) logNotReady(err *notReady) {
	now := time.Now().UnixNano()
	last := w.readyLogged.Load()
	if last != 0 && now-last < int64(readyLogEvery) || !w.readyLogged.CompareAndSwap(last, now) {
		return
	}
	w.log.Warn("not ready", "part", err.part, "err", err.err)
}

// ready reports why the worker cannot serve, or nil: it must be connected
// to NATS (both connections), hold a valid snowflake lease, and its store
// must answer or its buffers hold IDs.
func (w *Worker) ready(ctx context.Context) *notReady {
	for _, nc := range []*nats.Conn{w.conn(), w.jsnc} {
		if !nc.IsConnected() {
			return &notReady{"nats", fmt.Errorf("connection %s", nc.Status())}
		}
	}
	if w.sf != nil {
		st, _ := w.sf.Stats().(snowflake.NodeStats)
		if !st.Held || st.Fenced || st.ClockBehind {
			return &notReady{"snowflake", fmt.Errorf("lease held %v, fenced %v, clock behind %v", st.Held, st.Fenced, st.ClockBehind)}
		}
	}
	if w.alloc == nil {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	pinger, ok := w.store.Store.(interface{ Ping(context.Context) error })
	if !ok {
		return nil
	}
	err := pinger.Ping(ctx)
	if err == nil {
		return nil
	}
	if w.alloc.Totals().Remaining > 0 {
		return nil // warm buffers keep serving while the store is away
	}
	return &notReady{"store", fmt.Errorf("unreachable and no warm buffers: %w", err)}
}
