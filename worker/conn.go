package worker

import (
	"cmp"
	"context"
	"errors"

	"github.com/nats-io/nats.go"

	"github.com/dispenser-dev/dispenser/dispenser"
	"github.com/dispenser-dev/dispenser/internal/redact"
)

// URL returns the URL of the NATS server the worker uses for requests.
func (w *Worker) URL() string {
	nc := w.conn()
	if nc == nil {
		return ""
	}
	return nc.ConnectedUrl()
}

// conn returns the connection that serves requests, or nil.
func (w *Worker) conn() *nats.Conn {
	w.connMu.Lock()
	defer w.connMu.Unlock()
	return w.nc
}

// lameDuck is told that the server of connection old enters lame-duck
// mode: it will close its clients soon, and with them the requests and
// replies in flight on them, also those of requesters on other servers.
// The worker moves first (move).
func (w *Worker) lameDuck(old *nats.Conn) {
	w.connMu.Lock()
	defer w.connMu.Unlock()
	if w.closing || old != w.nc || w.movable == nil {
		return
	}
	svc := w.movable
	w.moves.Add(1)
	go func() {
		defer w.moves.Done()
		w.move(svc, old)
	}()
}

// move serves on a new connection to another server, then closes old once
// the requests it received are answered and its replies flushed; the new
// connection's server takes requests meanwhile. If no other server takes
// the connection, the worker stays: its connection reconnects when the
// server closes it, and what was in flight on it is lost (clients retry).
func (w *Worker) move(svc *dispenser.Service, old *nats.Conn) {
	w.log.Info("nats server entering lame-duck mode: moving to another server", "url", redact.URL(old.ConnectedUrl()))
	nopts := w.nats
	nopts.URL = moveURLs(cmp.Or(w.cfg.NATS.URL, old.ConnectedUrl()), old.DiscoveredServers())
	nc, err := nopts.connect(w.cfg.Instance, false, w.log, append(inboxOption(w.cfg.InboxPrefix), nats.LameDuckModeHandler(w.lameDuck))...)
	if err != nil {
		w.log.Warn("no other nats server to move to: staying until this one closes the connection", "err", err)
		return
	}
	ctx, cancel := context.WithTimeout(w.ctx, w.cfg.ShutdownTimeout)
	defer cancel()
	moved, err := svc.Move(ctx, nc)
	if moved == nil { // not moved: stopped, or the new connection failed
		nc.Close()
		if !errors.Is(err, dispenser.ErrStopped) {
			w.log.Warn("could not move to another nats server: staying until this one closes the connection", "err", err)
		}
		return
	}
	if err != nil {
		// Moved, but the old connection did not drain in time: closing
		// it loses what it still holds.
		w.log.Warn("moved, but requests on the old connection were not all answered", "err", err)
	}
	w.connMu.Lock()
	w.nc = nc
	w.connMu.Unlock()
	old.Close()
	w.log.Info("moved", "id", svc.ID(), "url", redact.URL(nc.ConnectedUrl()))
}
