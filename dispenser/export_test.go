package dispenser

import "time"

// SetClock sets the clock that ages the cached micro stats.
func SetClock(s *Service, now func() time.Time) {
	s.statsMu.Lock()
	s.now = now
	s.statsMu.Unlock()
}

// HandedOff returns how many snowflake requests s handed to another worker.
func HandedOff(s *Service) uint64 { return s.handedOff[0].Load() + s.handedOff[1].Load() }
