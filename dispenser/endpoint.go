package dispenser

import (
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"math/bits"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"

	"github.com/dispenser-dev/dispenser/protocol"
	"github.com/dispenser-dev/dispenser/segment"
	"github.com/dispenser-dev/dispenser/snowflake"
)

// endpoint is one request subscription of the service: what micro calls an
// endpoint, kept by the service itself so that the worker can leave the
// endpoint's queue group while it cannot serve it and join again once it
// can (docs/reliability.md, "A worker that cannot serve is not asked").
// Its requests, errors and processing time are counted as micro counts them
// ($SRV.STATS), without micro's per-request lock.
//
// A worker out of an endpoint's queue group still lists the endpoint in
// $SRV.INFO, with the metadata "serving": "false", so that `nats micro info`
// says which endpoints a worker serves.
type endpoint struct {
	name, subject, queue string
	metadata             map[string]string // never changed after newEndpoint
	conn                 *nats.Conn
	handle               func(*endpoint, *nats.Msg, *scratch)

	mu     sync.Mutex         // protects sub and closed
	sub    *nats.Subscription // nil while out of the queue group
	closed bool               // close was called: never joins again

	// timeAll: every request's clock readings are needed (the service
	// has metrics, whose latency starts at scratch.start); else
	// processing time is measured on a sample (scratch.timed).
	timeAll bool

	requests, errs atomic.Uint64
	processing     atomic.Int64 // nanoseconds spent in handle, in total (an estimate: scratch.timed)
	lastError      atomic.Pointer[string]
}

// ServingMetadata is the endpoint metadata key saying whether the worker is
// in the endpoint's queue group now ("true") or has left it until it can
// serve again ("false").
const ServingMetadata = "serving"

// pendingMsgs and pendingBytes bound the requests queued in the worker's
// NATS client for one endpoint's handler (nats.go's defaults for a
// subscription). Requests come as fast as requesters send them, a
// hostile or careless one included, and the handler may answer them more
// slowly: without a bound the queue, and the worker's memory, grows until
// the worker is killed, and requests are answered long after their
// requesters gave up (client.AttemptTimeout). Beyond the bound nats.go
// drops the newest request (a slow consumer: the connection's error
// handler logs it): it gets no reply and takes no ID, and its requester's
// attempt times out and goes again, perhaps to another worker. Either
// bound holds a few seconds of a worker's throughput at least.
const (
	pendingMsgs  = nats.DefaultSubPendingMsgsLimit
	pendingBytes = nats.DefaultSubPendingBytesLimit
)

// newEndpoint returns an endpoint that handles each request with h, on its
// subscription's goroutine, with that subscription's scratch memory.
func newEndpoint(nc *nats.Conn, name, subject, queue string, metadata map[string]string, h func(*endpoint, *nats.Msg, *scratch)) *endpoint {
	return &endpoint{name: name, subject: subject, queue: queue, metadata: metadata, conn: nc, handle: h}
}

// join subscribes the endpoint in its queue group, unless it is in it or
// was closed.
func (e *endpoint) join() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed || e.sub != nil {
		return nil
	}
	// Each subscription has its own scratch: one left and still draining
	// may run beside the next one joined.
	sc := &scratch{rng: rand.Uint64()}
	sub, err := e.conn.QueueSubscribe(e.subject, e.queue, func(msg *nats.Msg) { e.serve(msg, sc) })
	if err != nil {
		return fmt.Errorf("dispenser: subscribing %s: %w", e.subject, err)
	}
	// Bounded (pendingMsgs): a flood must not grow the queue without end.
	if err := sub.SetPendingLimits(pendingMsgs, pendingBytes); err != nil {
		_ = sub.Unsubscribe()
		return fmt.Errorf("dispenser: subscribing %s: %w", e.subject, err)
	}
	e.sub = sub
	return nil
}

// serve handles one request on the goroutine of the subscription whose
// memory sc is, and counts it with its processing time: two readings of
// the monotonic clock (mono), the first of which also starts the
// request's metrics (scratch.start; they add one reading, the latency).
// Without metrics, only a sample of the requests is timed (scratch.timed):
// the two readings cost about as much as the rest of what the service
// adds to a bare responder (docs/performance.md, "Fourth round").
// The request is counted before it is handled, so before its reply goes
// out: a requester that got its reply finds it counted in $SRV.STATS (as
// its error, counted by replier.fail before publishing); its processing
// time follows when the handler returns.
func (e *endpoint) serve(msg *nats.Msg, sc *scratch) {
	e.requests.Add(1)
	w := sc.timed(e.timeAll)
	if w == 0 {
		sc.start = 0
		e.handle(e, msg, sc)
		return
	}
	sc.start = mono()
	e.handle(e, msg, sc)
	e.processing.Add(int64(mono()-sc.start) * w)
}

