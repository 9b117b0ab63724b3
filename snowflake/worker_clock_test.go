package snowflake

import (
	"context"
	"errors"
	"testing"
	"time"
)

func TestWorkerClockBehindRecordedTimestamp(t *testing.T) {
	tests := []struct {
		name    string
		behind  time.Duration
		wantErr error
	}{
		{name: "an hour behind refuses", behind: time.Hour, wantErr: ErrClockBackwards},
		{name: "a second behind refuses", behind: time.Second, wantErr: ErrClockBackwards},
		{name: "3ms behind is waited out", behind: 3 * time.Millisecond},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			js := newJetStream(t)
			c := newFakeClock(t, t0)
			a := startWorker(t, js, fakeSettings(t, c, "alpha"))
			aid := workerID(t, a)
			aIDs := issue(t, a, 1000)
			if err := a.Close(context.Background()); err != nil {
				t.Fatal(err)
			}
			// The same instance restarts on a host whose clock is behind.
			c.SetWall(t0.Add(-tt.behind))
			a2 := startWorker(t, js, fakeSettings(t, c, "alpha"))
			if got := workerID(t, a2); got != aid {
				t.Fatalf("restart got worker ID %d, want %d", got, aid)
			}
			ids, err := a2.AppendIDs(nil, 10)
			if !errors.Is(err, tt.wantErr) {
				t.Fatalf("got error %v, want %v", err, tt.wantErr)
			}
			if err != nil {
				if !Unavailable(err) {
					t.Errorf("error %v is not unavailable", err)
				}
				if st := a2.Stats().(NodeStats); !st.ClockBehind || st.ClockBackwards != 1 {
					t.Errorf("stats: clock behind %v, count %d, want true 1", st.ClockBehind, st.ClockBackwards)
				}
				c.SetWall(t0)
				if ids, err = a2.AppendIDs(nil, 10); err != nil {
					t.Fatalf("clock caught up: %v", err)
				}
			}
			if first, last := timestampOf(ids[0]), maxTimestamp(aIDs); first <= last {
				t.Errorf("first timestamp %d not above the recorded %d", first, last)
			}
			requireUnique(t, append(aIDs, ids...))
		})
	}
}

func TestWorkerEpochMismatch(t *testing.T) {
	other := time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)
	tests := []struct {
		name    string
		epoch   time.Time
		wantErr error
	}{
		{name: "same epoch", epoch: other},
		{name: "same epoch in another zone", epoch: other.In(time.FixedZone("X", 3600))},
		{name: "default epoch", wantErr: ErrEpochMismatch},
		{name: "one millisecond later", epoch: other.Add(time.Millisecond), wantErr: ErrEpochMismatch},
	}
	js := newJetStream(t)
	c := newFakeClock(t, t0)
	s := fakeSettings(t, c, "first")
	s.Epoch = other
	startWorker(t, js, s)
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := fakeSettings(t, c, "second")
			s.Epoch = tt.epoch
			_, err := tryStartWorker(t, js, s)
			if !errors.Is(err, tt.wantErr) {
				t.Fatalf("got error %v, want %v", err, tt.wantErr)
			}
			if err != nil && Unavailable(err) {
				t.Errorf("epoch mismatch must not be unavailable (it is a configuration error)")
			}
		})
	}
}

// TestStatsClockBehindWithoutRequests: Stats says the clock is behind
// while AppendIDs would refuse for it, and no longer once it has caught
// up, whether or not anything asked for IDs since: a worker whose
// clock is behind gets no requests (its endpoint leaves the queue group
// on Servable), and its readiness (/readyz) reads ClockBehind.
func TestStatsClockBehindWithoutRequests(t *testing.T) {
	tests := []struct {
		name   string
		behind time.Duration
		want   bool
	}{
		{name: "an hour behind", behind: time.Hour, want: true},
		{name: "3ms behind is waited out", behind: 3 * time.Millisecond},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			js := newJetStream(t)
			c := newFakeClock(t, t0)
			w := startWorker(t, js, fakeSettings(t, c, "alpha"))
			issue(t, w, 10)
			c.SetWall(t0.Add(-tt.behind))
			if got := w.Stats().(NodeStats).ClockBehind; got != tt.want {
				t.Errorf("clock %s behind, no request since: ClockBehind %v, want %v", tt.behind, got, tt.want)
			}
			if got := w.Servable(); got == tt.want {
				t.Errorf("clock %s behind: Servable() = %v, want %v", tt.behind, got, !tt.want)
			}
			// A request now starts an episode (an hour behind)...
			if _, err := w.AppendIDs(nil, 1); tt.want != errors.Is(err, ErrClockBackwards) {
				t.Errorf("clock %s behind: AppendIDs: %v", tt.behind, err)
			}
			// ...which ends with the clock's catching up, not with the
			// next request.
			c.SetWall(t0.Add(time.Second))
			if st := w.Stats().(NodeStats); st.ClockBehind {
				t.Errorf("clock caught up, no request since: ClockBehind true, want false")
			}
		})
	}
}
