package dispenser

import "time"

// SetClock sets the clock that ages the cached micro stats.
func SetClock(s *Service, now func() time.Time) {
	s.statsMu.Lock()
	s.now = now
	s.statsMu.Unlock()
}
