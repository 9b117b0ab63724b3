package snowflake

import (
	"encoding/json"
	"errors"
	"fmt"
	"testing"
	"time"
)

// jsSafe is 2^53: JavaScript numbers hold every integer below it exactly.
const jsSafe = 1 << 53

var layouts = []struct {
	name   string
	layout Layout
	maxID  int64
}{
	{name: "default", layout: DefaultLayout, maxID: 1<<63 - 1},
	{name: "js", layout: JSLayout, maxID: jsSafe - 1},
}

func TestLayoutCapacity(t *testing.T) {
	for _, tt := range []struct {
		name                  string
		layout                Layout
		workers, perMs, count int
		years                 float64
	}{
		{name: "default", layout: DefaultLayout, workers: 1024, perMs: 4096, count: 65536, years: 69.7},
		{name: "zero is default", layout: Layout{}, workers: 1024, perMs: 4096, count: 65536, years: 69.7},
		{name: "js", layout: JSLayout, workers: 32, perMs: 128, count: 8192, years: 69.7},
	} {
		t.Run(tt.name, func(t *testing.T) {
			l := tt.layout
			if got := l.MaxWorkerID() + 1; got != tt.workers {
				t.Errorf("workers: got %d, want %d", got, tt.workers)
			}
			if got := int(l.MaxSequence()) + 1; got != tt.perMs {
				t.Errorf("IDs per ms: got %d, want %d", got, tt.perMs)
			}
			if got := l.MaxCount(); got != tt.count {
				t.Errorf("MaxCount: got %d, want %d", got, tt.count)
			}
			years := float64(l.MaxTimestamp()) / float64(365.25*24*time.Hour/time.Millisecond)
			if got, want := fmt.Sprintf("%.1f", years), fmt.Sprintf("%.1f", tt.years); got != want {
				t.Errorf("years: got %s, want %s", got, want)
			}
		})
	}
}

func TestParseLayout(t *testing.T) {
	for _, tt := range []struct {
		name, in string
		want     Layout
		wantErr  error
	}{
		{name: "empty", in: "", want: DefaultLayout},
		{name: "default", in: "default", want: DefaultLayout},
		{name: "js", in: "js", want: JSLayout},
		{name: "JS", in: " JS ", want: JSLayout},
		{name: "unknown", in: "js53", wantErr: ErrInvalidSettings},
	} {
		t.Run(tt.name, func(t *testing.T) {
			got, err := ParseLayout(tt.in)
			if !errors.Is(err, tt.wantErr) {
				t.Fatalf("error: got %v, want %v", err, tt.wantErr)
			}
			if got != tt.want {
				t.Errorf("got %v, want %v", got, tt.want)
			}
		})
	}
}

func TestLayoutCheck(t *testing.T) {
	for _, tt := range []struct {
		name    string
		layout  Layout
		wantErr error
	}{
		{name: "zero", layout: Layout{}},
		{name: "custom 40+8+8", layout: Layout{TimeBits: 40, WorkerBits: 8, SequenceBits: 8}},
		{name: "more than 63 bits", layout: Layout{TimeBits: 42, WorkerBits: 10, SequenceBits: 12}, wantErr: ErrInvalidSettings},
		{name: "no worker bits", layout: Layout{TimeBits: 41, SequenceBits: 12}, wantErr: ErrInvalidSettings},
		{name: "too many worker bits", layout: Layout{TimeBits: 40, WorkerBits: 11, SequenceBits: 12}, wantErr: ErrInvalidSettings},
		{name: "too many sequence bits", layout: Layout{TimeBits: 40, WorkerBits: 10, SequenceBits: 13}, wantErr: ErrInvalidSettings},
		{name: "too few time bits", layout: Layout{TimeBits: 30, WorkerBits: 5, SequenceBits: 7}, wantErr: ErrInvalidSettings},
	} {
		t.Run(tt.name, func(t *testing.T) {
			_, err := New(Settings{Layout: tt.layout, Logger: testLogger(t)})
			if !errors.Is(err, tt.wantErr) {
				t.Errorf("New: got error %v, want %v", err, tt.wantErr)
			}
		})
	}
}

