package snowflake

import (
	"encoding/json"
	"testing"
	"time"
)

func TestDecode(t *testing.T) {
	epoch := time.Date(2020, 1, 1, 0, 0, 0, 0, time.UTC)
	tests := []struct {
		name  string
		epoch time.Time
		id    int64
		want  Parts
	}{
		{
			name: "zero",
			id:   0,
			want: Parts{Time: DefaultEpoch},
		},
		{
			name: "all fields",
			id:   compose(1024, 7, 5),
			want: Parts{Time: DefaultEpoch.Add(1024 * time.Millisecond), Timestamp: 1024, Worker: 7, Sequence: 5},
		},
		{
			name:  "custom epoch",
			epoch: epoch,
			id:    compose(86_400_000, MaxWorkerID, MaxSequence),
			want:  Parts{Time: epoch.Add(24 * time.Hour), Timestamp: 86_400_000, Worker: MaxWorkerID, Sequence: MaxSequence},
		},
		{
			name: "largest",
			id:   compose(MaxTimestamp, MaxWorkerID, MaxSequence),
			want: Parts{Time: DefaultEpoch.Add(MaxTimestamp * time.Millisecond), Timestamp: MaxTimestamp, Worker: MaxWorkerID, Sequence: MaxSequence},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tt.want.ID = tt.id
			got := Decode(tt.id, tt.epoch)
			if !got.Time.Equal(tt.want.Time) || got.ID != tt.want.ID || got.Timestamp != tt.want.Timestamp ||
				got.Worker != tt.want.Worker || got.Sequence != tt.want.Sequence {
				t.Fatalf("Decode(%d) = %+v, want %+v", tt.id, got, tt.want)
			}
			if back := compose(got.Timestamp, got.Worker, got.Sequence); back != tt.id {
				t.Errorf("compose(Decode(%d)) = %d", tt.id, back)
			}
			b, err := json.Marshal(got)
			if err != nil {
				t.Fatal(err)
			}
			var parsed Parts
			if err := json.Unmarshal(b, &parsed); err != nil {
				t.Fatalf("unmarshal %s: %v", b, err)
			}
			if parsed != got {
				t.Errorf("JSON round trip: got %+v, want %+v", parsed, got)
			}
		})
	}
}

// TestDecodeRoundTrip decodes what a generator issued.
func TestDecodeRoundTrip(t *testing.T) {
	epoch := time.Date(2025, 6, 1, 0, 0, 0, 0, time.UTC)
	now := time.Date(2026, 2, 3, 4, 5, 6, 789_000_000, time.UTC)
	g, err := New(Settings{Epoch: epoch, WorkerID: 513, Now: func() time.Time { return now }})
	if err != nil {
		t.Fatal(err)
	}
	ids, err := g.NextN(3)
	if err != nil {
		t.Fatal(err)
	}
	for i, id := range ids {
		p := Decode(id, epoch)
		if !p.Time.Equal(now) || p.Worker != 513 || p.Sequence != int64(i) {
			t.Errorf("Decode(ids[%d]) = %+v, want time %v worker 513 sequence %d", i, p, now, i)
		}
	}
}

func TestPartsJSON(t *testing.T) {
	tests := []struct {
		name string
		id   int64
		want string
	}{
		{
			name: "whole second keeps three digits",
			id:   compose(1000, 1, 2),
			want: `{"id":"4194308098","time":"2026-01-01T00:00:01.000Z","timestamp":1000,"worker":1,"sequence":2}`,
		},
		{
			name: "milliseconds",
			id:   compose(1234, 0, 0),
			want: `{"id":"5175771136","time":"2026-01-01T00:00:01.234Z","timestamp":1234,"worker":0,"sequence":0}`,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b, err := json.Marshal(Decode(tt.id, time.Time{}))
			if err != nil {
				t.Fatal(err)
			}
			if string(b) != tt.want {
				t.Errorf("got  %s\nwant %s", b, tt.want)
			}
		})
	}
}
