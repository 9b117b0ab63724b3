package dispenser

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/dispenser-dev/dispenser/ownership"
	"github.com/dispenser-dev/dispenser/protocol"
	"github.com/dispenser-dev/dispenser/segment"
	"github.com/dispenser-dev/dispenser/tagmodel"
)

// Ordered tags: routing, the owner's side of forwarded requests and the
// direct subject. The safety argument is in the package doc ("Ordered
// tags: why no ID is handed out out of order"); the steps it names are
// marked here.

// Owners says which worker owns an ordered tag; *ownership.Leases
// implements it. Its leases must reset the tag's buffers on acquire and
// loss (ownership.Open does that).
type Owners interface {
	// Owns reports whether this worker may serve tag now.
	Owns(tag string) bool
	// Cached says where tag's requests go without I/O, if it knows. Its
	// Self may be said of a lease that ran out a moment ago: serve the
	// IDs taken on it only if Owns holds after taking them
	// (orderedTags.owns).
	Cached(tag string) (ownership.Route, bool)
	// Route says where tag's requests go, from what this worker last saw.
	Route(ctx context.Context, tag string) (ownership.Route, error)
	// Claim makes this worker the owner if nobody holds a live lease.
	Claim(ctx context.Context, tag string) (ownership.Route, error)
	// Stats describes the ownership for micro stats and metrics.
	Stats() ownership.Stats
}

// HandingOver is what an Owners implements if it can hand its tags over
// and keep following the owners (*ownership.Leases, on a worker's way
// out): while it reports true, requests forwarded here go on to the new
// owner rather than fail.
type HandingOver interface {
	HandingOver() bool
}

// ClaimWaiter is what an Owners implements if other workers may see its
// claim of a tag before Owns holds here (*ownership.Leases: the claim's
// write lands, then the buffers are reset, then the lease is in place):
// a request forwarded here in that window waits for the claim's outcome
// (orderedTags.awaitClaim) rather than fail.
type ClaimWaiter interface {
	// ClaimUnderway returns a channel closed when this worker's claim of
	// tag under way ends, after a won lease is in place, or nil if no
	// claim of tag is under way. It claims nothing.
	ClaimUnderway(tag string) <-chan struct{}
}

// ownerQueue is the queue group of the subscriptions to forwarded and
// direct requests.
const ownerQueue = "owner"

// defaultOwnerWait bounds how long a request for an ordered tag looks for
// its owner when the allocator says nothing else: the wait is the longer
// of it and the allocator's MaxWait.
const defaultOwnerWait = 2 * time.Second

// orderedTags serves the ordered tags of one binding: it takes the
// requests forwarded to this worker (Config.OwnerSubject.<tag>) and those
// on its direct subject, and forwards the requests for tags it does not
// own. It answers every request it is given exactly once, with IDs
// (Service.replyOwned) or an error (replier.fail). Its counters are the
// service's, shared by the bindings that replace one another on Move. It
// is safe for concurrent use.
type orderedTags struct {
	s      *Service
	conn   *nats.Conn         // the binding's connection
	id     string             // names this worker in ForwardedHeader: the binding's ID
	wait   time.Duration      // bounds the search for a tag's owner
	sub    *nats.Subscription // OwnerSubject.*
	direct *nats.Subscription // protocol.DirectSubject(Prefix, "*", OwnerID); nil without OwnerID
	// directPrefix is "<Prefix>.direct.", the subject before a tag.
	directPrefix string
	fwd          forwarder
	parked       sync.WaitGroup // requests waiting, and the forwarder
}

// newOrderedTags subscribes to the requests forwarded to this worker and
// to its direct subject on nc, and starts the forwarder. id names this
// worker in the messages it forwards. Config.validate checked the
// subjects.
func (s *Service) newOrderedTags(nc *nats.Conn, id string) (*orderedTags, error) {
	cfg := s.cfg
	t := &orderedTags{s: s, conn: nc, id: id, wait: max(cfg.Segments.MaxWait(), defaultOwnerWait)}
	t.fwd.ch = make(chan forwardItem, forwardBacklog)
	t.fwd.stop = make(chan struct{})
	var err error
	// A queue subscription: while a worker moves to another connection
	// (Service.Move) the orderedTags of both take OwnerSubject, and each
	// forwarded message must reach one of them, not both.
	if t.sub, err = nc.QueueSubscribe(cfg.OwnerSubject+".*", ownerQueue, t.handleForwarded); err != nil {
		return nil, fmt.Errorf("dispenser: subscribing to %s.*: %w", cfg.OwnerSubject, err)
	}
	if cfg.OwnerID != "" {
		// A queue group too, for the same reason: during a move, a direct
		// request reaches one of the worker's two connections.
		t.directPrefix = protocol.DirectPrefix(cfg.Prefix)
		subject := protocol.DirectSubject(cfg.Prefix, "*", cfg.OwnerID)
		if t.direct, err = nc.QueueSubscribe(subject, ownerQueue, t.handleDirect); err != nil {
			_ = t.sub.Unsubscribe()
			return nil, fmt.Errorf("dispenser: subscribing to %s: %w", subject, err)
		}
	}
	t.parked.Add(1)
	go t.runForwarder()
	return t, nil
}

