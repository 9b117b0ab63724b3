package dispenser

import (
	"errors"
	"fmt"
	"maps"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
)

// Weighting an ordered tag's queue group toward its owner.
//
// A request on <prefix>.segment.<tag> goes to one member of the queue
// group, which the nats-server picks uniformly at random among the
// group's subscriptions whose subjects match: every worker's segment
// endpoint (<prefix>.segment.>) and any queue subscription of the same
// group on the literal subject alike, counted per subscription, not per
// connection. So the owner of an ordered tag weights itself: while it
// owns the tag, serves it (a request for it reached it) and its segment
// endpoint is in the queue group, it holds weightSubs more queue
// subscriptions on <prefix>.segment.<tag> in the endpoint's group. Of N
// workers, the owner then gets (weightSubs+1)/(N+weightSubs) of the tag's
// requests straight from the server (33 of 35 with three workers); the
// others still reach another worker, which forwards them as before.
//
// This is routing only. A request on a weight subscription is a segment
// request like any other: the segment endpoint's handler serves it
// (reply-subject rule, ReadRequest, hand-off, metrics, the endpoint's
// $SRV.STATS counts), and a tag that is not ordered or not owned any more
// when it arrives is served or forwarded as on the endpoint. Nothing
// assumes another worker answers a request: whoever gets it serves or
// forwards it.
//
// The weight subscriptions deliver into one channel, and one goroutine
// serves their requests (serve), as the endpoint's one subscription does:
// 33 subscriptions with a goroutine each spread the requests over 33
// goroutines woken one request at a time, which halved the owner's rate
// alone (measured, issue 38). The limit: nats.go drops a request that
// does not fit in the channel (a slow consumer, reported to the
// connection's error handler; the requester times out), where the
// endpoint's own subscription has no limit. Each request waits for its
// reply, so the channel holds at most the requests in flight to this
// owner's weighted tags at once: weightBacklog of them
// (TestWeightLosesNoRequestWhenBehind).
//
// A worker out of the segment endpoint's queue group must get none of
// these requests either (docs/reliability.md, "A worker that cannot serve
// is not asked"): the weight is dropped when the binding's ordered tags
// drain (Stop, Move, a failed bind), before the endpoint leaves, and a
// pass of the weigher (every weighEvery, and at once when a request finds
// the owner moved) drops it when the tag is not owned any more, has had
// no request through the weight for weightIdle, or the endpoint is not in
// its group (it leaves only on close today; a leave of its own would be
// seen within weighEvery). Leaving takes the same care as
// endpoint.leaveLocked (drain vs reconnect).

// Bounds of the weight.
const (
	// weightSubs is K, the queue subscriptions an owner adds per tag: with
	// N workers the owner gets (K+1)/(N+K) of the tag's requests straight
	// and (N-1)/(N+K) are forwarded: 6% with 3 workers, 11% with 5, 22%
	// with 10. A constant: the workers a worker sees are known only at
	// start (checkPeers), and 32 more subscriptions cost the server and
	// the client little.
	weightSubs = 32
	// maxWeightedTags bounds the tags one worker weights at a time (each
	// costs weightSubs subscriptions on the server, and one goroutine
	// each in nats.go): the first that are requested; a tag idle for
	// weightIdle makes room.
	maxWeightedTags = 16
	// weighEvery spaces the weigher's passes.
	weighEvery = 100 * time.Millisecond
	// weightIdle is how long a weight stays without a request on it.
	weightIdle = time.Minute
	// weightBacklog is the capacity of the channel of the weights'
	// requests (512 KiB of pointers, made with the first weight).
	weightBacklog = 1 << 16
)

// weigher holds the weights of one binding's ordered tags (orderedTags).
// Lock order: mu is taken after Service.mu (a failed bind drains under
// it) and never with an endpoint's mu; while held it takes the leases'
// Owns and the connection's locks only.
type weigher struct {
	t    *orderedTags
	wake chan struct{} // a pass is due: buffered, 1
	stop chan struct{} // closed by close
	// handle serves a request: serveOne (tests hold it).
	handle func(seg *endpoint, msg *nats.Msg, sc *scratch)
	mu     sync.Mutex // protects the fields below
	// tags are the tags weighted now; wanted those a request asked for
	// since the last pass (at most maxWeightedTags in all).
	tags   map[string]*weight
	wanted map[string]struct{}
	closed bool
	// ch takes the requests of every weight, which serve answers as
	// seg's; both set with the first weight.
	ch  chan *nats.Msg
	seg *endpoint
	// leaving are the subscriptions of weights dropped that may still
	// deliver into ch.
	leaving []*nats.Subscription
	// known is tags and wanted for the request path, read without mu
	// (replaced, never changed).
	known atomic.Pointer[map[string]struct{}]
}

