package snowflake

import (
	"fmt"
	"strings"
	"time"
)

// Layout is the bit layout of IDs below the sign bit: TimeBits of
// milliseconds since the epoch, WorkerBits of worker ID and SequenceBits of
// sequence within the millisecond, from the most significant bit. The time
// unit is always one millisecond. The top RegionBits of the worker ID name
// a region (docs/regions.md): a worker of region N holds only the worker
// IDs whose top bits are N, so that regions leasing from buckets of their
// own never share a worker ID.
//
// The zero Layout means DefaultLayout. Any other must have TimeBits of at
// least 31, WorkerBits in 1..10, SequenceBits in 1..12, RegionBits below
// WorkerBits and at most 63 bits in all; New and Start refuse others
// with ErrInvalidSettings. A layout is chosen when its lease bucket is
// created and recorded there; it cannot be changed in place.
type Layout struct {
	// Name names the layout in logs, flags and the lease bucket
	// ("default", "js"); layouts are compared by their bits only.
	Name         string
	TimeBits     int
	WorkerBits   int
	SequenceBits int
	// RegionBits are the top bits of the worker ID that name the region;
	// 0 (the named layouts): no regions.
	RegionBits int
}

// The named layouts (ParseLayout).
var (
	// DefaultLayout is 41 bits of milliseconds (about 69 years), 10 bits of
	// worker ID (1024 workers) and 12 bits of sequence (4096 IDs per
	// millisecond, 4,096,000 per second per worker): 63 bits.
	DefaultLayout = Layout{Name: "default", TimeBits: TimeBits, WorkerBits: WorkerBits, SequenceBits: SequenceBits}

	// JSLayout keeps every ID below 2^53, so that it survives a
	// JavaScript number (Number.MAX_SAFE_INTEGER is 2^53-1): 41 bits of
	// milliseconds (about 69 years, like DefaultLayout), 5 bits of worker
	// ID (32 workers) and 7 bits of sequence (128 IDs per millisecond,
	// 128,000 per second per worker; 4,096,000 per second for 32 workers).
	JSLayout = Layout{Name: "js", TimeBits: 41, WorkerBits: 5, SequenceBits: 7}
)

// Layout limits (Layout.check).
const (
	maxLayoutWorkerBits   = 10 // worker keys are scanned at every claim
	maxLayoutSequenceBits = 12
	minLayoutTimeBits     = 31 // about 24.8 days
)

// ParseLayout returns the named layout: "default" (or "") or "js".
func ParseLayout(name string) (Layout, error) {
	switch strings.ToLower(strings.TrimSpace(name)) {
	case "", DefaultLayout.Name:
		return DefaultLayout, nil
	case JSLayout.Name:
		return JSLayout, nil
	}
	return Layout{}, fmt.Errorf("%w: layout %q: want %q or %q", ErrInvalidSettings, name, DefaultLayout.Name, JSLayout.Name)
}

// ParseEpoch reads an epoch as the commands take it (RFC 3339). Go's zero
// time (0001-01-01T00:00:00Z, in any zone) is refused: Settings read a
// zero Epoch as "not set" and count from DefaultEpoch, so it would mean
// another epoch than it says. Errors wrap ErrInvalidSettings.
func ParseEpoch(s string) (time.Time, error) {
	e, err := time.Parse(time.RFC3339, s)
	switch {
	case err != nil:
		return time.Time{}, fmt.Errorf("%w: %w", ErrInvalidSettings, err)
	case e.IsZero():
		return time.Time{}, fmt.Errorf("%w: the zero time stands for \"not set\" (the default epoch, %s), and it is far beyond any layout's range: give the epoch the workers use, e.g. %[2]s",
			ErrInvalidSettings, DefaultEpoch.Format(time.RFC3339))
	}
	return e, nil
}

// orDefault returns DefaultLayout for the zero Layout, and l otherwise.
func (l Layout) orDefault() Layout {
	if l.TimeBits == 0 && l.WorkerBits == 0 && l.SequenceBits == 0 {
		return DefaultLayout
	}
	return l
}

// check validates a layout (after orDefault).
func (l Layout) check() error {
	switch {
	case l.TimeBits < minLayoutTimeBits:
		return fmt.Errorf("%w: layout %s: TimeBits %d below %d", ErrInvalidSettings, l, l.TimeBits, minLayoutTimeBits)
	case l.WorkerBits < 1 || l.WorkerBits > maxLayoutWorkerBits:
		return fmt.Errorf("%w: layout %s: WorkerBits %d not in 1..%d", ErrInvalidSettings, l, l.WorkerBits, maxLayoutWorkerBits)
	case l.SequenceBits < 1 || l.SequenceBits > maxLayoutSequenceBits:
		return fmt.Errorf("%w: layout %s: SequenceBits %d not in 1..%d", ErrInvalidSettings, l, l.SequenceBits, maxLayoutSequenceBits)
	case l.RegionBits < 0 || l.RegionBits >= l.WorkerBits:
		return fmt.Errorf("%w: layout %s: RegionBits %d not in 0..%d (at least one bit of the worker ID must be the region's own)", ErrInvalidSettings, l, l.RegionBits, l.WorkerBits-1)
	case l.TimeBits+l.WorkerBits+l.SequenceBits > 63:
		return fmt.Errorf("%w: layout %s: more than 63 bits", ErrInvalidSettings, l)
	}
	return nil
}

