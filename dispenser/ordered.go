package dispenser

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"

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

// ForwardedHeader marks a request one worker forwarded to the owner of its
// ordered tag; its value names the forwarding worker. A forwarded request is
// never forwarded again.
const ForwardedHeader = "Id-Forwarded"

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
func (s *Service) takeOrdered(r replier, tag string, n int, format Format) {
	if s.cfg.Owners.Owns(tag) {
		s.takeOwned(r, tag, n, format)
		return
	}
	if _, fwd := r.req.Headers()[ForwardedHeader]; fwd {
		r.fail(fmt.Errorf("%w: %q is not owned here any more", ErrOwnershipMoving, tag))
		return
	}
	data, hdr := r.req.Data(), nats.Header(r.req.Headers())
	if rt, ok := s.cfg.Owners.Cached(tag); ok && rt.Subject != "" {
		s.forward(r, rt.Subject+"."+tag, data, hdr) // the common case: no goroutine
		return
	}
	r.inline = false
	s.parked.Add(1)
	go func() {
		defer s.parked.Done()
		s.routeOrdered(r, tag, n, format, data, hdr)
	}()
}

// takeOwned serves an ordered tag this worker owns.
func (s *Service) takeOwned(r replier, tag string, n int, format Format) {
	s.attract(tag)
	var arr [2]segment.Run
	runs, pending, err := s.cfg.Segments.TakeOwned(tag, n, arr[:0])
	switch {
	case err != nil:
		r.fail(err)
	case pending != nil:
		s.park(r, pending, format, n, true)
	default:
		s.reply(r, format, runs, n)
	}
}

