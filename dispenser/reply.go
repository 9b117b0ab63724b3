package dispenser

import (
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"

	"github.com/dispenser-dev/dispenser/protocol"
	"github.com/dispenser-dev/dispenser/segment"
)

// replier answers one request, by publishing on the connection the service
// serves on now. Inline answers (from the endpoint's handler) use the
// handler's scratch memory; answers from a parked request's goroutine
// (detach) do not. A request another worker forwarded has no endpoint.
type replier struct {
	s         *Service
	ep        *endpoint // nil for a forwarded or direct request
	req       *nats.Msg // the request as received; nil for a forwarded or direct one
	forwarded bool      // forwarded in a batch: reply is a slice of it
	reply     string    // the requester's reply subject
	inline    bool
	scratch   *scratch // the handler's memory, for inline replies of IDs
	endpoint  string
	tag       string        // metrics label
	start     time.Duration // when it came (mono); zero without metrics
	// direct: the request came on this worker's direct subject.
	direct bool
	// owner, if set, is this worker's direct subject for tag, for
	// protocol.DirectHeader: set on the owner's replies with IDs to
	// requests that did not come on it.
	owner string
	// rq is what the request asks for, once read: rq.N IDs (0 until
	// its count is read) in rq.Format; rq.Worker and rq.Direct, whether
	// it asked for protocol.WorkerHeader and protocol.DirectHeader. Its
	// token rq.Token ("" if none) is echoed in every reply to it;
	// rq.BodyToken: it came in the body, so a reply with IDs carries it
	// (and owner) in the body's first line (protocol.AppendTokenLine),
	// not in headers; an error reply carries it in protocol.TokenHeader
	// either way. The handlers read it in place (protocol.Request.Read):
	// a Request returned and copied in costs more than the reading.
	rq protocol.Request
}

// init makes r, a zero replier, the replier of req, which came on ep at
// start (mono, read by endpoint.serve); the caller then reads r.rq
// (protocol.Request.Read, or ReadHeaders). In place, not returned: the
// replier is large, and a copy of it costs on every request.
func (r *replier) init(s *Service, ep *endpoint, req *nats.Msg, start time.Duration) {
	r.s, r.ep, r.req, r.reply, r.inline, r.endpoint, r.start = s, ep, req, req.Reply, true, ep.name, start
}

// forwardedReplier returns the replier of a request for tag that another
// worker forwarded to this one (its reply subject and token are slices of
// the forwarded message).
func (s *Service) forwardedReplier(f protocol.Forward, tag string) replier {
	r := replier{s: s, forwarded: true, reply: f.Reply, endpoint: "segment", tag: tag,
		rq: protocol.Request{N: f.N, Format: f.Format, Worker: f.Worker, Direct: f.Direct, Token: f.Token, BodyToken: f.BodyToken}}
	if s.metrics != nil {
		r.start = mono()
	}
	return r
}

// directReplier returns the replier of a request for tag a requester sent
// to this worker's direct subject, and its token, count and format's error,
// if any (the replier is then good for fail only). It asked for nothing
// by protocol.DirectHeader: it came on the direct subject.
func (s *Service) directReplier(msg *nats.Msg, tag string) (replier, error) {
	rq, err := protocol.ReadRequest(msg.Header, msg.Data, s.limits)
	r := replier{s: s, reply: msg.Reply, endpoint: "segment", tag: tag, direct: true, rq: rq}
	if s.metrics != nil {
		r.start = mono()
	}
	if err == nil && r.rq.Format == protocol.FormatFormatted {
		err = errFormattedOrdered
	}
	return r, err
}

// forward is the request r as a forwarded line carries it.
func (r replier) forward() protocol.Forward {
	return protocol.Forward{Reply: r.reply, N: r.rq.N, Format: r.rq.Format, Worker: r.rq.Worker, Direct: r.rq.Direct, Token: r.rq.Token,
		BodyToken: r.rq.BodyToken}
}

// replyOwned answers r as the owner of its ordered tag, with runs, r.rq.N IDs
// in all: a request that asked for protocol.DirectHeader and did not come
// on this worker's direct subject learns it.
func (s *Service) replyOwned(r replier, runs []segment.Run) {
	if r.rq.Direct && !r.direct && s.cfg.OwnerID != "" {
		r.owner = s.directSubject(r.tag)
	}
	s.reply(&r, r.rq.Format, runs, r.rq.N)
}

// directSubject is this worker's direct subject for tag
// (protocol.DirectSubject), from directSubjects.
func (s *Service) directSubject(tag string) string {
	if v, ok := s.directSubjects.Load(tag); ok {
		return v.(string)
	}
	d := protocol.DirectSubject(s.cfg.Prefix, tag, s.cfg.OwnerID)
	s.directSubjects.Store(tag, d)
	return d
}