// Same reports whether l and o lay IDs out alike (the zero Layout is
// DefaultLayout; names are not compared).
func (l Layout) Same(o Layout) bool {
	l, o = l.orDefault(), o.orDefault()
	return l.TimeBits == o.TimeBits && l.WorkerBits == o.WorkerBits && l.SequenceBits == o.SequenceBits &&
		l.RegionBits == o.RegionBits
}

// String renders l as its name and bits, e.g. "js (41+5+7 bits)", or
// "default (41+10+12 bits, 2 region bits)".
func (l Layout) String() string {
	l = l.orDefault()
	name := l.Name
	if name == "" {
		name = "custom"
	}
	if l.RegionBits > 0 {
		return fmt.Sprintf("%s (%d+%d+%d bits, %d region bits)", name, l.TimeBits, l.WorkerBits, l.SequenceBits, l.RegionBits)
	}
	return fmt.Sprintf("%s (%d+%d+%d bits)", name, l.TimeBits, l.WorkerBits, l.SequenceBits)
}

// MaxRegion is the largest region of the layout: 2^RegionBits - 1 (0
// without region bits).
func (l Layout) MaxRegion() int { l = l.orDefault(); return 1<<l.RegionBits - 1 }

// RegionWorkerIDs returns the worker IDs of region: first..last, the IDs
// whose top RegionBits are region. Without region bits, region 0 has them
// all.
func (l Layout) RegionWorkerIDs(region int) (first, last int) {
	l = l.orDefault()
	own := l.WorkerBits - l.RegionBits
	return region << own, region<<own | (1<<own - 1)
}

// Region returns the region of a worker ID: its top RegionBits.
func (l Layout) Region(worker int64) int64 {
	l = l.orDefault()
	return worker >> (l.WorkerBits - l.RegionBits)
}

// MaxWorkerID is the largest worker ID of the layout.
func (l Layout) MaxWorkerID() int { l = l.orDefault(); return 1<<l.WorkerBits - 1 }

// MaxSequence is the largest sequence number within a millisecond.
func (l Layout) MaxSequence() int64 { l = l.orDefault(); return 1<<l.SequenceBits - 1 }

// MaxTimestamp is the largest number of milliseconds since the epoch.
func (l Layout) MaxTimestamp() int64 { l = l.orDefault(); return 1<<l.TimeBits - 1 }

// MaxID is the largest ID of the layout: 2^63-1 for DefaultLayout, 2^53-1
// for JSLayout.
func (l Layout) MaxID() int64 {
	l = l.orDefault()
	return 1<<(l.TimeBits+l.WorkerBits+l.SequenceBits) - 1
}

// MaxCount is the largest batch one call can ask for: 64 ms of one
// worker's sequence space, at most 65,536 (MaxCount). DefaultLayout:
// 65,536 (16 ms); JSLayout: 8,192 (64 ms, within DefaultMaxBorrow).
func (l Layout) MaxCount() int {
	l = l.orDefault()
	return min(MaxCount, 64<<l.SequenceBits)
}

// randomSpan bounds the random first sequence number of a millisecond
// (Settings.RandomSequence): RandomSequenceSpan, or a sixteenth of the
// sequence space if that is less (JSLayout: 8).
func (l Layout) randomSpan() int {
	l = l.orDefault()
	return min(RandomSequenceSpan, max(1, (1<<l.SequenceBits)/16))
}

// compose builds an ID from its fields.
func (l Layout) compose(ms, worker, seq int64) int64 {
	l = l.orDefault()
	return ms<<(l.WorkerBits+l.SequenceBits) | worker<<l.SequenceBits | seq
}

// layoutRecord is how the lease bucket's config record holds the layout:
//
//	{"name":"js","time_bits":41,"worker_bits":5,"sequence_bits":7}
//
// with "region_bits" when the layout has them.
type layoutRecord struct {
	Name         string `json:"name"`
	TimeBits     int    `json:"time_bits"`
	WorkerBits   int    `json:"worker_bits"`
	SequenceBits int    `json:"sequence_bits"`
	RegionBits   int    `json:"region_bits,omitempty"`
}

func newLayoutRecord(l Layout) *layoutRecord {
	l = l.orDefault()
	return &layoutRecord{Name: l.Name, TimeBits: l.TimeBits, WorkerBits: l.WorkerBits, SequenceBits: l.SequenceBits, RegionBits: l.RegionBits}
}

// layout returns the recorded layout; nil (a bucket written by a version
// without layouts) means DefaultLayout.
func (r *layoutRecord) layout() Layout {
	if r == nil {
		return DefaultLayout
	}
	return Layout{Name: r.Name, TimeBits: r.TimeBits, WorkerBits: r.WorkerBits, SequenceBits: r.SequenceBits, RegionBits: r.RegionBits}
}
