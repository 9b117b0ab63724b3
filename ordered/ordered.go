package ordered

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/dispenser-dev/dispenser/ownership"
	"github.com/dispenser-dev/dispenser/protocol"
	"github.com/dispenser-dev/dispenser/segment"
	"github.com/dispenser-dev/dispenser/tagmodel"
)

// Errors of package ordered.
var (
	// ErrOwnershipMoving means no worker could be found to own an ordered
	// tag within the wait (the owner died, paused past its lease, or is
	// handing the tag over), or a forwarded request reached a worker that
	// no longer owns it: try again.
	ErrOwnershipMoving = errors.New("dispenser: ordered tag's owner is changing")
	// ErrNotOwner means a request on this worker's direct subject is for a
	// tag this worker does not own (any more, or the tag is not ordered):
	// nothing was taken; the requester sends it to the queue group's
	// subject instead (protocol.CodeMisdirected).
	ErrNotOwner = errors.New("dispenser: this worker does not own the tag; ask <prefix>.segment.<tag>")
)

// Allocator is what Tags needs of the segment allocator;
// *segment.Allocator implements it.
type Allocator interface {
	// TakeOwned takes IDs of a tag this worker owns (see package segment).
	TakeOwned(tag string, n int, dst []segment.Run) ([]segment.Run, *segment.Pending, error)
	// Reset drops a tag's buffers: a new generation of segments.
	Reset(tag string)
	// Plain reports whether a tag is known not to be ordered.
	Plain(tag string) bool
	// MaxWait is how long a request waits for a segment at most.
	MaxWait() time.Duration
}

// Owners says which worker owns an ordered tag; *ownership.Leases
// implements it. Its leases must reset the tag's buffers on acquire and
// loss (ownership.Open does that).
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

// OpenLeases opens the ownership leases of ordered tags for a worker whose
// allocator is alloc: ownership.Open, which wires the leases as the safety
// argument needs (the tag's buffers are reset when ownership is gained,
// before it is visible, and when it is lost, and a tag found plain at a
// heartbeat is released).
func OpenLeases(ctx context.Context, js jetstream.JetStream, alloc Allocator, s ownership.Settings) (*ownership.Leases, error) {
	return ownership.Open(ctx, js, alloc, s)
}

// Replies answers the requests for IDs of ordered tags. The service
// implements it, so that every answer carries its metrics, headers and
// error codes; R is the service's own record of one request (a value, so
// that no request costs an allocation here). Tags answers each request
// exactly once, with IDs or Fail.
type Replies[R any] interface {
	// Request is the request r as a forwarded line carries it.
	Request(r R) protocol.Forward
	// IDs answers r with runs, Request(r).N IDs in all.
	IDs(r R, runs []segment.Run)
	// Fail answers r with the error's code.
	Fail(r R, err error)
	// Detach returns r as it must be used once the request has left the
	// handler's goroutine (it waits for a segment or for an owner).
	Detach(r R) R
	// Forwarded returns the record of a request for tag that another
	// worker forwarded to this one.
	Forwarded(f protocol.Forward, tag string) R
	// Direct returns the record of a request for tag a requester sent to
	// this worker's direct subject, and its count and format's error, if
	// any (the record is then good for Fail only).
	Direct(msg *nats.Msg, tag string) (R, error)
	// Admit reports whether reply may be answered at all (the service's
	// reply-subject rule); a refused request gets no answer. subject is
	// where it came from, for the log.
	Admit(reply, subject string) bool
}

// Settings configures Tags. Zero values mean the documented defaults.
type Settings[R any] struct {
	// Conn is the NATS connection that forwards requests and takes those
	// forwarded to this worker. Required.
	Conn *nats.Conn
	// Allocator and Owners: required.
	Allocator Allocator
	Owners    Owners
	// Subject is where this worker takes forwarded requests
	// (Subject.<tag>); it must be the subject its Owners records.
	// Required.
	Subject string
	// Direct, if set, is where this worker takes requests for the ordered
	// tags it owns from requesters directly: Direct names this worker,
	// which subscribes to protocol.DirectSubject(Prefix, "*", Direct).
	// Empty: no direct subject.
	Direct string
	// Prefix is the service's subject prefix; required with Direct.
	Prefix string
	// Replies makes the Replies of forwarded requests. Required.
	Replies Replies[R]
	// MaxBatch is the most IDs a forwarded request may ask for. Required.
	MaxBatch int
	// Wait bounds the search for a tag's owner. Default: the longer of 2 s
	// and the allocator's MaxWait.
	Wait time.Duration
	// Logger receives forwarding failures. Default slog.Default().
	Logger *slog.Logger
	// Forwarded counts the requests forwarded to an owner (Stats); nil:
	// a counter of the Tags' own. Tags that replace one another on a new
	// connection share one.
	Forwarded *atomic.Uint64
	// DirectServed and Misdirected count the requests on the direct
	// subject served as owner, and refused with ErrNotOwner (Stats); nil:
	// counters of the Tags' own, as for Forwarded.
	DirectServed, Misdirected *atomic.Uint64
	// NoOwner counts the requests answered ErrOwnershipMoving because no
	// owner was found, nor could be claimed, within Wait (Stats); nil: a
	// counter of the Tags' own, as for Forwarded.
	NoOwner *atomic.Uint64
}