// Processing time without metrics: the first timedExactly requests of a
// subscription are timed one by one; after them, each request is timed
// with probability 1/timedEvery and counts timedEvery times. The total
// (micro's processing_time) is then an unbiased estimate of the sum of
// every request's time, whose relative error falls with the number of
// requests (under 1% once a subscription has handled a million, for
// requests of alike cost); the average (average_processing_time) is that
// total over the exact request count.
const (
	timedExactly = 1024
	timedEvery   = 16 // a power of two
)

// timed returns the weight of the request about to be handled in the
// processing time: 1 (timed, every request: all, or among the first
// timedExactly), timedEvery (timed, one of the sample), or 0 (not timed).
func (sc *scratch) timed(all bool) int64 {
	if all || sc.counted < timedExactly {
		sc.counted++
		return 1
	}
	// A 64-bit linear congruential step (Knuth's MMIX constants); its
	// top bits, which are its most random, pick one request in
	// timedEvery.
	sc.rng = sc.rng*6364136223846793005 + 1442695040888963407
	if sc.rng>>(64-bits.TrailingZeros(timedEvery)) == 0 {
		return timedEvery
	}
	return 0
}

// monoBase is the origin of mono.
var monoBase = time.Now()

// mono reads the monotonic clock, as time since monoBase: one reading of
// the clock, where time.Now reads the wall clock as well (a request's
// clock readings are a large part of what the service adds to NATS).
func mono() time.Duration { return time.Since(monoBase) }

// leave takes the endpoint out of its queue group: the server gets the
// unsubscription before anything the caller publishes next on the same
// connection, so a request handed on right after it cannot come back here.
// Requests already received are still handled (a drain). It reports
// whether the endpoint was in the group.
func (e *endpoint) leave() bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.leaveLocked()
}

func (e *endpoint) leaveLocked() bool {
	if e.sub == nil {
		return false
	}
	sub, reconnects := e.sub, e.conn.Stats().Reconnects
	if err := sub.Drain(); err != nil && !errors.Is(err, nats.ErrConnectionClosed) {
		_ = sub.Unsubscribe()
	}
	// A drain's UNSUB may not reach the server: nats.go (v1.55) sends none
	// while the connection is reconnecting, and one written to a
	// connection that is dead but not yet noticed (a worker thawed after a
	// freeze) is lost. Either way, a reconnect before the drain ends
	// resends the draining subscription, which nats.go then drops locally:
	// the server keeps a member that never answers, and the requests the
	// group gives it time out (TestLeaveWhileReconnecting). So: while
	// reconnecting, unsubscribe at once (the reconnect does not resend it;
	// what it held was in flight at the cut); and if the connection
	// reconnected before the drain ended, reconnect once more, which
	// drops the server's copy (leftAfterDrain).
	if e.conn.IsReconnecting() {
		_ = sub.Unsubscribe()
	}
	go e.leftAfterDrain(sub, reconnects)
	e.sub = nil
	return true
}

// leftAfterDrain waits for sub's drain to end and, if the connection
// reconnected since reconnects (its count when the drain began), forces
// another reconnect: the server may hold the subscription the reconnect
// resent (see leaveLocked).
func (e *endpoint) leftAfterDrain(sub *nats.Subscription, reconnects uint64) {
	for sub.IsDraining() {
		time.Sleep(10 * time.Millisecond)
	}
	if e.conn.Stats().Reconnects != reconnects && !e.conn.IsClosed() {
		_ = e.conn.ForceReconnect()
	}
}

// close leaves the queue group for good.
func (e *endpoint) close() {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.closed = true
	e.leaveLocked()
}

// serving reports whether the endpoint is in its queue group.
func (e *endpoint) serving() bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.sub != nil
}

// failed counts an error reply with its description.
func (e *endpoint) failed(desc string) {
	e.errs.Add(1)
	e.lastError.Store(&desc)
}

