package kvbucket_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/dispenser-dev/dispenser/internal/kvbucket"
	"github.com/dispenser-dev/dispenser/testenv"
)

// TestConflict runs the compare-and-swap outcomes of a real bucket through
// Conflict: only a write that found another revision is a conflict.
func TestConflict(t *testing.T) {
	js := newJetStream(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "conflict", History: 1})
	if err != nil {
		t.Fatal(err)
	}
	rev, err := kv.Create(ctx, "k", []byte("1"))
	if err != nil {
		t.Fatal(err)
	}
	_, createErr := kv.Create(ctx, "k", []byte("2"))
	_, staleErr := kv.Update(ctx, "k", []byte("2"), rev+7)
	_, zeroErr := kv.Update(ctx, "k", []byte("2"), 0)
	_, badKeyErr := kv.Update(ctx, "bad key", []byte("2"), rev)
	tests := []struct {
		name string
		err  error
		want bool
	}{
		{name: "create over a value", err: createErr, want: true},
		{name: "update on a stale revision", err: staleErr, want: true},
		{name: "update on revision 0 of a written key", err: zeroErr, want: true},
		{name: "wrapped", err: fmt.Errorf("claim: %w", staleErr), want: true},
		{name: "replicated bucket's code", err: &jetstream.APIError{ErrorCode: jetstream.JSErrCodeStreamWrongLastSequenceConstant}, want: true},
		{name: "nil", err: nil, want: false},
		{name: "invalid key", err: badKeyErr, want: false},
		{name: "timeout", err: context.DeadlineExceeded, want: false},
		{name: "other", err: errors.New("boom"), want: false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := kvbucket.Conflict(tt.err); got != tt.want {
				t.Fatalf("Conflict(%v) = %v, want %v", tt.err, got, tt.want)
			}
		})
	}
}

// TestStreamCreated checks that a bucket deleted and created again reports
// a later creation time, and that a deleted bucket's error says so.
func TestStreamCreated(t *testing.T) {
	js := newJetStream(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cfg := jetstream.KeyValueConfig{Bucket: "created", History: 1}
	kv, err := js.CreateKeyValue(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	first, err := kvbucket.StreamCreated(ctx, kv)
	if err != nil {
		t.Fatal(err)
	}
	if first.IsZero() {
		t.Fatal("StreamCreated = zero time")
	}
	info, err := kvbucket.StreamInfo(ctx, kv)
	if err != nil {
		t.Fatal(err)
	}
	if !info.Created.Equal(first) || info.Config.Name != "KV_created" {
		t.Fatalf("StreamInfo: created %v, stream %q; want %v, KV_created", info.Created, info.Config.Name, first)
	}
	if err := js.DeleteKeyValue(ctx, cfg.Bucket); err != nil {
		t.Fatal(err)
	}
	if _, err := kvbucket.StreamCreated(ctx, kv); !errors.Is(err, jetstream.ErrStreamNotFound) && !errors.Is(err, jetstream.ErrBucketNotFound) {
		t.Fatalf("StreamCreated of a deleted bucket: %v, want ErrStreamNotFound or ErrBucketNotFound", err)
	}
	testenv.CreateKeyValue(t, js, cfg)
	again, err := kvbucket.StreamCreated(ctx, kv)
	if err != nil {
		t.Fatal(err)
	}
	if !again.After(first) {
		t.Fatalf("recreated bucket's stream created at %v, want after %v", again, first)
	}
}

// noHistoryKV fails every history read as JetStream does while its meta
// group has no leader (an ephemeral consumer cannot be created).
type noHistoryKV struct{ jetstream.KeyValue }

func (noHistoryKV) History(context.Context, string, ...jetstream.WatchOpt) ([]jetstream.KeyValueEntry, error) {
	return nil, jetstream.ErrJetStreamNotEnabled // any error but "no reply"
}

// TestLatestWithoutMetaLeader: the latest value of a key is read without
// an ephemeral consumer, so that a worker started during a partition reads
// its witness marks and leases (before, every such read failed until the
// cluster had a meta leader again: the restarted worker of TestPartitions'
// long mode answered 503 for half a minute). A delete marker, which a
// direct get hides, still needs the history.
func TestLatestWithoutMetaLeader(t *testing.T) {
	js := newJetStream(t)
	kv, err := js.CreateKeyValue(context.Background(), jetstream.KeyValueConfig{Bucket: "latest"})
	if err != nil {
		t.Fatal(err)
	}
	rev, err := kv.Put(context.Background(), "k", []byte("v"))
	if err != nil {
		t.Fatal(err)
	}
	e, err := kvbucket.Latest(context.Background(), noHistoryKV{kv}, "k")
	if err != nil || e == nil || string(e.Value()) != "v" || e.Revision() != rev {
		t.Fatalf("Latest without history: %v, %v; want v at revision %d", e, err, rev)
	}
	if err := kv.Delete(context.Background(), "k"); err != nil {
		t.Fatal(err)
	}
	e, err = kvbucket.Latest(context.Background(), kv, "k")
	if err != nil || e == nil || e.Operation() != jetstream.KeyValueDelete {
		t.Fatalf("Latest of a deleted key: %v, %v; want its delete marker", e, err)
	}
}
