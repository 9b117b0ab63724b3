package dispenser

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/nats-io/nats.go"

	"github.com/dispenser-dev/dispenser/protocol"
	"github.com/dispenser-dev/dispenser/segment"
)

// handleSegment serves a segment request; sc is its handler's memory.
func (s *Service) handleSegment(ep *endpoint, req *nats.Msg, sc *scratch) {
	if !s.admit(req) {
		return
	}
	var r replier
	r.init(s, ep, req, sc.start)
	rerr := r.rq.Read(req.Header, req.Data, s.limits)
	if rerr != nil && errors.Is(rerr, protocol.ErrBadToken) {
		r.fail(rerr) // its replies carry no token
		return
	}
	r.scratch = sc
	if s.handedBefore(req) {
		s.failOrHandOff(r, errHandedBefore(r.endpoint))
		return
	}
	tag, err := protocol.ParseTag(req.Subject, s.segPrefix)
	if err != nil {
		r.fail(err)
		return
	}
	r.tag = tag
	if rerr != nil { // format, count or fit
		r.fail(rerr)
		return
	}
	n, format := r.rq.N, r.rq.Format
	var arr [2]segment.Run
	if format == protocol.FormatFormatted {
		s.takeNumbered(r, tag, n, arr[:0])
		return
	}
	runs, pending, err := s.cfg.Segments.TakeNow(tag, n, arr[:0])
	switch {
	case errors.Is(err, segment.ErrOrdered) && s.orderedTags() != nil:
		s.orderedTags().serve(r, tag)
	case err != nil:
		s.failOrHandOff(r, err)
	case pending != nil:
		s.park(r, pending)
	default:
		s.reply(&r, format, runs, n)
	}
}

// park answers a request that waits for a segment from a goroutine of its
// own, so that the handler goes on with other requests (and other tags).
func (s *Service) park(r replier, p *segment.Pending) {
	r = r.detach()
	s.parked.Add(1)
	go func() {
		defer s.parked.Done()
		runs, err := p.Wait(context.Background())
		if ot := s.orderedTags(); errors.Is(err, segment.ErrOrdered) && ot != nil {
			// Known to be ordered only now: its owner serves it.
			ot.reroute(r, r.tag)
			return
		}
		if err != nil {
			s.failOrHandOff(r, err)
			return
		}
		s.reply(&r, r.rq.Format, runs, r.rq.N)
	}()
}

// errFormattedOrdered and errFormattedSnowflake refuse Id-Format:
// formatted where there is no format.
var (
	errFormattedOrdered   = fmt.Errorf("%w: %s formatted: ordered tags have no formatted numbers", protocol.ErrBadHeader, protocol.FormatHeader)
	errFormattedSnowflake = fmt.Errorf("%w: %s formatted: snowflake IDs have no format", protocol.ErrBadHeader, protocol.FormatHeader)
)

// takeNumbered serves a request for formatted numbers (Id-Format:
// formatted) of a segment tag.
func (s *Service) takeNumbered(r replier, tag string, n int, dst []segment.Run) {
	runs, num, pending, err := s.cfg.Segments.TakeNowNumbered(tag, n, dst)
	switch {
	case errors.Is(err, segment.ErrOrdered):
		r.fail(errFormattedOrdered)
	case err != nil:
		s.failOrHandOff(r, err)
	case pending != nil:
		r = r.detach()
		s.parked.Add(1)
		go func() {
			defer s.parked.Done()
			runs, err := pending.Wait(context.Background())
			switch {
			case errors.Is(err, segment.ErrOrdered):
				r.fail(errFormattedOrdered)
			case err != nil:
				s.failOrHandOff(r, err)
			default:
				s.replyNumbered(&r, pending.Numbering(), runs, n)
			}
		}()
	default:
		s.replyNumbered(&r, num, runs, n)
	}
}

// handleSnowflake serves a snowflake request; sc is its handler's memory.
func (s *Service) handleSnowflake(ep *endpoint, req *nats.Msg, sc *scratch) {
	if !s.admit(req) {
		return
	}
	var r replier
	r.init(s, ep, req, sc.start)
	err := r.rq.Read(req.Header, req.Data, s.limits)
	if err != nil && errors.Is(err, protocol.ErrBadToken) {
		r.fail(err) // its replies carry no token
		return
	}
	if s.handedBefore(req) {
		s.failOrHandOff(r, errHandedBefore(r.endpoint))
		return
	}
	if err == nil && r.rq.Format == protocol.FormatFormatted {
		err = errFormattedSnowflake
	}
	if err != nil { // format, count or fit
		r.fail(err)
		return
	}
	n, format := r.rq.N, r.rq.Format
	ids, err := s.cfg.Snowflake.AppendIDs(sc.ids[:0], n)
	sc.ids = ids
	if err != nil {
		s.failOrHandOff(r, err)
		return
	}
	if format == protocol.FormatRange {
		sc.runs = protocol.Runs(sc.runs[:0], ids)
		sc.buf = protocol.AppendRanges(r.head(sc.buf[:0]), sc.runs)
	} else {
		sc.buf = protocol.AppendIDs(r.head(sc.buf[:0]), ids)
	}
	r.respond(sc.buf, n)
}

func (s *Service) handleDecode(ep *endpoint, req *nats.Msg, sc *scratch) {
	if !s.admit(req) {
		return
	}
	var r replier
	r.init(s, ep, req, sc.start)
	var err error
	if r.rq, err = protocol.ReadHeaders(req.Header); err != nil {
		r.fail(err)
		return
	}
	body := strings.TrimSpace(string(req.Data))
	id, err := strconv.ParseInt(body, 10, 64)
	if err != nil || id < 0 {
		r.fail(fmt.Errorf("%w: %q is not a non-negative decimal int64", protocol.ErrBadID, truncate(body, 64)))
		return
	}
	layout := s.cfg.Snowflake.Layout()
	if id > layout.MaxID() {
		r.fail(fmt.Errorf("%w: %d is above the largest ID of layout %s (%d)", protocol.ErrBadID, id, layout, layout.MaxID()))
		return
	}
	s.metrics.observe(r.endpoint, "", "200", 0, r.start)
	data, err := json.Marshal(layout.Decode(id, s.cfg.Snowflake.Epoch()))
	if err == nil {
		if hd := r.header(); len(hd) > 0 {
			err = s.conn().PublishMsg(&nats.Msg{Subject: req.Reply, Header: nats.Header(hd), Data: data})
		} else {
			err = s.conn().Publish(req.Reply, data)
		}
	}
	if err != nil {
		s.cfg.Logger.Warn("dispenser: reply failed", "subject", req.Subject, "err", err)
	}
}