// ownerQueue is the queue group of the subscription to forwarded requests.
const ownerQueue = "owner"

// defaultWait bounds how long a request for an ordered tag looks for its
// owner when the allocator says nothing else.
const defaultWait = 2 * time.Second

// Tags serves the ordered tags of one worker. It is safe for concurrent
// use.
type Tags[R any] struct {
	cfg    Settings[R]
	id     string             // names this worker in ForwardedHeader
	sub    *nats.Subscription // Subject.*
	direct *nats.Subscription // protocol.DirectSubject(Prefix, "*", Direct); nil without Direct
	// directPrefix is "<Prefix>.direct.", the subject before a tag.
	directPrefix string
	fwd          forwarder
	forwarded    *atomic.Uint64 // requests forwarded to an owner: Settings.Forwarded
	// directServed and misdirected count the requests on the direct
	// subject served as owner, and refused with ErrNotOwner:
	// Settings.DirectServed and Misdirected.
	directServed, misdirected *atomic.Uint64
	noOwner                   *atomic.Uint64 // requests that found no owner within Wait: Settings.NoOwner
	parked                    sync.WaitGroup // requests waiting, and the forwarder
}

// New validates s, subscribes to the forwarded requests and starts the
// forwarder. id names this worker in the messages it forwards.
func New[R any](s Settings[R], id string) (*Tags[R], error) {
	switch {
	case s.Conn == nil, s.Allocator == nil, s.Owners == nil, s.Replies == nil:
		return nil, errors.New("ordered: Settings.Conn, Allocator, Owners and Replies are required")
	case s.Subject == "":
		return nil, errors.New("ordered: Settings.Subject is required")
	case s.MaxBatch < 1:
		return nil, fmt.Errorf("ordered: MaxBatch %d: want at least 1", s.MaxBatch)
	case s.Direct != "" && (!protocol.ValidTag(s.Direct) || s.Prefix == ""):
		return nil, fmt.Errorf("ordered: Direct %q: want a token of %s, and a Prefix", s.Direct, protocol.TagRule)
	}
	if s.Wait <= 0 {
		s.Wait = max(s.Allocator.MaxWait(), defaultWait)
	}
	if s.Logger == nil {
		s.Logger = slog.Default()
	}
	t := &Tags[R]{cfg: s, id: id, forwarded: s.Forwarded}
	if t.forwarded == nil {
		t.forwarded = new(atomic.Uint64)
	}
	t.directServed, t.misdirected = cmp.Or(s.DirectServed, new(atomic.Uint64)), cmp.Or(s.Misdirected, new(atomic.Uint64))
	t.noOwner = cmp.Or(s.NoOwner, new(atomic.Uint64))
	t.fwd.ch = make(chan forwardItem, forwardBacklog)
	t.fwd.stop = make(chan struct{})
	var err error
	// A queue subscription: while a worker moves to another connection
	// (dispenser.Service.Move) the Tags of both take Subject, and each
	// forwarded message must reach one of them, not both.
	if t.sub, err = s.Conn.QueueSubscribe(s.Subject+".*", ownerQueue, t.handleForwarded); err != nil {
		return nil, fmt.Errorf("ordered: subscribing to %s.*: %w", s.Subject, err)
	}
	if s.Direct != "" {
		// A queue group too, for the same reason: during a move, a direct
		// request reaches one of the worker's two connections.
		t.directPrefix = protocol.DirectPrefix(s.Prefix)
		subject := protocol.DirectSubject(s.Prefix, "*", s.Direct)
		if t.direct, err = s.Conn.QueueSubscribe(subject, ownerQueue, t.handleDirect); err != nil {
			_ = t.sub.Unsubscribe()
			return nil, fmt.Errorf("ordered: subscribing to %s: %w", subject, err)
		}
	}
	t.parked.Add(1)
	go t.runForwarder()
	return t, nil
}

