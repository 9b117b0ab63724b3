package lease_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/dispenser-dev/dispenser/lease"
)

// holderRecord is a minimal holder's record: its session.
type holderRecord struct {
	Session string `json:"session"`
}

func newHolder(tb testing.TB, ctx context.Context, kv jetstream.KeyValue, session string, log *slog.Logger) *lease.Holder {
	tb.Helper()
	return &lease.Holder{
		Settings: settings(tb, &clock{wall: t0}, time.Second), KV: kv, Ctx: ctx, Log: log,
		Warning: "test: heartbeat failed", ErrKey: "err",
		Ours: func(e jetstream.KeyValueEntry) bool {
			var r holderRecord
			return json.Unmarshal(e.Value(), &r) == nil && r.Session == session
		},
	}
}

func recordOf(session string) func(time.Time) ([]byte, error) {
	return func(time.Time) ([]byte, error) { return json.Marshal(holderRecord{Session: session}) }
}

// TestHolderRenewOutcomes: one renewal tells a landed write, its own write
// whose answer was lost (adopted), and a key taken, deleted or purged
// (lost) apart, and reports a renewal after the holder stopped as closing.
// Seen failing with the Ours check removed from Renew (the key rewritten
// by another session came back Adopted).
func TestHolderRenewOutcomes(t *testing.T) {
	js := newJetStream(t)
	tests := []struct {
		name string
		// meanwhile changes the key after the holder's write at rev.
		meanwhile func(kv jetstream.KeyValue, key string) error
		closed    bool
		want      lease.Outcome
		wantPut   bool // Entry is a put (Adopted, Lost to another)
	}{
		{name: "renewed", want: lease.Renewed},
		{name: "own write landed unanswered", want: lease.Adopted, wantPut: true,
			meanwhile: func(kv jetstream.KeyValue, key string) error {
				_, err := kv.Put(context.Background(), key, []byte(`{"session":"me"}`))
				return err
			}},
		{name: "taken by another session", want: lease.Lost, wantPut: true,
			meanwhile: func(kv jetstream.KeyValue, key string) error {
				_, err := kv.Put(context.Background(), key, []byte(`{"session":"other"}`))
				return err
			}},
		{name: "deleted", want: lease.Lost,
			meanwhile: func(kv jetstream.KeyValue, key string) error { return kv.Delete(context.Background(), key) }},
		{name: "purged", want: lease.Lost,
			meanwhile: func(kv jetstream.KeyValue, key string) error { return kv.Purge(context.Background(), key) }},
		{name: "closing", closed: true, want: lease.Closing,
			meanwhile: func(kv jetstream.KeyValue, key string) error {
				_, err := kv.Put(context.Background(), key, []byte(`{"session":"other"}`))
				return err
			}},
	}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			kv := newBucket(t, js, fmt.Sprintf("holder_%d", i))
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			h := newHolder(t, ctx, kv, "me", slog.New(slog.DiscardHandler))
			rev, err := kv.Create(context.Background(), "k", []byte(`{"session":"me"}`))
			if err != nil {
				t.Fatal(err)
			}
			if tt.meanwhile != nil {
				if err := tt.meanwhile(kv, "k"); err != nil {
					t.Fatal(err)
				}
			}
			if tt.closed {
				cancel()
			}
			r := h.Renew(context.Background(), "k", rev, recordOf("me"))
			if r.Outcome != tt.want {
				t.Fatalf("outcome %d (err %v), want %d", r.Outcome, r.Err, tt.want)
			}
			if got := r.Entry != nil && r.Entry.Operation() == jetstream.KeyValuePut; got != tt.wantPut {
				t.Errorf("entry is a put: %v, want %v", got, tt.wantPut)
			}
			if tt.want == lease.Renewed && r.Grant.Rev <= rev {
				t.Errorf("grant revision %d, want above %d", r.Grant.Rev, rev)
			}
		})
	}
}

// TestHolderFailedLogsStreaks: a streak of failures is logged at its first
// and every hundredth, and again from the first after Succeeded; every
// failure is counted. Seen failing with the n%100 clause removed (2 lines,
// want 4).
func TestHolderFailedLogsStreaks(t *testing.T) {
	var buf bytes.Buffer
	h := &lease.Holder{Log: slog.New(slog.NewTextHandler(&buf, nil)), Warning: "test: heartbeat failed", ErrKey: "error"}
	for range 200 {
		h.Failed(context.DeadlineExceeded, "worker", 7)
	}
	h.Succeeded()
	h.Failed(context.DeadlineExceeded, "worker", 7)
	lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
	var streaks []string
	for _, l := range lines {
		if !strings.Contains(l, "worker=7 error=") {
			t.Errorf("log line %q lacks the args before the error", l)
		}
		streaks = append(streaks, l[strings.Index(l, "consecutive_failures="):])
	}
	want := []string{"consecutive_failures=1", "consecutive_failures=100", "consecutive_failures=200", "consecutive_failures=1"}
	if strings.Join(streaks, ",") != strings.Join(want, ",") {
		t.Errorf("logged %v, want %v", streaks, want)
	}
	if got := h.Failures(); got != 201 {
		t.Errorf("Failures() = %d, want 201", got)
	}
}