// detach returns r for use off the handler's goroutine: answered by
// publishing, and without a forwarded batch's memory.
func (r replier) detach() replier {
	r.inline, r.scratch = false, nil
	if r.forwarded {
		// A forwarded request's reply subject and token are slices of
		// its whole batch: do not keep the batch while the request waits.
		r.reply, r.rq.Token = strings.Clone(r.reply), strings.Clone(r.rq.Token)
	}
	return r
}

// head starts the body of a reply with IDs in dst: the token line
// (protocol.AppendTokenLine) if the request's token came in its body,
// nothing otherwise. The IDs are appended after it.
func (r *replier) head(dst []byte) []byte {
	if r.rq.BodyToken {
		return protocol.AppendTokenLine(dst, r.rq.Token, r.owner)
	}
	return dst
}

// respond publishes a reply with ids IDs, data its whole body (head
// included).
func (r *replier) respond(data []byte, ids int) {
	// Counted before the reply goes out, so that a client that got its
	// IDs finds them counted.
	r.s.metrics.observe(r.endpoint, r.tag, "200", ids, r.start)
	var err error
	if r.rq.Worker || !r.rq.BodyToken && (r.owner != "" || r.rq.Token != "") {
		err = r.s.conn().PublishMsg(&nats.Msg{Subject: r.reply, Header: nats.Header(r.header()), Data: data})
	} else { // a plain publish: a nats.Msg per reply costs
		err = r.s.conn().Publish(r.reply, data)
	}
	if err != nil {
		r.s.cfg.Logger.Warn("dispenser: reply failed", "endpoint", r.endpoint, "tag", r.tag, "reply", r.reply, "err", err)
	}
}

// header is the header of a reply that asked for protocol.WorkerHeader,
// carries protocol.DirectHeader or echoes protocol.TokenHeader: an error
// reply always echoes the token there; a reply with IDs to a request
// whose token came in the body has it, and owner, in the body instead
// (head), and fail clears owner.
func (r replier) header() micro.Headers {
	h := make(micro.Headers, 3)
	if r.rq.Token != "" && !r.rq.BodyToken {
		h[protocol.TokenHeader] = []string{r.rq.Token}
	}
	if r.rq.Worker {
		h[protocol.WorkerHeader] = []string{r.s.ID()}
	}
	if r.owner != "" {
		h[protocol.DirectHeader] = []string{r.owner}
	}
	return h
}

func (r replier) fail(err error) {
	code, desc := r.s.Classify(err)
	r.s.metrics.observe(r.endpoint, r.tag, code, 0, r.start)
	if r.ep != nil {
		r.ep.failed(code + ":" + desc)
	}
	r.owner = ""           // an error names no direct subject
	r.rq.BodyToken = false // and carries the token in its header
	msg := &nats.Msg{Subject: r.reply, Header: nats.Header(r.header())}
	msg.Header[micro.ErrorHeader] = []string{desc}
	msg.Header[micro.ErrorCodeHeader] = []string{code}
	perr := r.s.conn().PublishMsg(msg)
	if perr != nil {
		r.s.cfg.Logger.Warn("dispenser: error reply failed", "endpoint", r.endpoint, "tag", r.tag, "reply", r.reply, "err", perr)
	}
}

// replyNumbered answers with runs written out by num (Id-Format:
// formatted).
func (s *Service) replyNumbered(r *replier, num segment.Numbering, runs []segment.Run, n int) {
	if r.inline {
		r.scratch.buf = num.Append(r.head(r.scratch.buf[:0]), runs)
		r.respond(r.scratch.buf, n)
		return
	}
	bp := s.bufs.Get().(*[]byte)
	buf := num.Append(r.head((*bp)[:0]), runs)
	r.respond(buf, n)
	if cap(buf) <= 1<<16 {
		*bp = buf
		s.bufs.Put(bp)
	}
}

// reply answers with runs. Inline replies format into their handler's
// scratch buffer (an endpoint's handler runs on one goroutine: its
// subscription's); parked ones into a pooled buffer.
func (s *Service) reply(r *replier, format protocol.Format, runs []segment.Run, n int) {
	if r.inline {
		r.scratch.buf = protocol.AppendRuns(r.head(r.scratch.buf[:0]), format, runs)
		r.respond(r.scratch.buf, n)
		return
	}
	bp := s.bufs.Get().(*[]byte)
	buf := protocol.AppendRuns(r.head((*bp)[:0]), format, runs)
	r.respond(buf, n)
	if cap(buf) <= 1<<16 { // keep big batch buffers out of the pool
		*bp = buf
		s.bufs.Put(bp)
	}
}

// scratch is memory one endpoint's handler reuses from request to request.
// Only that endpoint's handler goroutine touches it.
type scratch struct {
	start time.Duration // when the request being handled came (mono); 0 if not timed
	// counted is how many requests were timed one by one (up to
	// timedExactly), rng the state that samples the others.
	counted int
	rng     uint64
	ids     []int64
	runs    []segment.Run
	buf     []byte
}
