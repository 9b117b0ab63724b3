package dispenser

import (
	"errors"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/dispenser-dev/dispenser/protocol"
)

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

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}
