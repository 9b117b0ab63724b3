package dispenser

import (
	"fmt"
	"slices"
	"strings"
	"sync"

	"github.com/nats-io/nats.go"

	"github.com/dispenser-dev/dispenser/protocol"
)

// Forwarding in batches. A worker hands the requests for an ordered tag it
// does not own to one goroutine, the forwarder, which sends whatever has
// piled up meanwhile as one message to the owner's subject: one request per
// line, "<reply subject> <count> <format> <worker>". The owner answers each
// requester directly. Under load the second hop then costs the nats-server
// one message for many requests; when requests come one at a time, each
// goes alone, at once.

// maxForwardBatch bounds the requests of one forwarded message.
const maxForwardBatch = 256

// forwardHeaderRoom is what a forwarded message keeps free of its server's
// max payload for its header (at most half of a small max payload).
const forwardHeaderRoom = 1024

// forwardBacklog is how many requests may wait for the forwarder; beyond
// it a request is forwarded by its handler, alone.
const forwardBacklog = 4096

// forwardItem is a request for an ordered tag on its way to the owner.
type forwardItem struct {
	owner string // the owner's subject (Route.Subject); the tag follows
	tag   string
	protocol.Forward
}

// forwarder batches forwarded requests. It is safe for concurrent use.
type forwarder struct {
	ch   chan forwardItem
	stop chan struct{} // closed when ch is to be emptied and left
	once sync.Once     // closes stop
}

// leave makes run send what is left in the channel and return.
func (f *forwarder) leave() {
	if f.stop != nil {
		f.once.Do(func() { close(f.stop) })
	}
}

// enqueueForward hands r to the forwarder, or, if it is backed up, sends it
// alone.
func (t *orderedTags) enqueueForward(r replier, owner, tag string) {
	it := forwardItem{owner: owner, tag: tag, Forward: r.forward()}
	select {
	case t.fwd.ch <- it:
		t.s.forwarded.Add(1)
	default:
		t.forwardNow(r, it)
	}
}

// forwardNow sends one request to the owner from the caller's goroutine.
func (t *orderedTags) forwardNow(r replier, it forwardItem) {
	msg := nats.Msg{Subject: it.owner + "." + it.tag, Data: protocol.AppendForward(nil, it.Forward), Header: t.forwardHeader()}
	if err := t.conn.PublishMsg(&msg); err != nil {
		r.fail(fmt.Errorf("%w: forwarding to the owner: %w", ErrOwnershipMoving, err))
		return
	}
	t.s.forwarded.Add(1)
}

// forwardHeader is the header of the messages this worker forwards.
func (t *orderedTags) forwardHeader() nats.Header {
	return nats.Header{protocol.ForwardedHeader: []string{t.id}}
}

// outbox is the message being built for one owner and tag.
type outbox struct {
	owner, tag string
	body       []byte
}

// runForwarder sends the forwarder's requests, as many per message as have
// piled up, until leave, then those left.
func (t *orderedTags) runForwarder() {
	defer t.parked.Done()
	hdr := t.forwardHeader() // read-only from here on
	var batch []forwardItem
	// outs has one outbox per owner and tag of a batch, almost always one;
	// their bodies are reused from batch to batch.
	var outs []outbox
	publish := func(o *outbox, body []byte) {
		msg := nats.Msg{Subject: o.owner + "." + o.tag, Data: body, Header: hdr}
		if err := t.conn.PublishMsg(&msg); err != nil {
			t.s.cfg.Logger.Warn("ordered: forwarding to the owner of an ordered tag", "subject", msg.Subject, "err", err)
			t.failForwarded(o.tag, body, err)
		}
	}
	send := func() {
		// A message stays within the server's max payload (read each time:
		// a reconnect may change it), with room for the header: a line that
		// would not fit starts the next message.
		maxPayload := int(t.conn.MaxPayload())
		limit := maxPayload - min(forwardHeaderRoom, maxPayload/2)
		outs = outs[:0]
		last := -1
		for _, it := range batch {
			if last < 0 || outs[last].owner != it.owner || outs[last].tag != it.tag {
				last = slices.IndexFunc(outs, func(o outbox) bool { return o.owner == it.owner && o.tag == it.tag })
				if last < 0 {
					if len(outs) == cap(outs) {
						outs = append(outs, outbox{})
					} else {
						outs = outs[:len(outs)+1]
					}
					last = len(outs) - 1
					outs[last] = outbox{owner: it.owner, tag: it.tag, body: outs[last].body[:0]}
				}
			}
			o := &outs[last]
			n := len(o.body)
			o.body = protocol.AppendForward(o.body, it.Forward)
			if len(o.body) > limit && n > 0 {
				publish(o, o.body[:n])
				o.body = append(o.body[:0], o.body[n:]...)
			}
		}
		for i := range outs {
			publish(&outs[i], outs[i].body)
		}
		batch = batch[:0]
	}
	stopping := false
	for {
		if !stopping {
			select {
			case it := <-t.fwd.ch:
				batch = append(batch, it)
			case <-t.fwd.stop:
				stopping = true // send what is left, then return
			}
		}
	more:
		for len(batch) < maxForwardBatch {
			select {
			case it := <-t.fwd.ch:
				batch = append(batch, it)
			default:
				break more
			}
		}
		if len(batch) > 0 {
			send()
		}
		if stopping && len(t.fwd.ch) == 0 {
			return
		}
	}
}

// failForwarded answers the requests for tag in body, a message that could
// not be sent.
func (t *orderedTags) failForwarded(tag string, body []byte, err error) {
	for line := range strings.Lines(string(body)) {
		if f, perr := protocol.ParseForward(strings.TrimSuffix(line, "\n")); perr == nil {
			t.s.forwardedReplier(f, tag).fail(fmt.Errorf("%w: forwarding to the owner: %w", ErrOwnershipMoving, err))
		}
	}
}
