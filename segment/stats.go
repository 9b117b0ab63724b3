package segment

import (
	"slices"
	"strings"
	"time"
)

// SegmentStats describes one in-memory segment of a tag.
type SegmentStats struct {
	Start  int64 `json:"start"`
	Cursor int64 `json:"cursor"` // next ID to hand out; End when spent
	End    int64 `json:"end"`    // exclusive
	Step   int64 `json:"step"`
}

// TagStats is what Leaf's /cache page showed for a tag: both segments, the
// dynamic step and the fetch history.
type TagStats struct {
	Tag                string        `json:"tag"`
	Current            *SegmentStats `json:"current,omitempty"`
	Next               *SegmentStats `json:"next,omitempty"`
	NextReady          bool          `json:"next_ready"`
	Loading            bool          `json:"loading"`
	Step               int64         `json:"step"`     // step of the last fetch
	MinStep            int64         `json:"min_step"` // the tag's configured step
	Fetches            int64         `json:"fetches"`
	LastFetchLatencyMS float64       `json:"last_fetch_latency_ms"`
	LastFetch          time.Time     `json:"last_fetch,omitzero"`
	LastError          string        `json:"last_error,omitempty"`
	Waits              int64         `json:"waits"`
	WaitTimeouts       int64         `json:"wait_timeouts"`
}

func segmentStats(s *segment) *SegmentStats {
	if s == nil {
		return nil
	}
	return &SegmentStats{Start: s.start, Cursor: min(s.cursor.Load(), s.end), End: s.end, Step: s.step}
}

// Stats returns the state of every known tag, sorted by tag name.
func (a *Allocator) Stats() []TagStats {
	tags := a.tags.all()
	out := make([]TagStats, 0, len(tags))
	for _, b := range tags {
		cur, nxt := b.cur.Load(), b.next.Load()
		if nxt == cur {
			nxt = nil
		}
		st := TagStats{
			Tag:          b.tag,
			Current:      segmentStats(cur),
			Next:         segmentStats(nxt),
			NextReady:    nxt != nil,
			Loading:      b.loading.Load(),
			Waits:        b.waits.Load(),
			WaitTimeouts: b.timeouts.Load(),
		}
		b.mu.Lock()
		st.Step, st.MinStep, st.Fetches = b.step, b.minStep, b.fetches
		st.LastFetchLatencyMS = float64(b.lastLatency.Microseconds()) / 1000
		st.LastFetch = b.lastFetch
		if b.lastErr != nil {
			st.LastError = b.lastErr.Error()
		}
		b.mu.Unlock()
		out = append(out, st)
	}
	slices.SortFunc(out, func(x, y TagStats) int { return strings.Compare(x.Tag, y.Tag) })
	return out
}
