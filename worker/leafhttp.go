package worker

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"

	"github.com/nats-io/nats.go"

	"github.com/dispenser-dev/dispenser/client"
	"github.com/dispenser-dev/dispenser/dispenser"
	"github.com/dispenser-dev/dispenser/leafhttp"
	"github.com/dispenser-dev/dispenser/protocol"
	"github.com/dispenser-dev/dispenser/segment"
)

// serveLeaf serves Leaf's HTTP API (package leafhttp) on Config.HTTPAddr,
// from the worker's allocator and snowflake generator. Ordered tags are
// asked of the worker's own service over NATS, on a connection of their
// own to the server of nopts (leafOrdered).
func (w *Worker) serveLeaf(nopts NATS) error {
	ln, err := net.Listen("tcp", w.cfg.HTTPAddr)
	if err != nil {
		return fmt.Errorf("--http-addr: %w", err)
	}
	nc, err := nopts.connect(w.cfg.Instance+"-http", false, w.log, inboxOption(w.cfg.InboxPrefix)...)
	if err != nil {
		ln.Close()
		return err
	}
	w.leafNC = nc
	// WithoutDirect: the connection needs permission to publish to
	// <prefix>.segment.> only, not to the owners' direct subjects.
	c, err := client.New(nc, client.WithPrefix(w.cfg.Prefix), client.WithoutDirect())
	if err != nil {
		ln.Close()
		return err
	}
	s := leafhttp.Settings{
		Segments: w.alloc,
		Ordered:  leafOrdered{c},
		Rows:     w.store.Store,
		Classify: w.classify,
		MaxBatch: w.cfg.MaxBatch,
		Logger:   w.log,
	}
	if w.sf != nil {
		s.Snowflake = w.sf
	}
	if w.cfg.MetricsAddr != "" { // the service's metrics, transport="http"
		s.Observe = w.svc.ObserveHTTP
	}
	h, err := leafhttp.New(s)
	if err != nil {
		ln.Close()
		return err
	}
	w.leaf, ln = w.cfg.HTTP.serve(ln, h, w.ctx)
	w.leafDone = make(chan struct{})
	go func() {
		defer close(w.leafDone)
		if err := w.leaf.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			w.log.Error("leaf http server", "err", err)
		}
	}()
	w.leafAddr = ln.Addr().String()
	w.log.Info("leaf http api", "addr", w.leafAddr)
	return nil
}

// LeafAddr returns the address Leaf's HTTP API is served on
// (Config.HTTPAddr with its port), or "" without it.
func (w *Worker) LeafAddr() string { return w.leafAddr }

// classify maps an error of Leaf's HTTP API to a reply code: the service's
// Classify, but for the error replies of the service itself (an ordered
// tag asked over NATS), which carry their code already.
func (w *Worker) classify(err error) (code, desc string) {
	var ce *client.Error
	if errors.As(err, &ce) {
		return ce.Code, ce.Description
	}
	return w.svc.Classify(err)
}

// leafOrdered takes IDs of ordered tags for Leaf's HTTP API as any client
// does: a request on <prefix>.segment.<tag>, which the queue group's
// worker forwards to the tag's owner, so that the IDs are linearizably
// increasing as for every requester.
type leafOrdered struct{ c *client.Client }

func (o leafOrdered) Take(ctx context.Context, tag string, n int) ([]segment.Run, error) {
	ids, err := o.c.SegmentN(ctx, tag, n)
	var ce *client.Error
	switch {
	case err == nil:
		return protocol.Runs(nil, ids), nil
	case errors.As(err, &ce):
		return nil, err
	case errors.Is(err, nats.ErrNoResponders), errors.Is(err, context.DeadlineExceeded), errors.Is(err, nats.ErrTimeout):
		// No worker answered in time: the owner is moving (503).
		return nil, fmt.Errorf("%w: %w", dispenser.ErrOwnershipMoving, err)
	}
	return nil, err
}