// info is the endpoint's entry in $SRV.INFO.
func (e *endpoint) info() micro.EndpointInfo {
	md := maps.Clone(e.metadata)
	if md == nil {
		md = map[string]string{}
	}
	md[ServingMetadata] = fmt.Sprint(e.serving())
	return micro.EndpointInfo{Name: e.name, Subject: e.subject, QueueGroup: e.queue, Metadata: md}
}

// stats is the endpoint's entry in $SRV.STATS, with data as its data.
func (e *endpoint) stats(data any) *micro.EndpointStats {
	st := &micro.EndpointStats{Name: e.name, Subject: e.subject, QueueGroup: e.queue,
		NumRequests: int(e.requests.Load()), NumErrors: int(e.errs.Load()), ProcessingTime: time.Duration(e.processing.Load())}
	if st.NumRequests > 0 {
		st.AverageProcessingTime = st.ProcessingTime / time.Duration(st.NumRequests)
	}
	if p := e.lastError.Load(); p != nil {
		st.LastError = *p
	}
	// As micro with a StatsHandler: data for every endpoint, null if none.
	if b, err := json.Marshal(data); err == nil {
		st.Data = b
	}
	return st
}

// discovery answers micro's discovery requests ($SRV.PING, $SRV.INFO and
// $SRV.STATS, each for all services, this service's name, and this
// instance) for one binding, as micro.AddService would (ADR-32): nats
// micro ls/info/stats and every micro client see a micro service.
type discovery struct {
	identity    micro.ServiceIdentity
	description string
	started     time.Time
	endpoints   func() []*endpoint
	data        func(endpoint string) any // an endpoint's stats data, or nil
	// admit is the service's reply-subject rule (Service.admitReply): a
	// discovery request may not make the worker publish where no reply
	// goes, any more than an ID request may.
	admit func(reply, subject string) bool
	subs  []*nats.Subscription
}

// verbs are the discovery requests, as micro names them.
var verbs = []micro.Verb{micro.PingVerb, micro.InfoVerb, micro.StatsVerb}

// start subscribes the discovery subjects on nc.
func (d *discovery) start(nc *nats.Conn) error {
	for _, v := range verbs {
		h := d.handler(v)
		for _, subj := range []string{
			micro.APIPrefix + "." + v.String(),
			micro.APIPrefix + "." + v.String() + "." + d.identity.Name,
			micro.APIPrefix + "." + v.String() + "." + d.identity.Name + "." + d.identity.ID,
		} {
			sub, err := nc.Subscribe(subj, h)
			if err != nil {
				d.stop()
				return fmt.Errorf("dispenser: subscribing %s: %w", subj, err)
			}
			d.subs = append(d.subs, sub)
		}
	}
	return nil
}

// stop drains the discovery subscriptions.
func (d *discovery) stop() {
	for _, sub := range d.subs {
		_ = sub.Drain()
	}
	d.subs = nil
}

func (d *discovery) handler(v micro.Verb) nats.MsgHandler {
	return func(msg *nats.Msg) {
		if !d.admit(msg.Reply, msg.Subject) {
			return
		}
		var resp any
		switch v {
		case micro.PingVerb:
			resp = micro.Ping{ServiceIdentity: d.identity, Type: micro.PingResponseType}
		case micro.InfoVerb:
			resp = d.info()
		case micro.StatsVerb:
			resp = d.stats()
		}
		if b, err := json.Marshal(resp); err == nil {
			_ = msg.Respond(b)
		}
	}
}

// info is the service's $SRV.INFO answer.
func (d *discovery) info() micro.Info {
	eps := d.endpoints()
	info := micro.Info{ServiceIdentity: d.identity, Type: micro.InfoResponseType, Description: d.description,
		Endpoints: make([]micro.EndpointInfo, 0, len(eps))}
	for _, e := range eps {
		info.Endpoints = append(info.Endpoints, e.info())
	}
	return info
}

// stats is the service's $SRV.STATS answer.
func (d *discovery) stats() micro.Stats {
	eps := d.endpoints()
	st := micro.Stats{ServiceIdentity: d.identity, Type: micro.StatsResponseType, Started: d.started,
		Endpoints: make([]*micro.EndpointStats, 0, len(eps))}
	for _, e := range eps {
		st.Endpoints = append(st.Endpoints, e.stats(d.data(e.name)))
	}
	return st
}