// weight is one weighted tag's subscriptions.
type weight struct {
	seg       *endpoint // the segment endpoint it weights
	subs      []*nats.Subscription
	delivered int64     // the subscriptions' messages at the last pass
	active    time.Time // when a pass last saw them grow
}

// start makes w the weigher of t, wanting seed, and starts its passes.
func (w *weigher) start(t *orderedTags, seed []string) {
	w.t, w.wake, w.stop = t, make(chan struct{}, 1), make(chan struct{})
	w.handle = serveOne
	w.tags, w.wanted = map[string]*weight{}, map[string]struct{}{}
	for _, tag := range seed {
		w.wanted[tag] = struct{}{}
	}
	w.publish()
	t.parked.Add(1)
	go w.run()
}

// note tells w that this worker served a request for tag as its owner:
// weight it at the next pass if it is not and there is room. It is on the
// request path: a map lookup when the tag is weighted (or wanted), the
// mutex otherwise.
func (w *weigher) note(tag string) {
	known := w.known.Load()
	if known == nil { // not started (tests of the forwarder alone)
		return
	}
	if _, ok := (*known)[tag]; ok {
		return
	}
	w.mu.Lock()
	if w.closed || len(w.tags)+len(w.wanted) >= maxWeightedTags {
		w.mu.Unlock()
		return
	}
	w.wanted[tag] = struct{}{}
	w.publish()
	w.mu.Unlock()
	w.poke()
}

// moved tells w that a request for tag found another owner: a weight it
// holds goes at once rather than at the next tick.
func (w *weigher) moved(tag string) {
	if known := w.known.Load(); known != nil {
		if _, ok := (*known)[tag]; ok {
			w.poke()
		}
	}
}

func (w *weigher) poke() {
	select {
	case w.wake <- struct{}{}:
	default:
	}
}

// publish renews known from tags and wanted; call it with mu held.
func (w *weigher) publish() {
	known := make(map[string]struct{}, len(w.tags)+len(w.wanted))
	for tag := range w.tags {
		known[tag] = struct{}{}
	}
	maps.Copy(known, w.wanted)
	w.known.Store(&known)
}

// weighted returns the tags weighted now, sorted.
func (w *weigher) weighted() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return slices.Sorted(maps.Keys(w.tags))
}

// close drops every weight for good; the subscriptions drain (requests
// received are still served).
func (w *weigher) close() {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.closed || w.stop == nil {
		return
	}
	w.closed = true
	for tag, wt := range w.tags {
		w.leave(wt)
		delete(w.tags, tag)
	}
	clear(w.wanted)
	w.publish()
	close(w.stop)
}

// run makes a pass every weighEvery and when poked, until close.
func (w *weigher) run() {
	defer w.t.parked.Done()
	tick := time.NewTicker(weighEvery)
	defer tick.Stop()
	for {
		select {
		case <-w.stop:
			return
		case <-w.wake:
		case <-tick.C:
		}
		w.pass(time.Now())
	}
}

// pass drops the weights that may not stay and adds the wanted ones that
// may be added: a tag is weighted only while this worker owns it, the
// binding is the service's current one and its segment endpoint is in
// the queue group.
func (w *weigher) pass(now time.Time) {
	t := w.t
	var seg *endpoint
	if b := t.s.bound.Load(); b != nil && b.ordered == t && b.seg.serving() {
		seg = b.seg
	}
	owners := t.s.cfg.Owners
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.closed {
		return
	}
	for tag, wt := range w.tags {
		if seg == wt.seg && owners.Owns(tag) && !wt.idle(now) {
			continue
		}
		w.leave(wt)
		delete(w.tags, tag)
	}
	if seg != nil { // else wanted waits for the endpoint (a Move)
		for tag := range w.wanted {
			delete(w.wanted, tag)
			if !owners.Owns(tag) {
				continue
			}
			wt, err := w.weigh(seg, tag, now)
			if err != nil {
				t.s.cfg.Logger.Warn("ordered: weighting the queue group toward this owner", "tag", tag, "err", err)
				continue
			}
			w.tags[tag] = wt
		}
	}
	w.publish()
}

