package kvbucket_test

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/dispenser-dev/dispenser/internal/kvbucket"
	"github.com/dispenser-dev/dispenser/testenv"
)

// logBuffer collects output for a test to read (testenv.LogBuffer).
type logBuffer = testenv.LogBuffer

// TestNewGuard opens guards on buckets in the states an operator can leave
// them in.
func TestNewGuard(t *testing.T) {
	js := newJetStream(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	purge := func(t *testing.T, kv jetstream.KeyValue) {
		t.Helper()
		s, err := js.Stream(ctx, "KV_"+kv.Bucket())
		if err != nil {
			t.Fatal(err)
		}
		if err := s.Purge(ctx); err != nil {
			t.Fatal(err)
		}
	}
	tests := []struct {
		name      string
		setup     func(t *testing.T, kv jetstream.KeyValue)
		wantErr   error
		wantMsg   string
		wantProof bool // the bucket holds a proof record afterwards
	}{
		{name: "new bucket", wantProof: true},
		{name: "values from before proof records", setup: func(t *testing.T, kv jetstream.KeyValue) {
			if _, err := kv.PutString(ctx, "orders", `{"max_id":5}`); err != nil {
				t.Fatal(err)
			}
		}, wantProof: true},
		{name: "purged", setup: func(t *testing.T, kv jetstream.KeyValue) {
			if _, err := kv.PutString(ctx, "orders", `{"max_id":5}`); err != nil {
				t.Fatal(err)
			}
			purge(t, kv)
		}, wantErr: kvbucket.ErrPurged, wantMsg: "nats stream purge"},
		{name: "all keys deleted", setup: func(t *testing.T, kv jetstream.KeyValue) {
			if _, err := kv.PutString(ctx, "orders", `{"max_id":5}`); err != nil {
				t.Fatal(err)
			}
			if err := kv.Delete(ctx, "orders"); err != nil {
				t.Fatal(err)
			}
		}, wantErr: kvbucket.ErrPurged, wantMsg: "has held 2 messages"},
		{name: "proof deleted", setup: func(t *testing.T, kv jetstream.KeyValue) {
			if _, err := kv.PutString(ctx, kvbucket.ProofKey, `{"version":1}`); err != nil {
				t.Fatal(err)
			}
			if err := kv.Delete(ctx, kvbucket.ProofKey); err != nil {
				t.Fatal(err)
			}
		}, wantErr: kvbucket.ErrPurged, wantMsg: "deleted by hand"},
		{name: "proof from another stream", setup: func(t *testing.T, kv jetstream.KeyValue) {
			if _, err := kv.PutString(ctx, kvbucket.ProofKey, `{"version":1,"stream_created":"2020-01-01T00:00:00Z"}`); err != nil {
				t.Fatal(err)
			}
		}, wantErr: kvbucket.ErrRecreated, wantMsg: "restored from a backup", wantProof: true},
	}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "guard_" + string(rune('a'+i))})
			if err != nil {
				t.Fatal(err)
			}
			if tt.setup != nil {
				tt.setup(t, kv)
			}
			g, err := kvbucket.NewGuard(ctx, kv, kvbucket.Requirements{}, "test values", slog.New(slog.DiscardHandler))
			if !errors.Is(err, tt.wantErr) {
				t.Fatalf("NewGuard: %v, want %v", err, tt.wantErr)
			}
			if err != nil && !strings.Contains(err.Error(), tt.wantMsg) {
				t.Errorf("error %q does not say %q", err, tt.wantMsg)
			}
			_, perr := kv.Get(ctx, kvbucket.ProofKey)
			if got := perr == nil; got != tt.wantProof {
				t.Errorf("proof record present = %v (%v), want %v", got, perr, tt.wantProof)
			}
			if err == nil {
				if err := g.CheckHeld(ctx); err != nil {
					t.Errorf("CheckHeld right after NewGuard: %v", err)
				}
			}
		})
	}
}

// TestGuardCheck: what changes while a guard runs is seen by the next
// check, logged once, and a recovery is logged too.
func TestGuardCheck(t *testing.T) {
	js := newJetStream(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "guarded"})
	if err != nil {
		t.Fatal(err)
	}
	log := &logBuffer{}
	g, err := kvbucket.NewGuard(ctx, kv, kvbucket.Requirements{}, "test values", slog.New(slog.NewTextHandler(log, nil)))
	if err != nil {
		t.Fatal(err)
	}
	if err := kv.Delete(ctx, kvbucket.ProofKey); err != nil {
		t.Fatal(err)
	}
	if err := g.Check(ctx); err != nil {
		t.Errorf("Check (stream and configuration only) after the proof was deleted: %v, want nil", err)
	}
	for range 3 {
		if err := g.CheckHeld(ctx); !errors.Is(err, kvbucket.ErrPurged) {
			t.Fatalf("CheckHeld after the proof was deleted: %v, want ErrPurged", err)
		}
		if err := g.Check(ctx); err != nil { // writes of existing keys go on
			t.Fatalf("Check after the proof was deleted: %v, want nil", err)
		}
	}
	if n := strings.Count(log.String(), "refusing to use a bucket"); n != 1 {
		t.Errorf("logged the failure %d times, want once:\n%s", n, log)
	}
	proof := `{"version":1,"stream_created":"` + g.Created().UTC().Format(time.RFC3339Nano) + `"}`
	if _, err := kv.PutString(ctx, kvbucket.ProofKey, proof); err != nil {
		t.Fatal(err)
	}
	if err := g.CheckHeld(ctx); err != nil {
		t.Fatalf("CheckHeld after the proof was put back as the error says: %v", err)
	}
	if !strings.Contains(log.String(), "passes its checks again") {
		t.Errorf("recovery not logged:\n%s", log)
	}

	// Deleted and created again: every check fails.
	if err := js.DeleteKeyValue(ctx, "guarded"); err != nil {
		t.Fatal(err)
	}
	testenv.CreateKeyValue(t, js, jetstream.KeyValueConfig{Bucket: "guarded"})
	if err := g.Check(ctx); !errors.Is(err, kvbucket.ErrRecreated) {
		t.Errorf("Check on the re-created bucket: %v, want ErrRecreated", err)
	}
	if err := g.CheckHeld(ctx); !errors.Is(err, kvbucket.ErrRecreated) {
		t.Errorf("CheckHeld on the re-created bucket: %v, want ErrRecreated", err)
	}
}
