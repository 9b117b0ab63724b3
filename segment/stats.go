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
	Tag       string        `json:"tag"`
	Current   *SegmentStats `json:"current,omitempty"`
	Next      *SegmentStats `json:"next,omitempty"`
	NextReady bool          `json:"next_ready"`
	Loading   bool          `json:"loading"`
	Step      int64         `json:"step"`     // step in force at the last fetch
	MinStep   int64         `json:"min_step"` // the tag's configured step
	// Depth is how many steps the last fetch took: 1 while the double
	// buffer keeps up, more while requests outrun the fetches.
	Depth              int64     `json:"depth"`
	Fetches            int64     `json:"fetches"`
	LastFetchLatencyMS float64   `json:"last_fetch_latency_ms"`
	LastFetch          time.Time `json:"last_fetch,omitzero"`
	LastError          string    `json:"last_error,omitempty"`
	Waits              int64     `json:"waits"`
	WaitTimeouts       int64     `json:"wait_timeouts"`
}

func segmentStats(s *segment) *SegmentStats {
	if s == nil {
		return nil
	}
	return &SegmentStats{Start: s.start, Cursor: min(s.cursor.Load(), s.end), End: s.end, Step: s.end - s.start}
}

// Stats returns the state of every tag in memory, sorted by tag name. It
// costs memory in proportion to the number of tags; see Totals and StatsOf.
func (a *Allocator) Stats() []TagStats {
	tags := a.tags.all()
	out := make([]TagStats, 0, len(tags))
	for _, b := range tags {
		out = append(out, b.stats())
	}
	slices.SortFunc(out, func(x, y TagStats) int { return strings.Compare(x.Tag, y.Tag) })
	return out
}

// StatsOf returns the state of the named tags that are in memory, in the
// order given.
func (a *Allocator) StatsOf(tags []string) []TagStats {
	var out []TagStats
	for _, tag := range tags {
		if b := a.tags.get(tag); b != nil {
			out = append(out, b.stats())
		}
	}
	return out
}

// Totals sums the state of all tags in memory.
type Totals struct {
	Tags         int   `json:"tags"`          // tags in memory
	Remaining    int64 `json:"remaining_ids"` // IDs in memory, all tags
	Fetches      int64 `json:"fetches"`
	Waits        int64 `json:"waits"`
	WaitTimeouts int64 `json:"wait_timeouts"`
	// Released counts idle tags that gave their IDs back and dropped
	// their buffers.
	Released uint64 `json:"released"`
}

// Totals returns the sums over all tags in memory, without allocating per
// tag.
func (a *Allocator) Totals() Totals {
	t := Totals{Released: a.released.Load()}
	for _, b := range a.tags.all() {
		t.Tags++
		cur, nxt := b.cur.Load(), b.next.Load()
		if nxt == cur {
			nxt = nil // a switch in progress
		}
		for _, s := range []*segment{cur, nxt} {
			if s != nil {
				t.Remaining += s.end - min(s.cursor.Load(), s.end)
			}
		}
		t.Waits += b.waits.Load()
		t.WaitTimeouts += b.timeouts.Load()
		b.mu.Lock()
		t.Fetches += b.fetches
		b.mu.Unlock()
	}
	return t
}

// stats returns b's state.
func (b *buffer) stats() TagStats {
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
	st.Step, st.MinStep, st.Depth, st.Fetches = b.step, b.minStep, b.depth, b.fetches
	st.LastFetchLatencyMS = float64(b.lastLatency.Microseconds()) / 1000
	if b.fetches > 0 {
		st.LastFetch = time.Unix(0, b.lastFetch)
	}
	if b.lastErr != nil {
		st.LastError = b.lastErr.Error()
	}
	b.mu.Unlock()
	return st
}