// servable is what a Snowflake tells of itself for the endpoint to leave
// the queue group (*snowflake.Node implements it): whether it can issue
// now. A Snowflake without it stays in the group and answers 503.
type servable interface{ Servable() bool }

// servableEvery is how often the service asks whether its snowflake
// generator can issue, to leave or join the endpoint's queue group.
const servableEvery = 50 * time.Millisecond

// watchSnowflake keeps the current binding's snowflake endpoint in its
// queue group exactly while the generator can issue, until the service
// stops. A request that finds the generator unable to issue before the
// watcher noticed is handed on (handOff).
func (s *Service) watchSnowflake(sv servable) {
	defer s.bg.Done()
	t := time.NewTicker(servableEvery)
	defer t.Stop()
	for {
		select {
		case <-s.done:
			return
		case <-t.C:
		}
		b := s.bound.Load()
		switch ok := sv.Servable(); {
		case ok && !b.sf.serving():
			if err := b.sf.join(); err != nil {
				s.cfg.Logger.Warn("dispenser: joining the snowflake endpoint again", "err", err)
				continue
			}
			s.cfg.Logger.Info("dispenser: snowflake IDs can be issued again; back in the queue group", "subject", b.sf.subject)
		case !ok && b.sf.leave():
			s.cfg.Logger.Warn("dispenser: snowflake IDs cannot be issued (no valid lease, or the clock is behind); "+
				"left the queue group until they can", "subject", b.sf.subject)
		}
	}
}

// snowflakeServable reports whether the snowflake endpoint may join its
// queue group now.
func (s *Service) snowflakeServable() bool {
	sv, ok := s.cfg.Snowflake.(servable)
	return !ok || sv.Servable()
}

// handOffWait bounds how long a handed-on request waits for the other
// worker's reply; the Go client's attempt lasts client.AttemptTimeout
// (2.5 s).
const handOffWait = 2 * time.Second

// maxHops is the most workers a request is handed through: each that could
// not serve it adds its hop token to protocol.HopHeader; once maxHops different
// workers did, the last answers 503. With the snowflake endpoint's
// unsubscription ahead of the request (handOff) a request never comes
// back to a worker that left; a segment request may (its worker stays in
// the group: the queue group picks at random), and is handed on again at
// once (handedBefore), up to maxHandOffs hand-offs in all: with two
// workers, one unable to serve, a request then fails only if the group
// picks that one sixteen times in a row (2^-16).
const (
	maxHops     = 3
	maxHandOffs = 16
)

// tooManyHops reports whether a request whose protocol.HopHeader is hops
// has been handed on as often as it may be.
func tooManyHops(hops string) bool {
	if hops == "" {
		return false
	}
	list := strings.Split(hops, ",")
	slices.Sort(list)
	return len(list) >= maxHandOffs || len(slices.Compact(list)) >= maxHops
}

// unservable reports whether err means this worker cannot serve the request
// while another worker might: its snowflake generator cannot issue (no
// lease, fenced, clock behind, closed: not overloaded, which every worker
// is at once and which passes in milliseconds), or no segment came within
// --max-wait (its store slow or unreachable from here). Other 503s (an
// ordered tag's owner changing, an expired period, a purged bucket) are
// the same on every worker.
func (s *Service) unservable(endpoint string, err error) bool {
	switch endpoint {
	case "snowflake":
		_, ok := s.cfg.Snowflake.(servable)
		return ok && snowflake.Unavailable(err) && !errors.Is(err, snowflake.ErrOverloaded)
	case "segment":
		return errors.Is(err, segment.ErrUnavailable) && !errors.Is(err, segment.ErrOrdered)
	}
	return false
}

// handedBefore reports whether req was handed on by this very worker
// before (its hop token in protocol.HopHeader): the queue group gave it
// back. It could not serve it a moment ago, so it hands it on again at
// once (failOrHandOff with errHandedBefore) instead of waiting for what it
// did not get then.
//
// The entry is the worker's hop token, a secret of its own (Service.hop),
// not its service ID, which every requester may learn ($SRV.INFO,
// protocol.WorkerHeader): a requester that named a worker in Id-Hop made
// a worker that could serve hand its request on, up to maxHandOffs times
// (a snowflake endpoint leaving its queue group each time). Entries a
// worker does not recognise only count towards tooManyHops, which a
// requester can use against its own request alone.
func (s *Service) handedBefore(req *nats.Msg) bool {
	if len(req.Header) == 0 {
		return false
	}
	hops := req.Header.Get(protocol.HopHeader)
	for hops != "" {
		var entry string
		entry, hops, _ = strings.Cut(hops, ",")
		if entry == s.hop {
			return true
		}
	}
	return false
}

