package kvbucket

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// StartWait bounds how long a start-up step run by WaitReady (Open among
// them) waits out a JetStream that is not ready yet (Transient): a meta
// leader being elected, a server of the cluster restarting, so that a
// replicated bucket cannot be placed. It covers a restart of a
// nats-server and the elections after it, seconds each; a JetStream that
// stays unready longer is an outage the operator should hear of, and the
// worker exits with ErrNotReady. The caller's context ends the wait
// earlier if it ends first.
const StartWait = time.Minute

// The waits between attempts: the first, doubled after each attempt up to
// the last.
const (
	waitFirst = 100 * time.Millisecond
	waitMax   = 2 * time.Second
)

// WaitReady runs step until it returns nil or an error that is not
// Transient, which it returns as it is (a request that got no reply
// because of a permissions violation with the violation added). Between attempts it waits, from
// 100 ms doubling up to 2 s, and logs what it waits for (what, e.g.
// `bucket "x": open`) and the error. Once another wait would end after
// StartWait (an attempt under way may carry it a few seconds past: a
// request's timeout), or once ctx ends, it gives up with an error wrapping ErrNotReady and the last error,
// which says how long it waited and why it stopped; the last error, or
// the caller's wrapping, says what for. nc is the connection step uses
// (Transient's); log nil means slog.Default.
func WaitReady(ctx context.Context, nc *nats.Conn, log *slog.Logger, what string, step func() error) error {
	return waitReady(ctx, nc, log, what, StartWait, step)
}

func waitReady(ctx context.Context, nc *nats.Conn, log *slog.Logger, what string, bound time.Duration, step func() error) error {
	if log == nil {
		log = slog.Default()
	}
	t0 := time.Now()
	pause := waitFirst
	for attempt := 1; ; attempt++ {
		err := step()
		if err == nil {
			return nil
		}
		if !Transient(nc, err) {
			if last := nc.LastError(); NoReply(err) && errors.Is(last, nats.ErrPermissionViolation) {
				// The timeout alone would not say why.
				return fmt.Errorf("%w (the connection's last error: %w)", err, last)
			}
			return err
		}
		waited := time.Since(t0)
		if ctx.Err() != nil || waited+pause > bound {
			why := fmt.Sprintf("the bound of %v", bound)
			if ctx.Err() != nil {
				why = "the end of the start's context"
			}
			return fmt.Errorf("%w: waited %v (%d attempts, until %s) for JetStream to become ready: %w",
				ErrNotReady, waited.Round(time.Millisecond), attempt, why, err)
		}
		log.Warn("kvbucket: JetStream not ready; waiting", "for", what, "err", err, "attempt", attempt,
			"waited", waited.Round(time.Millisecond), "retry_in", pause, "gives_up_after", bound)
		select {
		case <-ctx.Done():
		case <-time.After(pause):
		}
		pause = min(2*pause, waitMax)
	}
}

// Transient reports whether err, of a JetStream request on nc, says that
// JetStream is not ready yet and will be on its own: a request that got
// no reply (NoReply: a timeout, no responders, while a meta or stream
// leader is elected or a server restarts), JetStream "temporarily
// unavailable" or unable to handle a request (no meta leader), or a
// replicated bucket that cannot be placed because a peer is offline or
// not known yet to a meta leader that just started ("no suitable peers
// for placement, peer offline" or "..., miscellaneous issue").
//
// Not transient: every other error, among them Check's, JetStream not
// enabled (for the server or the account), placement that fails for
// another reason (storage, tags, a cluster that does not exist), and a
// request that got no reply because nc's user may not send it or receive
// its reply (a permissions violation, which the server reports only to
// the connection: nc.LastError), or no responders from a server that
// has no JetStream at all. With nc nil, every request that got no reply
// is transient.
func Transient(nc *nats.Conn, err error) bool {
	var apiErr *jetstream.APIError
	var legacy *nats.APIError // a watch's errors come from nats.go's older JetStream API
	switch {
	case err == nil:
		return false
	case NoReply(err):
		if nc == nil {
			return true
		}
		if errors.Is(nc.LastError(), nats.ErrPermissionViolation) {
			return false
		}
		if errors.Is(err, nats.ErrNoResponders) {
			js, _ := nc.ConnectedServerJetStream()
			return js
		}
		return true
	case errors.As(err, &apiErr):
		return transientCode(apiErr.ErrorCode, apiErr.Description)
	case errors.As(err, &legacy):
		return transientCode(jetstream.ErrorCode(legacy.ErrorCode), legacy.Description)
	}
	return false
}

// transientCode reports whether JetStream's error code and description
// say that it is not ready yet (Transient).
func transientCode(code jetstream.ErrorCode, description string) bool {
	switch code {
	case jsClusterNotAvail, jsClusterNotLeader:
		return true
	case jsClusterNoPeers:
		// Placement names its reasons; these two pass once the cluster's
		// servers are back and known to the meta leader. ("miscellaneous
		// issue" is also a server's max_ha_assets reached, which does not
		// pass: waited for in vain, it fails after StartWait with the same
		// message.)
		return strings.Contains(description, "peer offline") || strings.Contains(description, "miscellaneous issue")
	}
	return false
}

// JetStream's error codes that Transient accepts (nats-server's
// JSClusterNoPeersErrF, JSClusterNotAvailErr, JSClusterNotLeaderErr).
const (
	jsClusterNoPeers   jetstream.ErrorCode = 10005
	jsClusterNotAvail  jetstream.ErrorCode = 10008
	jsClusterNotLeader jetstream.ErrorCode = 10009
)