// drain stops taking forwarded and direct requests; those received are
// still served.
func (t *orderedTags) drain() error {
	var errs []error
	for _, sub := range []*nats.Subscription{t.sub, t.direct} {
		if sub == nil {
			continue
		}
		if err := sub.Drain(); err != nil && !errors.Is(err, nats.ErrConnectionClosed) {
			errs = append(errs, fmt.Errorf("ordered: draining %s: %w", sub.Subject, err))
		}
	}
	return errors.Join(errs...)
}

// leave makes the forwarder send what it holds and stop; call it once no
// request can reach serve any more.
func (t *orderedTags) leave() { t.fwd.leave() }

// waitParked waits for the requests t holds (waiting for a segment or for
// an owner) and the forwarder, or until ctx ends.
func (t *orderedTags) waitParked(ctx context.Context) error {
	done := make(chan struct{})
	go func() { t.parked.Wait(); close(done) }()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("ordered: waiting for requests: %w", ctx.Err())
	}
}

// orderedStats describes the ownership and the requests forwarded (the
// segment endpoint's stats, "ordered").
type orderedStats struct {
	ownership.Stats
	Forwarded uint64 `json:"forwarded"`
	// Direct and Misdirected count the requests on this worker's direct
	// subject served as owner, and refused because this worker did not own
	// their tag.
	Direct      uint64 `json:"direct"`
	Misdirected uint64 `json:"misdirected"`
	// NoOwner counts the requests answered 503 because their tag had no
	// owner that this worker could find or become within the wait.
	NoOwner uint64 `json:"no_owner"`
}

// stats returns the ownership's stats and the requests forwarded.
func (t *orderedTags) stats() orderedStats {
	s := t.s
	return orderedStats{s.cfg.Owners.Stats(), s.forwarded.Load(), s.direct.Load(), s.misdirected.Load(), s.noOwner.Load()}
}

// serve serves a request for an ordered tag, on the handler's goroutine:
// from this worker if it owns the tag, else by forwarding it to the owner
// (who answers the requester directly), else by claiming the tag. Anything
// that may wait goes to a goroutine of its own.
func (t *orderedTags) serve(r replier, tag string) {
	rt, ok := t.s.cfg.Owners.Cached(tag)
	switch {
	case ok && rt.Self:
		t.takeOwned(r, tag)
		return
	case ok && rt.Subject != "":
		t.enqueueForward(r, rt.Subject, tag) // the common case
		return
	}
	t.routeAside(r, tag)
}

// routeAside routes r on a goroutine of its own (route may wait). A
// function of its own, so that serve's replier stays on its stack: a
// goroutine's closure there would move it to the heap on every request.
func (t *orderedTags) routeAside(r replier, tag string) {
	r = r.detach()
	t.parked.Add(1)
	go func() {
		defer t.parked.Done()
		t.route(r, tag)
	}()
}

// reroute serves a request, already off the handler's goroutine, whose
// tag turned out to be ordered while it waited as a plain one.
func (t *orderedTags) reroute(r replier, tag string) {
	if t.s.cfg.Owners.Owns(tag) {
		t.takeOwned(r, tag)
	} else {
		t.route(r, tag)
	}
}

// takeOwned serves an ordered tag this worker owns, or owned a moment ago
// (Cached's Self): it serves the IDs it took only if owns holds after it
// took them (safety argument, 3).
func (t *orderedTags) takeOwned(r replier, tag string) {
	var arr [2]segment.Run
	runs, src, pending, err := t.s.cfg.Segments.TakeOwned(tag, r.rq.N, arr[:0])
	switch {
	case err != nil:
		r.fail(err)
	case pending != nil:
		t.park(r, tag, pending)
	case !t.owns(tag, src):
		// Lost while taking (perhaps claimed again since), or run out
		// before: the IDs may come from a segment fetched after the
		// loss, or from a buffer of an ownership that ended (they are
		// skipped). Route the request again: Cached reads the clocks
		// now that Owns found the lease run out, so this does not come
		// back here unless Owns holds again (a renewal, a new claim).
		t.serve(r, tag)
	default:
		t.s.replyOwned(r, runs)
	}
}

