package dispenser

import (
	"time"

	"github.com/nats-io/nats.go"
)

// SetClock sets the clock that ages the cached micro stats.
func SetClock(s *Service, now func() time.Time) {
	s.statsMu.Lock()
	s.now = now
	s.statsMu.Unlock()
}

// HandedOff returns how many snowflake requests s handed to another worker.
func HandedOff(s *Service) uint64 { return s.handedOff.Load() }

// WeightSubs is how many queue subscriptions an owner adds per weighted tag.
const WeightSubs = weightSubs

// Weighted returns the tags whose queue group s's current binding weights.
func Weighted(s *Service) []string { return s.orderedTags().weights.weighted() }

// Weigh weights tag on s's current binding with requests served by h
// instead of the segment endpoint's handler (before any other weight), and
// returns the drop of that weight (as the weigher drops one).
func Weigh(s *Service, tag string, h func()) (leave func(), err error) {
	w := &s.orderedTags().weights
	w.mu.Lock()
	defer w.mu.Unlock()
	w.handle = func(*endpoint, *nats.Msg, *scratch) { h() }
	wt, err := w.weigh(s.bound.Load().seg, tag, time.Now())
	if err != nil {
		return nil, err
	}
	return func() {
		w.mu.Lock()
		defer w.mu.Unlock()
		w.leave(wt)
	}, nil
}