// TestLayoutEdges issues the last IDs of a layout's time range with its
// largest worker ID and sequence, and one past it.
func TestLayoutEdges(t *testing.T) {
	for _, tt := range layouts {
		t.Run(tt.name, func(t *testing.T) {
			l := tt.layout
			if got := l.compose(l.MaxTimestamp(), int64(l.MaxWorkerID()), l.MaxSequence()); got != tt.maxID || got != l.MaxID() {
				t.Fatalf("largest ID: got %d, want %d (MaxID %d)", got, tt.maxID, l.MaxID())
			}
			// The clock at the second last millisecond of the range.
			epoch := t0.Add(-time.Duration(l.MaxTimestamp()-1) * time.Millisecond)
			c := newFakeClock(t, t0)
			g := newTestGenerator(t, c, Settings{Epoch: epoch, Layout: l, WorkerID: l.MaxWorkerID(), MaxBorrow: time.Hour})
			ids, err := g.NextN(int(2 * (l.MaxSequence() + 1)))
			if err != nil {
				t.Fatalf("up to the last millisecond: %v", err)
			}
			requireIncreasing(t, ids)
			last := ids[len(ids)-1]
			if last != tt.maxID {
				t.Errorf("last ID: got %d, want %d", last, tt.maxID)
			}
			want := Parts{ID: last, Time: epoch.Add(time.Duration(l.MaxTimestamp()) * time.Millisecond),
				Timestamp: l.MaxTimestamp(), Worker: int64(l.MaxWorkerID()), Sequence: l.MaxSequence()}
			if got := g.Decode(last); got != want {
				t.Errorf("last ID decodes to %+v, want %+v", got, want)
			}
			for _, id := range ids {
				if id > tt.maxID || id < 0 {
					t.Fatalf("ID %d above the layout's largest %d", id, tt.maxID)
				}
			}
			if _, err := g.Next(); !errors.Is(err, ErrOverTimeLimit) {
				t.Errorf("one millisecond past the range: got error %v, want ErrOverTimeLimit", err)
			}

			for _, e := range []struct {
				name    string
				s       Settings
				wantErr error
			}{
				{name: "clock one ms past the range", s: Settings{Epoch: t0.Add(-time.Duration(l.MaxTimestamp()+1) * time.Millisecond)}, wantErr: ErrOverTimeLimit},
				{name: "clock at the last ms", s: Settings{Epoch: t0.Add(-time.Duration(l.MaxTimestamp()) * time.Millisecond)}},
				{name: "largest worker ID", s: Settings{WorkerID: l.MaxWorkerID()}},
				{name: "worker ID past the worker bits", s: Settings{WorkerID: l.MaxWorkerID() + 1}, wantErr: ErrInvalidWorkerID},
			} {
				t.Run(e.name, func(t *testing.T) {
					s := e.s
					s.Layout, s.Now, s.Logger = l, c.Now, testLogger(t)
					_, err := New(s)
					if !errors.Is(err, e.wantErr) {
						t.Errorf("New: got error %v, want %v", err, e.wantErr)
					}
				})
			}
			for _, e := range []struct {
				name    string
				n       int
				wantErr error
			}{
				{name: "MaxCount", n: l.MaxCount()},
				{name: "MaxCount+1", n: l.MaxCount() + 1, wantErr: ErrInvalidCount},
			} {
				t.Run(e.name, func(t *testing.T) {
					g := newTestGenerator(t, newFakeClock(t, t0), Settings{Layout: l, MaxBorrow: time.Hour})
					ids, err := g.NextN(e.n)
					if !errors.Is(err, e.wantErr) {
						t.Fatalf("NextN(%d): got error %v, want %v", e.n, err, e.wantErr)
					}
					if err == nil && ids[len(ids)-1] > tt.maxID {
						t.Errorf("NextN(%d): last ID %d above %d", e.n, ids[len(ids)-1], tt.maxID)
					}
				})
			}
		})
	}
}