// owns is the check after taking (safety argument, 3): this worker owns
// tag now, and src, the buffer the IDs were taken from, was not dropped
// since: so no Reset (a loss, a new claim) came between the take and now.
// In this order: Current after Owns.
func (t *orderedTags) owns(tag string, src segment.Source) bool {
	return t.s.cfg.Owners.Owns(tag) && src.Current()
}

// park finishes an owned request that waits for a segment on a goroutine
// of its own.
func (t *orderedTags) park(r replier, tag string, p *segment.Pending) {
	r = r.detach()
	t.parked.Add(1)
	go func() {
		defer t.parked.Done()
		runs, err := p.Wait(context.Background())
		if errors.Is(err, segment.ErrOrdered) || err == nil && !t.owns(tag, p.Source()) {
			// The buffers were reset, or this worker stopped owning
			// the tag while the request waited, or after (its IDs may
			// come from a segment fetched since: they are skipped).
			// Route it again from here.
			t.reroute(r, tag)
			return
		}
		if err != nil {
			r.fail(err)
			return
		}
		t.s.replyOwned(r, runs)
	}()
}

// handOverWait bounds how long a worker that handed its tags over waits
// for another worker to claim one, for a request it still holds: a claim
// takes a few bucket round trips once a request reaches another worker.
const handOverWait = 500 * time.Millisecond

// Backoff between looks for an ordered tag's owner. Owners answers what it
// already knows without I/O and reads the bucket once per tag at a time,
// so the requests for a tag whose owner died cost no more reads than one.
const (
	routeRetryMin = 20 * time.Millisecond
	routeRetryMax = 200 * time.Millisecond
)

// route finds the owner of tag, claiming it if it has none, until the
// wait runs out. It runs on a goroutine of its own.
func (t *orderedTags) route(r replier, tag string) {
	owners := t.s.cfg.Owners
	wait := t.wait
	if t.handingOver() {
		// This worker handed its tags over on its way out and claims
		// none: the new owner is whichever other worker claims the tag
		// for a request that reaches it. Were every request parked
		// here (clients that each wait for their answer), none would
		// reach another worker, and all would wait out the whole wait
		// (seen in internal/tests/upgrade: 2 s without an owner after each
		// hand-over, every client failed). So a short wait, then 503:
		// a client's retry goes elsewhere.
		wait = min(wait, handOverWait)
	}
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	backoff := routeRetryMin
	for {
		rt, err := owners.Route(ctx, tag)
		if err == nil && !rt.Self && rt.Subject == "" {
			rt, err = owners.Claim(ctx, tag)
		}
		switch {
		case err == nil && rt.Self:
			t.takeOwned(r, tag)
			return
		case err == nil && rt.Subject != "":
			t.forwardNow(r, forwardItem{owner: rt.Subject, tag: tag, Forward: r.forward()})
			return
		case err != nil:
			t.s.cfg.Logger.Debug("ordered: looking for the owner of an ordered tag", "tag", tag, "err", err)
		}
		select {
		case <-ctx.Done():
			t.s.noOwner.Add(1)
			r.fail(fmt.Errorf("%w: %q has no owner within %v", ErrOwnershipMoving, tag, wait))
			return
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, routeRetryMax)
	}
}

// handleForwarded serves requests other workers forwarded to this one as
// the owner of their ordered tag, on <OwnerSubject>.<tag>.
func (t *orderedTags) handleForwarded(msg *nats.Msg) {
	s := t.s
	tag := msg.Subject[strings.LastIndexByte(msg.Subject, '.')+1:]
	valid := tagmodel.ValidTag(tag)
	// One string for the whole message: the reply subjects are slices of it.
	for line := range strings.Lines(string(msg.Data)) {
		f, perr := protocol.ParseForward(strings.TrimSuffix(line, "\n"))
		if f.Reply == "" {
			s.cfg.Logger.Warn("ordered: unreadable forwarded request", "subject", msg.Subject, "err", perr)
			continue
		}
		if !s.admitReply(f.Reply, msg.Subject) {
			continue // checked by the forwarder too: a forged batch
		}
		r := s.forwardedReplier(f, tag)
		switch {
		case !valid:
			r.fail(fmt.Errorf("%w %q", protocol.ErrBadSubject, msg.Subject))
		case perr != nil:
			r.fail(perr)
		case f.N < 1 || f.N > s.cfg.MaxBatch:
			r.fail(fmt.Errorf("%w: %d", protocol.ErrBadCount, f.N))
		case !s.cfg.Owners.Owns(tag) && t.handingOver():
			// This worker handed its tags over on its way out, after
			// the sender last saw it as the owner: the request goes
			// on to the new owner (this worker claims nothing any
			// more), instead of failing as it would have at every
			// owner move. Nothing was taken here; the request is
			// held by one worker at a time and answered once.
			t.routeAside(r, tag)
		case !s.cfg.Owners.Owns(tag):
			if claim := t.claimUnderway(tag); claim != nil {
				// This worker's claim of the tag is under way: its
				// write landed (the sender saw it), its lease is not
				// in place yet. Wait for it rather than fail.
				t.awaitClaim(r, tag, claim, false)
			} else if s.cfg.Owners.Owns(tag) {
				t.takeOwned(r, tag) // a claim ended in between
			} else {
				r.fail(fmt.Errorf("%w: %q is not owned here any more", ErrOwnershipMoving, tag))
			}
		default:
			t.takeOwned(r, tag)
		}
	}
}