// Drain stops taking forwarded and direct requests; those received are
// still served.
func (t *Tags[R]) Drain() error {
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

// Leave makes the forwarder send what it holds and stop; call it once no
// request can reach Serve any more.
func (t *Tags[R]) Leave() { t.fwd.leave() }

// Wait waits for the requests Tags holds (waiting for a segment or for an
// owner) and the forwarder, or until ctx ends.
func (t *Tags[R]) Wait(ctx context.Context) error {
	done := make(chan struct{})
	go func() { t.parked.Wait(); close(done) }()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("ordered: waiting for requests: %w", ctx.Err())
	}
}

// Stats describes the ownership and the requests forwarded.
type Stats struct {
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

// Stats returns the ownership's stats and the requests forwarded.
func (t *Tags[R]) Stats() Stats {
	return Stats{t.cfg.Owners.Stats(), t.forwarded.Load(), t.directServed.Load(), t.misdirected.Load(), t.noOwner.Load()}
}

// Serve serves a request for an ordered tag, on the handler's goroutine:
// from this worker if it owns the tag, else by forwarding it to the owner
// (who answers the requester directly), else by claiming the tag. Anything
// that may wait goes to a goroutine of its own.
func (t *Tags[R]) Serve(r R, tag string) {
	rt, ok := t.cfg.Owners.Cached(tag)
	switch {
	case ok && rt.Self:
		t.takeOwned(r, tag)
		return
	case ok && rt.Subject != "":
		t.enqueueForward(r, rt.Subject, tag) // the common case
		return
	}
	r = t.cfg.Replies.Detach(r)
	t.parked.Add(1)
	go func() {
		defer t.parked.Done()
		t.route(r, tag)
	}()
}

// Reroute serves a request, already off the handler's goroutine, whose
// tag turned out to be ordered while it waited as a plain one.
func (t *Tags[R]) Reroute(r R, tag string) {
	if t.cfg.Owners.Owns(tag) {
		t.takeOwned(r, tag)
	} else {
		t.route(r, tag)
	}
}

// takeOwned serves an ordered tag this worker owns.
func (t *Tags[R]) takeOwned(r R, tag string) {
	var arr [2]segment.Run
	runs, pending, err := t.cfg.Allocator.TakeOwned(tag, t.cfg.Replies.Request(r).N, arr[:0])
	switch {
	case err != nil:
		t.cfg.Replies.Fail(r, err)
	case pending != nil:
		t.park(r, tag, pending)
	case !t.cfg.Owners.Owns(tag):
		// Lost while taking: the IDs may come from a segment fetched
		// after the loss (they are skipped). Route the request again.
		t.Serve(r, tag)
	default:
		t.cfg.Replies.IDs(r, runs)
	}
}

// park finishes an owned request that waits for a segment on a goroutine
// of its own.
func (t *Tags[R]) park(r R, tag string, p *segment.Pending) {
	r = t.cfg.Replies.Detach(r)
	t.parked.Add(1)
	go func() {
		defer t.parked.Done()
		runs, err := p.Wait(context.Background())
		if errors.Is(err, segment.ErrOrdered) || err == nil && !t.cfg.Owners.Owns(tag) {
			// The buffers were reset, or this worker stopped owning
			// the tag while the request waited (its IDs may come from
			// a segment fetched since: they are skipped). Route it
			// again from here.
			t.Reroute(r, tag)
			return
		}
		if err != nil {
			t.cfg.Replies.Fail(r, err)
			return
		}
		t.cfg.Replies.IDs(r, runs)
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
func (t *Tags[R]) route(r R, tag string) {
	wait := t.cfg.Wait
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
		rt, err := t.cfg.Owners.Route(ctx, tag)
		if err == nil && !rt.Self && rt.Subject == "" {
			rt, err = t.cfg.Owners.Claim(ctx, tag)
		}
		switch {
		case err == nil && rt.Self:
			t.takeOwned(r, tag)
			return
		case err == nil && rt.Subject != "":
			t.forwardNow(r, forwardItem{owner: rt.Subject, tag: tag, Forward: t.cfg.Replies.Request(r)})
			return
		case err != nil:
			t.cfg.Logger.Debug("ordered: looking for the owner of an ordered tag", "tag", tag, "err", err)
		}
		select {
		case <-ctx.Done():
			t.noOwner.Add(1)
			t.cfg.Replies.Fail(r, fmt.Errorf("%w: %q has no owner within %v", ErrOwnershipMoving, tag, wait))
			return
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, routeRetryMax)
	}
}

// handleForwarded serves requests other workers forwarded to this one as
// the owner of their ordered tag, on <Subject>.<tag>.
func (t *Tags[R]) handleForwarded(msg *nats.Msg) {
	tag := msg.Subject[strings.LastIndexByte(msg.Subject, '.')+1:]
	valid := tagmodel.ValidTag(tag)
	// One string for the whole message: the reply subjects are slices of it.
	for line := range strings.Lines(string(msg.Data)) {
		f, perr := protocol.ParseForward(strings.TrimSuffix(line, "\n"))
		if f.Reply == "" {
			t.cfg.Logger.Warn("ordered: unreadable forwarded request", "subject", msg.Subject, "err", perr)
			continue
		}
		if !t.cfg.Replies.Admit(f.Reply, msg.Subject) {
			continue // checked by the forwarder too: a forged batch
		}
		r := t.cfg.Replies.Forwarded(f, tag)
		switch {
		case !valid:
			t.cfg.Replies.Fail(r, fmt.Errorf("%w %q", protocol.ErrBadSubject, msg.Subject))
		case perr != nil:
			t.cfg.Replies.Fail(r, perr)
		case f.N < 1 || f.N > t.cfg.MaxBatch:
			t.cfg.Replies.Fail(r, fmt.Errorf("%w: %d", protocol.ErrBadCount, f.N))
		case !t.cfg.Owners.Owns(tag) && t.handingOver():
			// This worker handed its tags over on its way out, after
			// the sender last saw it as the owner: the request goes
			// on to the new owner (this worker claims nothing any
			// more), instead of failing as it would have at every
			// owner move. Nothing was taken here; the request is
			// held by one worker at a time and answered once.
			r = t.cfg.Replies.Detach(r)
			t.parked.Add(1)
			go func() {
				defer t.parked.Done()
				t.route(r, tag)
			}()
		case !t.cfg.Owners.Owns(tag):
			t.cfg.Replies.Fail(r, fmt.Errorf("%w: %q is not owned here any more", ErrOwnershipMoving, tag))
		default:
			t.takeOwned(r, tag)
		}
	}
}

// HandingOver is what an Owners implements if it can hand its tags over
// and keep following the owners (*ownership.Leases, on a worker's way
// out): while it reports true, requests forwarded here go on to the new
// owner rather than fail.
type HandingOver interface {
	HandingOver() bool
}

func (t *Tags[R]) handingOver() bool {
	h, ok := t.cfg.Owners.(HandingOver)
	return ok && h.HandingOver()
}

// handleDirect serves requests a requester sent to this worker's direct
// subject, <Prefix>.direct.<tag>.<Direct>: like a forwarded request, only
// as the tag's owner. The request is input from a requester, not from a
// worker: its reply subject must pass Admit, its subject must name a valid
// tag and its count and format must be readable, or it gets no ID; a tag
// this worker does not own is refused with ErrNotOwner, nothing taken.
func (t *Tags[R]) handleDirect(msg *nats.Msg) {
	if !t.cfg.Replies.Admit(msg.Reply, msg.Subject) {
		return
	}
	// The subscription's subject: <directPrefix><one token>.<Direct>.
	tag := strings.TrimSuffix(strings.TrimPrefix(msg.Subject, t.directPrefix), "."+t.cfg.Direct)
	r, err := t.cfg.Replies.Direct(msg, tag)
	switch {
	case !tagmodel.ValidTag(tag):
		t.cfg.Replies.Fail(r, fmt.Errorf("%w %q", protocol.ErrBadSubject, msg.Subject))
	case err != nil:
		t.cfg.Replies.Fail(r, err)
	case !t.cfg.Owners.Owns(tag):
		t.misdirected.Add(1)
		t.cfg.Replies.Fail(r, fmt.Errorf("%w: %q", ErrNotOwner, tag))
	default:
		t.directServed.Add(1)
		t.takeOwned(r, tag)
	}
}
