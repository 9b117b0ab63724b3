package dispenser

import (
	"bytes"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"

	"github.com/dispenser-dev/dispenser/segment"
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

// forwardBacklog is how many requests may wait for the forwarder; beyond
// it a request is forwarded by its handler, alone.
const forwardBacklog = 4096

// forwardItem is a request for an ordered tag on its way to the owner.
type forwardItem struct {
	owner  string // the owner's subject (Route.Subject); the tag follows
	tag    string
	reply  string
	n      int
	format Format
	worker bool // the requester asked for WorkerHeader
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
func (s *Service) enqueueForward(r replier, owner, tag string, n int, format Format) {
	it := forwardItem{owner: owner, tag: tag, reply: r.req.Reply(), n: n, format: format, worker: r.worker}
	select {
	case s.fwd.ch <- it:
		s.forwarded.Add(1)
	default:
		s.forwardNow(r, it)
	}
}

// forwardNow sends one request to the owner from the caller's goroutine.
func (s *Service) forwardNow(r replier, it forwardItem) {
	if err := s.publishForward(it.owner+"."+it.tag, appendForwardLine(nil, it)); err != nil {
		r.fail(fmt.Errorf("%w: forwarding to the owner: %w", ErrOwnershipMoving, err))
		return
	}
	s.forwarded.Add(1)
}

func (s *Service) publishForward(subject string, body []byte) error {
	msg := &nats.Msg{Subject: subject, Data: body, Header: nats.Header{ForwardedHeader: []string{s.id}}}
	return s.cfg.Conn.PublishMsg(msg)
}

func appendForwardLine(dst []byte, it forwardItem) []byte {
	dst = append(dst, it.reply...)
	dst = append(dst, ' ')
	dst = strconv.AppendInt(dst, int64(it.n), 10)
	dst = append(dst, ' ')
	if it.format == FormatRange {
		dst = append(dst, "range"...)
	} else {
		dst = append(dst, "list"...)
	}
	if it.worker {
		return append(dst, " 1\n"...)
	}
	return append(dst, " 0\n"...)
}

// runForwarder sends the forwarder's requests, as many per message as have
// piled up, until Stop, then those left.
func (s *Service) runForwarder() {
	defer s.parked.Done()
	var batch []forwardItem
	type dest struct{ owner, tag string }
	bodies := map[dest][]byte{} // almost always one
	send := func() {
		clear(bodies)
		for _, it := range batch {
			d := dest{it.owner, it.tag}
			bodies[d] = appendForwardLine(bodies[d], it)
		}
		for d, body := range bodies {
			subject := d.owner + "." + d.tag
			if err := s.publishForward(subject, body); err != nil {
				s.cfg.Logger.Warn("dispenser: forwarding to the owner of an ordered tag", "subject", subject, "err", err)
				s.failForwarded(body, err)
			}
		}
		batch = batch[:0]
	}
	stopping := false
	for {
		if !stopping {
			select {
			case it := <-s.fwd.ch:
				batch = append(batch, it)
			case <-s.fwd.stop:
				stopping = true // send what is left, then return
			}
		}
	more:
		for len(batch) < maxForwardBatch {
			select {
			case it := <-s.fwd.ch:
				batch = append(batch, it)
			default:
				break more
			}
		}
		if len(batch) > 0 {
			send()
		}
		if stopping && len(s.fwd.ch) == 0 {
			return
		}
	}
}

// failForwarded answers the requests of a batch that could not be sent.
func (s *Service) failForwarded(body []byte, err error) {
	eachForwarded(body, func(it forwardItem, perr error) {
		if perr == nil {
			r := s.newReplier(forwardedRequest{it}, "segment")
			r.inline = false
			r.fail(fmt.Errorf("%w: forwarding to the owner: %w", ErrOwnershipMoving, err))
		}
	})
}

// eachForwarded calls fn with every request of a forwarded message's body;
// perr says what is wrong with a line (fn then gets what could be read).
func eachForwarded(body []byte, fn func(it forwardItem, perr error)) {
	for line := range bytes.Lines(body) {
		it, err := parseForwardLine(bytes.TrimSuffix(line, []byte{'\n'}))
		fn(it, err)
	}
}

// parseForwardLine reads "<reply> <count> <format> <worker>".
func parseForwardLine(line []byte) (forwardItem, error) {
	var f [4][]byte
	rest := line
	for i := range f {
		var ok bool
		if f[i], rest, ok = bytes.Cut(rest, []byte{' '}); !ok && i < 3 || ok && i == 3 || len(f[i]) == 0 {
			return forwardItem{}, fmt.Errorf("%w: forwarded line %q", ErrBadCount, truncate(string(line), 200))
		}
	}
	it := forwardItem{reply: string(f[0]), worker: string(f[3]) == "1"}
	var err error
	if it.n, err = strconv.Atoi(string(f[1])); err != nil {
		return it, fmt.Errorf("%w %q", ErrBadCount, truncate(string(f[1]), 32))
	}
	switch string(f[2]) {
	case "list":
		it.format = FormatList
	case "range":
		it.format = FormatRange
	default:
		return it, fmt.Errorf("%w: format %q: want list or range", ErrBadHeader, truncate(string(f[2]), 32))
	}
	return it, nil
}

// handleForwarded serves requests other workers forwarded to this one as
// the owner of their ordered tag, on <OwnerSubject>.<tag>.
func (s *Service) handleForwarded(msg *nats.Msg) {
	tag := msg.Subject[strings.LastIndexByte(msg.Subject, '.')+1:]
	valid := segment.ValidTag(tag)
	eachForwarded(msg.Data, func(it forwardItem, perr error) {
		it.tag = tag
		if it.reply == "" {
			s.cfg.Logger.Warn("dispenser: unreadable forwarded request", "subject", msg.Subject, "err", perr)
			return
		}
		r := s.newReplier(forwardedRequest{it}, "segment")
		r.inline = false
		r.tag = tag
		switch {
		case !valid:
			r.fail(fmt.Errorf("%w %q", ErrBadSubject, msg.Subject))
		case perr != nil:
			r.fail(perr)
		case it.n < 1 || it.n > s.cfg.MaxBatch:
			r.fail(fmt.Errorf("%w: %d", ErrBadCount, it.n))
		case !s.cfg.Owners.Owns(tag):
			r.fail(fmt.Errorf("%w: %q is not owned here any more", ErrOwnershipMoving, tag))
		default:
			s.takeOwned(r, tag, it.n, it.format)
		}
	})
}

// forwardedRequest is a forwarded request as a micro.Request, so that it is
// answered like any other (by publishing to its reply subject: it is never
// answered inline).
type forwardedRequest struct{ it forwardItem }

var workerHeaders = micro.Headers{WorkerHeader: []string{"1"}}

var errPublishOnly = errors.New("dispenser: forwarded requests are answered by publishing")

func (f forwardedRequest) Respond([]byte, ...micro.RespondOpt) error  { return errPublishOnly }
func (f forwardedRequest) RespondJSON(any, ...micro.RespondOpt) error { return errPublishOnly }
func (f forwardedRequest) Error(string, string, []byte, ...micro.RespondOpt) error {
	return errPublishOnly
}
func (f forwardedRequest) Data() []byte { return nil }
func (f forwardedRequest) Headers() micro.Headers {
	if f.it.worker {
		return workerHeaders
	}
	return nil
}
func (f forwardedRequest) Subject() string { return f.it.owner + "." + f.it.tag }
func (f forwardedRequest) Reply() string   { return f.it.reply }