// TestLayoutRandomSequence: the random first sequence of a millisecond
// stays within a sixteenth of the JS layout's 128 sequence numbers.
func TestLayoutRandomSequence(t *testing.T) {
	c := newFakeClock(t, t0)
	g := newTestGenerator(t, c, Settings{Layout: JSLayout, RandomSequence: true})
	for range 200 {
		id, err := g.Next()
		if err != nil {
			t.Fatal(err)
		}
		p := g.Decode(id)
		if p.Sequence >= 8 || p.Timestamp != c.Now().Sub(DefaultEpoch).Milliseconds() {
			t.Fatalf("first ID of a millisecond: %+v, want sequence below 8 at the clock's millisecond", p)
		}
		c.Add(time.Millisecond)
	}
}

func TestLayoutDecodeRoundTrip(t *testing.T) {
	epoch := time.Date(2025, 6, 1, 0, 0, 0, 0, time.UTC)
	for _, tt := range layouts {
		l := tt.layout
		for _, f := range []struct {
			name           string
			ms, worker, sq int64
		}{
			{name: "zero", ms: 0, worker: 0, sq: 0},
			{name: "a day", ms: 86_400_000, worker: 3, sq: 5},
			{name: "largest", ms: l.MaxTimestamp(), worker: int64(l.MaxWorkerID()), sq: l.MaxSequence()},
		} {
			t.Run(tt.name+"/"+f.name, func(t *testing.T) {
				id := l.compose(f.ms, f.worker, f.sq)
				want := Parts{ID: id, Time: epoch.Add(time.Duration(f.ms) * time.Millisecond), Timestamp: f.ms, Worker: f.worker, Sequence: f.sq}
				got := l.Decode(id, epoch)
				if got != want {
					t.Fatalf("Decode(%d): got %+v, want %+v", id, got, want)
				}
				b, err := json.Marshal(got)
				if err != nil {
					t.Fatal(err)
				}
				var back Parts
				if err := json.Unmarshal(b, &back); err != nil || back != want {
					t.Errorf("JSON %s: got %+v (%v), want %+v", b, back, err, want)
				}
			})
		}
		// IDs a generator issued decode to its worker ID and clock.
		t.Run(tt.name+"/issued", func(t *testing.T) {
			c := newFakeClock(t, t0)
			g := newTestGenerator(t, c, Settings{Layout: l, WorkerID: 5})
			ids, err := g.NextN(300)
			if err != nil {
				t.Fatal(err)
			}
			for _, id := range ids {
				p := l.Decode(id, DefaultEpoch)
				if p.Worker != 5 || p.Timestamp < t0.Sub(DefaultEpoch).Milliseconds() || p.Time.After(t0.Add(time.Second)) {
					t.Fatalf("ID %d decodes to %+v, want worker 5 near %s", id, p, t0)
				}
			}
		})
	}
}

// TestParseEpoch: an epoch is RFC 3339; Go's zero time, which Settings
// read as "not set" (DefaultEpoch), is refused in any zone.
func TestParseEpoch(t *testing.T) {
	tests := []struct {
		name, in string
		want     time.Time
		wantErr  error
	}{
		{name: "the default", in: "2026-01-01T00:00:00Z", want: DefaultEpoch},
		{name: "Leaf's, in milliseconds", in: "2010-11-04T01:42:54.657Z", want: time.UnixMilli(1288834974657)},
		{name: "another zone", in: "2026-01-01T08:00:00+08:00", want: DefaultEpoch},
		{name: "the zero time", in: "0001-01-01T00:00:00Z", wantErr: ErrInvalidSettings},
		{name: "the zero time in another zone", in: "0001-01-01T01:00:00+01:00", wantErr: ErrInvalidSettings},
		{name: "not RFC 3339", in: "2026-01-01", wantErr: ErrInvalidSettings},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := ParseEpoch(tt.in)
			if !errors.Is(err, tt.wantErr) {
				t.Fatalf("ParseEpoch(%q) error = %v, want %v", tt.in, err, tt.wantErr)
			}
			if err == nil && !got.Equal(tt.want) {
				t.Errorf("ParseEpoch(%q) = %v, want %v", tt.in, got, tt.want)
			}
		})
	}
}
