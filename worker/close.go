package worker

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"
)

// Close shuts the worker down in order: the metrics server, Leaf's HTTP
// API, the ordered
// tags' leases (handed over at once), the service (answering requests in
// flight), the allocator (giving segments back), the snowflake lease, then
// the store, the connections and the embedded nats-server. It waits at
// most Config.ShutdownTimeout for the graceful part. Calls after the first
// return its result.
func (w *Worker) Close() error {
	w.closeOnce.Do(func() { w.closeErr = w.close() })
	return w.closeErr
}

func (w *Worker) close() error {
	t0 := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), w.cfg.ShutdownTimeout)
	defer cancel()
	var errs []error
	if w.http != nil {
		errs = append(errs, w.http.Shutdown(ctx))
		<-w.httpDone
	}
	if w.leaf != nil {
		// Requests in flight are answered first; none comes after.
		errs = append(errs, w.leaf.Shutdown(ctx))
		<-w.leafDone
	}
	if w.leafNC != nil {
		w.leafNC.Close()
	}
	w.cancel() // a move in progress stops waiting
	w.connMu.Lock()
	w.closing = true
	w.connMu.Unlock()
	w.moves.Wait()
	if w.owners != nil {
		// Hand ordered tags over at once: stop serving them, release the
		// leases, claim none. Requests for them from here on go to the
		// new owners, those this worker still receives until its
		// endpoints stop included: it keeps following the owners until
		// then (closing the leases here made each of those wait for an
		// owner it could no longer see, and fail 503 after 2 s).
		owned := w.owners.Stats().Owned
		w.owners.HandOver()
		if len(owned) > 0 {
			w.log.Info("released ordered tags to the other workers", "count", len(owned), "tags", cutList(owned, 10))
		}
	}
	if w.svc != nil {
		errs = append(errs, w.svc.Stop(ctx))
	}
	if w.owners != nil {
		w.owners.Close()
	}
	// Giving segments back and releasing the lease only save IDs and time
	// for a successor; failing them (store or NATS down) is safe, so it is
	// logged, not a failed shutdown.
	if w.alloc != nil {
		if err := w.alloc.Close(ctx); err != nil {
			w.log.Warn("segments not given back; their unissued IDs are skipped", "err", err)
		}
	}
	if w.sf != nil {
		if err := w.sf.Close(ctx); err != nil {
			w.log.Warn("snowflake lease not released; a successor waits for it to expire", "err", err)
		}
	}
	if nc := w.conn(); nc != nil {
		nc.Close()
	}
	if w.jsnc != nil {
		w.jsnc.Close()
	}
	if w.store != nil && w.store.Close != nil {
		w.store.Close()
	}
	if w.ns != nil {
		w.ns.Close() // after its clients; releases the data directory last
	}
	err := errors.Join(errs...)
	switch {
	case w.svc == nil: // it never served: New failed, and says why
	case err != nil:
		w.log.Warn("stopped; the graceful part of the shutdown failed", "shutdown", time.Since(t0).Round(time.Millisecond), "err", err)
	default:
		w.log.Info("stopped", "shutdown", time.Since(t0).Round(time.Millisecond))
	}
	return err
}

// cutList writes up to n names, then how many more there are.
func cutList(names []string, n int) string {
	if len(names) <= n {
		return strings.Join(names, ", ")
	}
	return strings.Join(names[:n], ", ") + fmt.Sprintf(" and %d more", len(names)-n)
}