// routeOrdered finds the owner of tag, claiming it if it has none, until
// the wait runs out. It runs on a goroutine of its own.
func (s *Service) routeOrdered(r replier, tag string, n int, format Format, data []byte, hdr nats.Header) {
	ctx, cancel := context.WithTimeout(context.Background(), s.orderedWait)
	defer cancel()
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
			s.forward(r, rt.Subject+"."+tag, data, hdr)
			return
		case err != nil:
			s.cfg.Logger.Debug("dispenser: looking for the owner of an ordered tag", "tag", tag, "err", err)
		}
		select {
		case <-ctx.Done():
			r.fail(fmt.Errorf("%w: %q has no owner within %v", ErrOwnershipMoving, tag, s.orderedWait))
			return
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// forward hands the request to the owner's subject, keeping its reply
// subject: the owner answers the requester directly.
func (s *Service) forward(r replier, subject string, data []byte, hdr nats.Header) {
	msg := &nats.Msg{Subject: subject, Reply: r.req.Reply(), Data: data, Header: nats.Header{}}
	for k, v := range hdr {
		msg.Header[k] = v
	}
	msg.Header.Set(ForwardedHeader, s.id)
	if err := s.cfg.Conn.PublishMsg(msg); err != nil {
		r.fail(fmt.Errorf("%w: forwarding to the owner: %w", ErrOwnershipMoving, err))
		return
	}
	s.forwarded.Add(1)
}

// handleForwarded serves requests other workers forwarded to this one as
// the owner of their ordered tag, on <OwnerSubject>.<tag>.
func (s *Service) handleForwarded(msg *nats.Msg) {
	r := s.newReplier(forwardedRequest{msg}, "segment")
	r.inline = false
	tag := msg.Subject[strings.LastIndexByte(msg.Subject, '.')+1:]
	if !segment.ValidTag(tag) {
		r.fail(fmt.Errorf("%w %q", ErrBadSubject, msg.Subject))
		return
	}
	r.tag = tag
	n, format, err := s.parse(r.req)
	if err != nil {
		r.fail(err)
		return
	}
	if !s.cfg.Owners.Owns(tag) {
		r.fail(fmt.Errorf("%w: %q is not owned here any more", ErrOwnershipMoving, tag))
		return
	}
	s.takeOwned(r, tag, n, format)
}

// forwardedRequest is a forwarded *nats.Msg as a micro.Request, so that it is
// answered like any other request.
type forwardedRequest struct{ msg *nats.Msg }

func (f forwardedRequest) Respond(data []byte, opts ...micro.RespondOpt) error {
	m := &nats.Msg{Subject: f.msg.Reply, Data: data}
	for _, o := range opts {
		o(m)
	}
	return f.msg.RespondMsg(m)
}

func (f forwardedRequest) RespondJSON(any, ...micro.RespondOpt) error {
	return errors.New("dispenser: forwarded requests answer IDs only")
}

func (f forwardedRequest) Error(code, description string, data []byte, opts ...micro.RespondOpt) error {
	m := &nats.Msg{Subject: f.msg.Reply, Data: data, Header: nats.Header{}}
	m.Header.Set(micro.ErrorHeader, description)
	m.Header.Set(micro.ErrorCodeHeader, code)
	for _, o := range opts {
		o(m)
	}
	return f.msg.RespondMsg(m)
}

func (f forwardedRequest) Data() []byte           { return f.msg.Data }
func (f forwardedRequest) Headers() micro.Headers { return micro.Headers(f.msg.Header) }
func (f forwardedRequest) Subject() string        { return f.msg.Subject }
func (f forwardedRequest) Reply() string          { return f.msg.Reply }

// The owner of an ordered tag draws the tag's requests to itself: it adds
// Config.OwnerWeight queue subscriptions on the tag's own subject in the
// service's queue group. NATS delivers a request to one of all the group's
// subscriptions that match its subject (the workers' <prefix>.segment.>
// ones and these), chosen uniformly, so most requests reach the owner
// without the forwarding hop. This only moves load: a worker that receives
// a request on one of these subscriptions without owning the tag (it lost
// the lease) drops them and routes the request like any other.
//
// Each of these subscriptions ends, in the server, after drawnPerSub
// requests, and the owner replaces it when it handles the last one. A
// frozen owner (stopped, swapping, paused past its lease) replaces none, so
// it swallows at most OwnerWeight*drawnPerSub requests more than any frozen
// worker does; the rest go to the live workers, one of which takes the tag
// over once the lease has expired.

// drawnBacklog is how many drawn requests may wait for the goroutine that
// answers them; beyond it nats.go drops them (a slow consumer).
const drawnBacklog = 1 << 16

// drawnPerSub is how many requests one drawing subscription takes before
// the server drops it. Tests change it; 0 means no limit.
var drawnPerSub = 500

// attraction holds the queue subscriptions of the ordered tags this worker
// owns. It is safe for concurrent use.
type attraction struct {
	// ch receives the requests of all the subscriptions; one goroutine
	// (serveAttracted) answers them, as one goroutine answers an endpoint's.
	ch     chan *nats.Msg
	stop   chan struct{} // closed when ch is to be emptied and left
	once   sync.Once     // closes stop
	mu     sync.Mutex    // protects subs and closed
	subs   map[string][]*nats.Subscription
	closed bool
	// has mirrors subs' keys for the request path's lock-free check.
	has sync.Map
}

// attract draws tag's requests to this worker, its owner, unless it does
// already.
func (s *Service) attract(tag string) {
	if s.cfg.OwnerWeight < 1 {
		return
	}
	if _, ok := s.attracted.has.Load(tag); ok {
		return
	}
	a := &s.attracted
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed || len(a.subs[tag]) > 0 {
		return
	}
	subs := make([]*nats.Subscription, 0, s.cfg.OwnerWeight)
	for range s.cfg.OwnerWeight {
		sub, err := s.drawSub(tag)
		if err != nil {
			s.cfg.Logger.Warn("dispenser: drawing an ordered tag's requests to its owner", "tag", tag, "err", err)
			break
		}
		subs = append(subs, sub)
	}
	if len(subs) == 0 {
		return // the next request tries again
	}
	if a.subs == nil {
		a.subs = make(map[string][]*nats.Subscription)
	}
	a.subs[tag] = subs
	a.has.Store(tag, struct{}{})
}

// drawSub adds one drawing subscription for tag.
func (s *Service) drawSub(tag string) (*nats.Subscription, error) {
	sub, err := s.cfg.Conn.ChanQueueSubscribe(s.segPrefix+tag, s.cfg.QueueGroup, s.attracted.ch)
	if err != nil {
		return nil, err
	}
	if drawnPerSub > 0 {
		if err := sub.AutoUnsubscribe(drawnPerSub); err != nil {
			_ = sub.Unsubscribe()
			return nil, err
		}
	}
	return sub, nil
}

// renew replaces spent, a drawing subscription of tag that has taken its
// drawnPerSub requests, if it is still one of tag's.
func (s *Service) renew(tag string, spent *nats.Subscription) {
	a := &s.attracted
	a.mu.Lock()
	defer a.mu.Unlock()
	subs := a.subs[tag]
	i := slices.Index(subs, spent)
	if i < 0 || a.closed {
		return // detached, or replaced already
	}
	sub, err := s.drawSub(tag)
	if err != nil {
		s.cfg.Logger.Warn("dispenser: renewing a subscription that draws an ordered tag's requests", "tag", tag, "err", err)
		if a.subs[tag] = slices.Delete(subs, i, i+1); len(a.subs[tag]) == 0 {
			delete(a.subs, tag) // the next request for it draws it again
			a.has.Delete(tag)
		}
		return
	}
	subs[i] = sub
}

// detach stops drawing tag's requests to this worker, which no longer owns
// it. Requests already delivered to its subscriptions are still handled.
func (s *Service) detach(tag string) {
	a := &s.attracted
	a.mu.Lock()
	subs := a.subs[tag]
	delete(a.subs, tag)
	a.has.Delete(tag)
	a.mu.Unlock()
	drain(subs, s.cfg.Logger)
}

// close drains every subscription and adds no more.
func (a *attraction) close(log *slog.Logger) {
	a.mu.Lock()
	a.closed = true
	all := a.subs
	a.subs = nil
	a.mu.Unlock()
	for tag, subs := range all {
		a.has.Delete(tag)
		drain(subs, log)
	}
}

func drain(subs []*nats.Subscription, log *slog.Logger) {
	for _, sub := range subs {
		if err := sub.Drain(); err != nil && !errors.Is(err, nats.ErrConnectionClosed) && !errors.Is(err, nats.ErrBadSubscription) {
			log.Warn("dispenser: draining an ordered tag's subscription", "subject", sub.Subject, "err", err)
		}
	}
}

// leave makes serveAttracted answer what is left in the channel and return.
func (a *attraction) leave() {
	if a.stop != nil {
		a.once.Do(func() { close(a.stop) })
	}
}

// serveAttracted answers the requests of the attraction's subscriptions
// until Stop, then those left in the channel.
func (s *Service) serveAttracted() {
	defer s.parked.Done()
	for {
		select {
		case m := <-s.attracted.ch:
			s.handleAttracted(m)
		case <-s.attracted.stop:
			for {
				select {
				case m := <-s.attracted.ch:
					s.handleAttracted(m)
				default:
					return
				}
			}
		}
	}
}

// handleAttracted serves a request that reached this worker through one of
// the subscriptions it added as an ordered tag's owner.
func (s *Service) handleAttracted(msg *nats.Msg) {
	s.drawn.Add(1)
	r := s.newReplier(forwardedRequest{msg}, "segment")
	r.inline = false
	tag, err := ParseTag(msg.Subject, s.segPrefix) // cannot fail: our subscription's
	if err != nil {
		r.fail(err)
		return
	}
	r.tag = tag
	owned := s.cfg.Owners.Owns(tag)
	switch {
	case !owned:
		s.detach(tag) // lost the lease since: stop drawing the tag's requests
	case spent(msg.Sub):
		s.renew(tag, msg.Sub) // whatever becomes of this request
	}
	n, format, err := s.parse(r.req)
	if err != nil {
		r.fail(err)
		return
	}
	if !owned {
		s.serveSegment(r, tag, n, format)
		return
	}
	s.takeOwned(r, tag, n, format)
}

// spent reports whether the server has delivered (or is about to drop
// after delivering) the last request sub may take. nats.go counts a
// channel subscription's deliveries under the lock it sends with, and
// marks the subscription closed only later.
func spent(sub *nats.Subscription) bool {
	d, err := sub.Delivered()
	return err != nil || drawnPerSub > 0 && d >= int64(drawnPerSub)
}