func (t *orderedTags) handingOver() bool {
	h, ok := t.s.cfg.Owners.(HandingOver)
	return ok && h.HandingOver()
}

// claimUnderway is the Owners' ClaimWaiter.ClaimUnderway, or nil.
func (t *orderedTags) claimUnderway(tag string) <-chan struct{} {
	if c, ok := t.s.cfg.Owners.(ClaimWaiter); ok {
		return c.ClaimUnderway(tag)
	}
	return nil
}

// awaitClaim serves a request forwarded to this worker (or sent to its
// direct subject, direct) while its claim of tag is under way (done is
// closed when the claim ends), on a goroutine of its own: if the claim is
// won within the wait, as the owner (takeOwned, with its check after
// taking: nothing is served on the claim's word alone). If it ended
// otherwise, a forwarded request is routed from here (route) like one this
// worker received itself, and a direct one is refused as misdirected
// (ErrNotOwner), as it would have been without the claim. Nothing is
// taken before Owns holds.
//
// No request goes round for ever. A worker routes a forwarded request on
// only when it is handing over (it claims nothing any more) or here, after
// a claim of its own that was under way when the request came ended
// without the lease; any other worker that does not own the tag answers
// 503. So a request makes a further hop only when the worker it reaches
// is claiming the tag at that moment and then does not get it: another
// worker holds a live lease or took the key first. Each hop waits at most
// t.wait for the claim and route's wait after it.
func (t *orderedTags) awaitClaim(r replier, tag string, done <-chan struct{}, direct bool) {
	r = r.detach()
	t.parked.Add(1)
	go func() {
		defer t.parked.Done()
		timer := time.NewTimer(t.wait)
		defer timer.Stop()
		select {
		case <-done:
		case <-timer.C:
			t.s.noOwner.Add(1)
			r.fail(fmt.Errorf("%w: %q: this worker's claim did not end within %v", ErrOwnershipMoving, tag, t.wait))
			return
		}
		switch {
		case t.s.cfg.Owners.Owns(tag):
			if direct {
				t.s.direct.Add(1)
			}
			t.takeOwned(r, tag)
		case direct:
			t.misdirected(r, tag)
		default:
			t.route(r, tag)
		}
	}()
}

// handleDirect serves requests a requester sent to this worker's direct
// subject, <Prefix>.direct.<tag>.<OwnerID>: like a forwarded request, only
// as the tag's owner (safety argument, 4). The request is input from a
// requester, not from a worker: its reply subject must pass admitReply,
// its subject must name a valid tag and its count and format must be
// readable, or it gets no ID; a tag this worker does not own is refused
// with ErrNotOwner, nothing taken.
func (t *orderedTags) handleDirect(msg *nats.Msg) {
	s := t.s
	if !s.admitReply(msg.Reply, msg.Subject) {
		return
	}
	// The subscription's subject: <directPrefix><one token>.<OwnerID>.
	tag := strings.TrimSuffix(strings.TrimPrefix(msg.Subject, t.directPrefix), "."+s.cfg.OwnerID)
	r, err := s.directReplier(msg, tag)
	switch {
	case !tagmodel.ValidTag(tag):
		r.fail(fmt.Errorf("%w %q", protocol.ErrBadSubject, msg.Subject))
	case err != nil:
		r.fail(err)
	case !s.cfg.Owners.Owns(tag):
		if claim := t.claimUnderway(tag); claim != nil {
			t.awaitClaim(r, tag, claim, true) // as a forwarded request
		} else if s.cfg.Owners.Owns(tag) {
			s.direct.Add(1)
			t.takeOwned(r, tag) // a claim ended in between
		} else {
			t.misdirected(r, tag)
		}
	default:
		s.direct.Add(1)
		t.takeOwned(r, tag)
	}
}

// misdirected refuses a direct request for a tag this worker does not own,
// nothing taken: the requester asks the queue group again.
func (t *orderedTags) misdirected(r replier, tag string) {
	t.s.misdirected.Add(1)
	r.fail(fmt.Errorf("%w: %q", ErrNotOwner, tag))
}
