package client

import (
	"context"
	"errors"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/dispenser-dev/dispenser/protocol"
)

// One attempt of a request, its bounds and whether it may be retried.

// epoch is an attempt context shared by the attempts of one request
// object (request.attemptContext) that start before until (unix
// nanoseconds): it ends AttemptTimeout+attemptSlack after until-attemptSlack,
// its start, so that each of them waits at least AttemptTimeout and at most
// AttemptTimeout+attemptSlack.
type epoch struct {
	ctx    context.Context
	cancel context.CancelFunc // called when the next one replaces it
	until  int64
}

// requestEnded returns why a request with ctx and deadline may not try
// again: ctx's error, or context.DeadlineExceeded at the deadline; nil
// while it may.
func requestEnded(ctx context.Context, deadline time.Time) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if !time.Now().Before(deadline) {
		return context.DeadlineExceeded
	}
	return nil
}

// attemptContext returns a context that ends between AttemptTimeout and
// AttemptTimeout+attemptSlack from now and is never canceled otherwise,
// for an attempt of r whose own context never ends: one context (and one
// timer) per request object and attemptSlack, not one per attempt. It is
// the request object's, not the client's: a context shared by every
// caller makes them all wait on one channel, whose lock they then
// contend for (the client's largest cost before, with 256 callers).
func (r *request) attemptContext(now time.Time) context.Context {
	if e := &r.epoch; e.ctx != nil && now.UnixNano() < e.until {
		return e.ctx
	}
	if r.epoch.cancel != nil {
		r.epoch.cancel() // no attempt uses it: r's attempts come one at a time
	}
	ctx, cancel := context.WithTimeout(context.Background(), AttemptTimeout+attemptSlack)
	r.epoch = epoch{ctx: ctx, cancel: cancel, until: now.Add(attemptSlack).UnixNano()}
	return ctx
}

// attempt sends r's message at now and waits for the reply until deadline (ctx's
// own if not own) and, if bounded, for at most AttemptTimeout (see
// attemptSlack). It makes no context of its own unless it must: when
// ctx's deadline bounds the attempt, ctx is enough; when ctx is never
// canceled (no Done channel), a shared attempt context (attemptContext) or,
// near the deadline, r's timer is. A timeout is context.DeadlineExceeded.
func (c *Client) attempt(ctx context.Context, r *request, now, deadline time.Time, own, bounded bool) (*nats.Msg, error) {
	wait := deadline.Sub(now)
	if wait <= 0 {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		return nil, context.DeadlineExceeded
	}
	cut := own // the attempt must end before ctx does
	shared := false
	if bounded && wait > AttemptTimeout {
		// The shared attempt context ends before the deadline only if
		// the deadline is more than AttemptTimeout+attemptSlack away.
		wait, cut, shared = AttemptTimeout, true, wait > AttemptTimeout+attemptSlack
	}
	var resp *nats.Msg
	var err error
	switch {
	case !cut:
		if resp, err = r.exchange(ctx.Done(), nil); err == errAttemptEnded {
			err = ctx.Err()
		}
	case ctx.Done() == nil && shared:
		if resp, err = r.exchange(r.attemptContext(now).Done(), nil); err == errAttemptEnded {
			err = context.DeadlineExceeded
		}
	case ctx.Done() == nil:
		if r.timer == nil {
			r.timer = time.NewTimer(wait)
		} else {
			r.timer.Reset(wait)
		}
		resp, err = r.exchange(nil, r.timer.C)
		r.timer.Stop()
		if err == errAttemptEnded {
			err = context.DeadlineExceeded
		}
	default:
		actx, cancel := context.WithTimeout(ctx, wait)
		resp, err = r.exchange(actx.Done(), nil)
		cancel()
		if err == errAttemptEnded {
			if err = ctx.Err(); err == nil {
				err = context.DeadlineExceeded
			}
		}
	}
	return resp, err
}

// retryable reports whether a request that failed with err may be sent
// again: no worker answered, the attempt timed out, or a worker said 503.
func retryable(err error) bool {
	var e *Error
	return errors.Is(err, nats.ErrNoResponders) || errors.Is(err, context.DeadlineExceeded) || errors.Is(err, nats.ErrTimeout) ||
		errors.As(err, &e) && e.Code == protocol.CodeUnavailable
}