// idle reports whether wt had no request since weightIdle before now, and
// records its count.
func (wt *weight) idle(now time.Time) bool {
	var n int64
	for _, sub := range wt.subs {
		d, _ := sub.Delivered()
		n += d
	}
	if n != wt.delivered {
		wt.delivered, wt.active = n, now
	}
	return now.Sub(wt.active) > weightIdle
}

// weigh subscribes weightSubs times to tag's subject in seg's queue
// group, into ch, and starts serve with the first weight. Call it with mu
// held.
func (w *weigher) weigh(seg *endpoint, tag string, now time.Time) (*weight, error) {
	t := w.t
	if w.ch == nil {
		w.ch, w.seg = make(chan *nats.Msg, weightBacklog), seg
		t.parked.Add(1)
		go w.serve(w.ch, seg)
	}
	subject := t.s.segPrefix + tag
	wt := &weight{seg: seg, active: now}
	for range weightSubs {
		sub, err := t.conn.ChanQueueSubscribe(subject, seg.queue, w.ch)
		if err != nil {
			w.leave(wt)
			return nil, fmt.Errorf("subscribing %s: %w", subject, err)
		}
		wt.subs = append(wt.subs, sub)
	}
	return wt, nil
}

// serve answers the weights' requests, as seg's own subscription does
// (endpoint.join: its own scratch, counted in seg's requests and
// processing time), until close, then those the dropped weights still
// deliver, until no subscription can deliver more.
func (w *weigher) serve(ch chan *nats.Msg, seg *endpoint) {
	defer w.t.parked.Done()
	sc := new(scratch)
	for {
		select {
		case msg := <-ch:
			w.handle(seg, msg, sc)
			continue
		case <-w.stop:
		}
		for !w.quiet() || len(ch) > 0 {
			select {
			case msg := <-ch:
				w.handle(seg, msg, sc)
			case <-time.After(time.Millisecond):
			}
		}
		return
	}
}

// serveOne serves one request of a weight as seg's subscription does.
func serveOne(seg *endpoint, msg *nats.Msg, sc *scratch) { seg.serve(msg, sc) }

// quiet reports whether no subscription of a dropped weight can deliver
// into ch any more.
func (w *weigher) quiet() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.leaving = slices.DeleteFunc(w.leaving, func(sub *nats.Subscription) bool { return !sub.IsValid() })
	return len(w.leaving) == 0
}

// leave drops wt's subscriptions from the queue group with the care of
// endpoint.leaveLocked (where why is written): drained, so that what was
// received is still served; while the connection is reconnecting,
// unsubscribed at once (the reconnect does not resend them, the server
// dropped the old connection's: nothing more to do,
// TestWeightLeftWhileReconnecting); and if the connection reconnected
// before the drains ended (a dead connection not noticed yet), reconnected
// once more so that the server drops the copies the reconnect resent
// (TestWeightLeftOnADeadConnection).
//
// Call it with w.mu held.
func (w *weigher) leave(wt *weight) {
	nc := w.t.conn
	w.leaving = slices.DeleteFunc(w.leaving, func(sub *nats.Subscription) bool { return !sub.IsValid() })
	w.leaving = append(w.leaving, wt.subs...)
	reconnects := nc.Stats().Reconnects
	for _, sub := range wt.subs {
		if err := sub.Drain(); err != nil && !errors.Is(err, nats.ErrConnectionClosed) {
			_ = sub.Unsubscribe()
		}
	}
	subs := wt.subs
	wt.subs = nil
	if nc.IsReconnecting() {
		for _, sub := range subs {
			_ = sub.Unsubscribe()
		}
		return
	}
	go leftAfterDrains(nc, subs, reconnects)
}

// leftAfterDrains is endpoint.leftAfterDrain for many subscriptions: one
// reconnect for all.
func leftAfterDrains(nc *nats.Conn, subs []*nats.Subscription, reconnects uint64) {
	for _, sub := range subs {
		for sub.IsDraining() {
			time.Sleep(10 * time.Millisecond)
		}
	}
	if nc.Stats().Reconnects != reconnects && !nc.IsClosed() {
		_ = nc.ForceReconnect()
	}
}
