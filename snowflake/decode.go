package snowflake

import (
	"encoding/json"
	"fmt"
	"strconv"
	"time"
)

// TimeLayout is how Parts renders its time in JSON: RFC 3339 in UTC with
// exactly three fractional digits.
const TimeLayout = "2006-01-02T15:04:05.000Z07:00"

// Parts are the fields of an ID. The zero value is ID 0 at an unknown epoch.
// Parts marshals to JSON as
//
//	{"id":"4398046511104","time":"2026-01-01T00:00:01.024Z","timestamp":1024,"worker":0,"sequence":0}
//
// with the ID as a string (an ID of DefaultLayout does not fit in a
// JavaScript number) and the time in TimeLayout.
type Parts struct {
	ID int64 `json:"id,string"`
	// Time is the epoch plus Timestamp milliseconds, in UTC.
	Time time.Time `json:"time"`
	// Timestamp is the milliseconds since the epoch.
	Timestamp int64 `json:"timestamp"`
	Worker    int64 `json:"worker"`
	Sequence  int64 `json:"sequence"`
	// Region is the region of the worker ID (Layout.RegionBits), and
	// RegionBits how many bits it has; both 0 in a layout without
	// regions. JSON has "region" only with region bits.
	Region     int64 `json:"region"`
	RegionBits int   `json:"-"`
}

// Decode splits id into its fields in DefaultLayout for the given epoch
// (zero means DefaultEpoch): DefaultLayout.Decode(id, epoch). IDs are never
// negative; for a negative id the sign bit is ignored.
//
// Decoding needs the layout the ID was issued in: an ID of JSLayout
// decodes to nonsense here; use JSLayout.Decode.
func Decode(id int64, epoch time.Time) Parts { return DefaultLayout.Decode(id, epoch) }

// Decode splits id into its fields in layout l (the zero Layout means
// DefaultLayout) for the given epoch (zero means DefaultEpoch). Bits above
// the layout's (above bit 52 in JSLayout, the sign bit in DefaultLayout)
// are ignored: check id <= l.MaxID() first to refuse an ID of another
// layout.
func (l Layout) Decode(id int64, epoch time.Time) Parts {
	l = l.orDefault()
	if epoch.IsZero() {
		epoch = DefaultEpoch
	}
	ms := id >> (l.WorkerBits + l.SequenceBits) & l.MaxTimestamp()
	worker := id >> l.SequenceBits & int64(l.MaxWorkerID())
	return Parts{
		ID:         id,
		Time:       epoch.Add(time.Duration(ms) * time.Millisecond).UTC(),
		Timestamp:  ms,
		Worker:     worker,
		Sequence:   id & l.MaxSequence(),
		Region:     l.Region(worker),
		RegionBits: l.RegionBits,
	}
}

// compose builds an ID of DefaultLayout from its fields.
func compose(ms, worker, seq int64) int64 { return DefaultLayout.compose(ms, worker, seq) }

type partsJSON struct {
	ID        string `json:"id"`
	Time      string `json:"time"`
	Timestamp int64  `json:"timestamp"`
	Worker    int64  `json:"worker"`
	Sequence  int64  `json:"sequence"`
	Region    *int64 `json:"region,omitempty"`
}

// MarshalJSON renders p with the time in TimeLayout.
func (p Parts) MarshalJSON() ([]byte, error) {
	j := partsJSON{
		ID:        strconv.FormatInt(p.ID, 10),
		Time:      p.Time.UTC().Format(TimeLayout),
		Timestamp: p.Timestamp,
		Worker:    p.Worker,
		Sequence:  p.Sequence,
	}
	if p.RegionBits > 0 {
		j.Region = &p.Region
	}
	return json.Marshal(j)
}

// UnmarshalJSON parses what MarshalJSON renders.
func (p *Parts) UnmarshalJSON(b []byte) error {
	var j partsJSON
	if err := json.Unmarshal(b, &j); err != nil {
		return err
	}
	id, err := strconv.ParseInt(j.ID, 10, 64)
	if err != nil {
		return fmt.Errorf("snowflake: parts: id: %w", err)
	}
	t, err := time.Parse(time.RFC3339Nano, j.Time)
	if err != nil {
		return fmt.Errorf("snowflake: parts: time: %w", err)
	}
	*p = Parts{ID: id, Time: t.UTC(), Timestamp: j.Timestamp, Worker: j.Worker, Sequence: j.Sequence}
	if j.Region != nil {
		p.Region = *j.Region
	}
	return nil
}
