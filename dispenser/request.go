package dispenser

import (
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"

	"github.com/dispenser-dev/dispenser/protocol"
)

// headerValues returns the values of header key, matched without regard
// to case (NATS headers are case-sensitive; people type id-format).
func headerValues(h micro.Headers, key string) []string {
	if v, ok := h[key]; ok || len(h) == 0 {
		return v
	}
	for k, v := range h {
		if strings.EqualFold(k, key) {
			return v
		}
	}
	return nil
}

// parse reads the count and format of a request.
func (s *Service) parse(req *nats.Msg) (int, protocol.Format, error) {
	return s.parseMsg(micro.Headers(req.Header), req.Data)
}

// parseMsg reads the count and format of a request's headers and body.
func (s *Service) parseMsg(h micro.Headers, data []byte) (int, protocol.Format, error) {
	format, err := protocol.ParseFormat(headerValues(h, protocol.FormatHeader))
	if err != nil {
		return 0, 0, err
	}
	n, err := protocol.ParseCount(data, s.cfg.MaxBatch)
	if err != nil {
		return n, format, err
	}
	if err := s.checkFits(n, format); err != nil {
		return 0, format, err
	}
	return n, format, nil
}

// checkFits refuses, before any ID is taken, a batch whose reply may not fit
// in one message of the server the worker is connected to now (a reconnect
// may have brought a smaller max payload; a reply in runs may need twice
// the bytes of a list).
func (s *Service) checkFits(n int, format protocol.Format) error {
	if n*protocol.ListBytesPerID < replyHeaderRoom {
		return nil // every server's max payload holds it: spare the lock
	}
	mp := s.conn().MaxPayload()
	if limit := fits(mp, format); n > limit {
		return fmt.Errorf("%w %d: a reply of that many IDs may not fit in one message of this server (max payload %d bytes); at most %d (%s)",
			protocol.ErrBadCount, n, mp, limit, format)
	}
	return nil
}

// admit reports whether the service may answer req at all: only if its
// reply subject passes CheckReply. A refused request is counted and logged
// (at a bounded rate); it gets no answer and takes no ID.
func (s *Service) admit(req *nats.Msg) bool {
	return s.admitReply(req.Reply, req.Subject)
}

func (s *Service) admitReply(reply, subject string) bool {
	err := protocol.CheckReply(reply, s.own...)
	if err == nil {
		return true
	}
	if errors.Is(err, protocol.ErrNoReply) {
		s.noReply.Add(1)
	} else {
		s.badReply.Add(1)
	}
	if ok, suppressed := s.refuseLog.allow(time.Now()); ok {
		s.cfg.Logger.Warn("dispenser: request refused for its reply subject; not answered, no ID taken",
			"subject", truncate(subject, 200), "err", err, "refused_since_last_log", suppressed)
	}
	return false
}

// rateLimit lets one event through per refuseLogEvery and counts the rest.
// It is safe for concurrent use.
type rateLimit struct {
	next       atomic.Int64 // UnixNano before which events are suppressed
	suppressed atomic.Uint64
}

// refuseLogEvery spaces the log lines about refused requests.
const refuseLogEvery = 10 * time.Second

// allow reports whether an event at now may be logged, and how many were
// suppressed since the last one that was.
func (l *rateLimit) allow(now time.Time) (bool, uint64) {
	next := l.next.Load()
	if now.UnixNano() < next || !l.next.CompareAndSwap(next, now.Add(refuseLogEvery).UnixNano()) {
		l.suppressed.Add(1)
		return false, 0
	}
	return true, l.suppressed.Swap(0)
}

// replyHeaderRoom is kept free of the max payload for a reply's headers.
const replyHeaderRoom = 1024

// fits returns the most IDs a reply in format can carry within maxPayload.
func fits(maxPayload int64, format protocol.Format) int {
	return int(max(maxPayload-replyHeaderRoom, 0) / int64(format.BytesPerID()))
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}
