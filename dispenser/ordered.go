package dispenser

import (
	"context"
	"errors"
	"fmt"
	"github.com/dispenser-dev/dispenser/protocol"
	"time"

	"github.com/dispenser-dev/dispenser/ownership"
	"github.com/dispenser-dev/dispenser/segment"
)

// Owners says which worker owns an ordered tag; *ownership.Leases
// implements it.
type Owners interface {
	// Owns reports whether this worker may serve tag now.
	Owns(tag string) bool
	// Cached says where tag's requests go without I/O, if it knows.
	Cached(tag string) (ownership.Route, bool)
	// Route says where tag's requests go, from what this worker last saw.
	Route(ctx context.Context, tag string) (ownership.Route, error)
	// Claim makes this worker the owner if nobody holds a live lease.
	Claim(ctx context.Context, tag string) (ownership.Route, error)
	// Stats describes the ownership for micro stats and metrics.
	Stats() ownership.Stats
}

// ErrOwnershipMoving means no worker could be found to own an ordered tag
// within the wait (the owner died, paused past its lease, or is handing the
// tag over): try again.
var ErrOwnershipMoving = errors.New("dispenser: ordered tag's owner is changing")

// orderedWait bounds how long a request for an ordered tag looks for its
// owner when the allocator says nothing else.
const orderedWait = 2 * time.Second

// takeOrdered serves a request for an ordered tag: from this worker if it
// owns the tag, else by forwarding it to the owner (who answers the
// requester directly), else by claiming the tag. It runs on the handler's
// goroutine and parks anything that may wait.
func (s *Service) takeOrdered(r replier, tag string, n int, format protocol.Format) {
	rt, ok := s.cfg.Owners.Cached(tag)
	switch {
	case ok && rt.Self:
		s.takeOwned(r, tag, n, format)
		return
	case ok && rt.Subject != "":
		s.enqueueForward(r, rt.Subject, tag, n, format) // the common case
		return
	}
	r.inline = false
	s.parked.Add(1)
	go func() {
		defer s.parked.Done()
		s.routeOrdered(r, tag, n, format)
	}()
}

// takeOwned serves an ordered tag this worker owns.
func (s *Service) takeOwned(r replier, tag string, n int, format protocol.Format) {
	var arr [2]segment.Run
	runs, pending, err := s.cfg.Segments.TakeOwned(tag, n, arr[:0])
	switch {
	case err != nil:
		r.fail(err)
	case pending != nil:
		s.park(r, pending, format, n, true)
	case !s.cfg.Owners.Owns(tag):
		// Lost while taking: the IDs may come from a segment fetched
		// after the loss (they are skipped). Route the request again.
		s.takeOrdered(r, tag, n, format)
	default:
		s.reply(r, format, runs, n)
	}
}

// Backoff between looks for an ordered tag's owner. Owners answers what it
// already knows without I/O and reads the bucket once per tag at a time,
// so the requests for a tag whose owner died cost no more reads than one.
const (
	routeRetryMin = 20 * time.Millisecond
	routeRetryMax = 200 * time.Millisecond
)

// routeOrdered finds the owner of tag, claiming it if it has none, until
// the wait runs out. It runs on a goroutine of its own.
func (s *Service) routeOrdered(r replier, tag string, n int, format protocol.Format) {
	ctx, cancel := context.WithTimeout(context.Background(), s.orderedWait)
	defer cancel()
	backoff := routeRetryMin
	for {
		rt, err := s.cfg.Owners.Route(ctx, tag)
		if err == nil && !rt.Self && rt.Subject == "" {
			rt, err = s.cfg.Owners.Claim(ctx, tag)
		}
		switch {
		case err == nil && rt.Self:
			s.takeOwned(r, tag, n, format)
			return
		case err == nil && rt.Subject != "":
			s.forwardNow(r, forwardItem{owner: rt.Subject, tag: tag, reply: r.reply, n: n, format: format, worker: r.worker})
			return
		case err != nil:
			s.cfg.Logger.Debug("dispenser: looking for the owner of an ordered tag", "tag", tag, "err", err)
		}
		select {
		case <-ctx.Done():
			r.fail(fmt.Errorf("%w: %q has no owner within %v", ErrOwnershipMoving, tag, s.orderedWait))
			return
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, routeRetryMax)
	}
}