// errHandedBefore is the error of a request handedBefore, per endpoint:
// what the worker could not do then.
func errHandedBefore(endpoint string) error {
	if endpoint == "snowflake" {
		return snowflake.ErrFenced
	}
	return fmt.Errorf("%w: this worker could not serve the request a moment ago", segment.ErrUnavailable)
}

// failOrHandOff answers r with err, unless err says this worker cannot serve
// it while another might (unservable) and the request can be handed on
// (handOff).
func (s *Service) failOrHandOff(r replier, err error) {
	if r.req != nil && s.unservable(r.endpoint, err) && s.handOff(r, err) {
		return
	}
	r.fail(err)
}

// handOff hands a request this worker cannot serve to another worker of the
// queue group, and reports whether it did; if not, the caller answers it.
// The request goes out again, unchanged but for this worker's ID added to
// protocol.HopHeader, as a request of this worker's own on the
// connection it came in on, and the other worker's reply is passed on to
// the requester. A snowflake endpoint leaves its queue group first: the
// server has the unsubscription before the request, so the group gives it
// to another worker. With no other worker (no responders) or no reply
// within handOffWait, it answers err itself (503); a request already
// handed through maxHops workers (or maxHandOffs times) is answered, never handed on again. Nothing
// was taken for the request here but IDs of a batch cut short, which are
// skipped (a gap); an ID the other worker took for a reply that came too
// late is a gap too: handing on never duplicates.
func (s *Service) handOff(r replier, err error) bool {
	ep, req := r.ep, r.req
	if r.endpoint == "snowflake" && ep.leave() {
		s.cfg.Logger.Warn("dispenser: snowflake IDs cannot be issued; left the queue group until they can",
			"subject", ep.subject, "err", err)
	}
	hops := req.Header.Get(protocol.HopHeader)
	if tooManyHops(hops) {
		return false
	}
	msg := &nats.Msg{Subject: req.Subject, Data: req.Data, Header: make(nats.Header, len(req.Header)+1)}
	for k, v := range req.Header {
		msg.Header[k] = v
	}
	if hops != "" {
		hops += ","
	}
	msg.Header.Set(protocol.HopHeader, hops+s.hop)
	// A subscription of its own for the reply, gone once it came: a
	// request's response subscription would stay on the connection, and
	// Stop waits until the service's subscriptions there are gone.
	msg.Reply = ep.conn.NewInbox()
	sub, serr := ep.conn.SubscribeSync(msg.Reply)
	if serr != nil {
		return false
	}
	if perr := ep.conn.PublishMsg(msg); perr != nil {
		_ = sub.Unsubscribe()
		return false
	}
	r = r.detach()
	s.handedOff[handOffIndex(r.endpoint)].Add(1)
	s.parked.Add(1)
	go func() {
		defer s.parked.Done()
		defer sub.Unsubscribe()
		resp, rerr := sub.NextMsg(handOffWait)
		if rerr == nil && resp.Header.Get("Status") != "" && len(resp.Data) == 0 {
			rerr = nats.ErrNoResponders // the server's status message: nobody took it
		}
		if rerr != nil {
			s.cfg.Logger.Debug("dispenser: a handed-on request got no reply", "subject", req.Subject, "err", rerr)
			r.fail(err)
			return
		}
		if perr := ep.conn.PublishMsg(&nats.Msg{Subject: req.Reply, Header: resp.Header, Data: resp.Data}); perr != nil {
			s.cfg.Logger.Warn("dispenser: passing on a handed-on reply failed", "reply", req.Reply, "err", perr)
		}
	}()
	return true
}

// Serving returns, for each endpoint the worker has (segment once its tag
// list loaded, snowflake and snowflake_decode with Snowflake), whether it
// is in the endpoint's queue group now.
func (s *Service) Serving() map[string]bool {
	b := s.bound.Load()
	out := map[string]bool{}
	for _, e := range b.endpoints() {
		out[e.name] = e.serving()
	}
	return out
}
