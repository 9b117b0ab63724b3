package dispenser

import (
	"slices"
	"time"

	"github.com/dispenser-dev/dispenser/segment"
)

// statsEvery bounds how often micro stats walk the tags when there are
// StatsTags or more of them: however many $SRV.STATS requests come in, at
// most once per statsEvery. With fewer, every request gets fresh stats.
const statsEvery = time.Second

// StatsTags is the most tags whose state micro stats shows: beyond it, those
// fetched most recently, so that the reply fits in a NATS message.
const StatsTags = 1000

func (s *Service) stats(endpoint string) any {
	switch endpoint {
	case "segment":
		s.statsMu.Lock()
		defer s.statsMu.Unlock()
		if now := s.now(); now.Sub(s.statsAt) >= statsEvery || now.Before(s.statsAt) {
			var many bool
			s.segStats, many = s.segmentStats()
			s.statsAt = time.Time{} // a walk over few tags is cheap: fresh every time
			if many {
				s.statsAt = now
			}
		}
		return s.segStats
	case "snowflake":
		return s.cfg.Snowflake.Stats()
	}
	return nil
}

// segmentStats returns the segment endpoint's stats: totals, the ordered
// tags' ownership and the StatsTags tags fetched most recently.
func (s *Service) segmentStats() (_ any, many bool) {
	tags := s.cfg.Segments.Stats()
	shown := len(tags)
	many = shown >= StatsTags
	if shown > StatsTags {
		slices.SortFunc(tags, func(x, y segment.TagStats) int { return y.LastFetch.Compare(x.LastFetch) })
		tags, shown = tags[:StatsTags], StatsTags
	}
	m := map[string]any{"totals": s.cfg.Segments.Totals(), "shown": shown, "tags": tags,
		"refused": map[string]uint64{"no_reply": s.noReply.Load(), "reply_subject": s.badReply.Load()}}
	if ot := s.orderedTags(); ot != nil {
		m["ordered"] = ot.stats()
	}
	return m, many
}
