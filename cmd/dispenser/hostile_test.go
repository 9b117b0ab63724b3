package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/dispenser-dev/dispenser/protocol"
	"github.com/dispenser-dev/dispenser/segment/kv"
	"github.com/dispenser-dev/dispenser/snowflake"
	"github.com/dispenser-dev/dispenser/testenv"
)

// TestServeRefusesHostileConfigurations runs the dispenser binary (this
// test binary in its place) against buckets, peers and settings that could
// make it hand out IDs twice: each must exit non-zero at start-up with an
// error that says what is wrong, never warn and serve.
func TestServeRefusesHostileConfigurations(t *testing.T) {
	ctx := context.Background()
	tests := []struct {
		name string
		// setup prepares ns and returns the hostile worker's extra flags.
		setup func(t *testing.T, ns *server.Server, js jetstream.JetStream) []string
		want  string // in the output
	}{
		{
			name: "another lease bucket in the queue group",
			setup: func(t *testing.T, ns *server.Server, js jetstream.JetStream) []string {
				startPeer(t, ns)
				return []string{"--snowflake-bucket", "other_workers"}
			},
			want: "workers of different lease buckets or epochs hand out the same IDs",
		},
		{
			name: "another epoch in the same lease bucket",
			setup: func(t *testing.T, ns *server.Server, js jetstream.JetStream) []string {
				startPeer(t, ns)
				return []string{"--snowflake-epoch", "2025-06-01T00:00:00Z"}
			},
			want: protocol.Describe(snowflake.ErrEpochMismatch), // as the binary prints it
		},
		{
			name: "lease bucket with a TTL",
			setup: func(t *testing.T, ns *server.Server, js jetstream.JetStream) []string {
				createBucket(t, js, jetstream.KeyValueConfig{Bucket: snowflake.DefaultBucket, TTL: time.Hour})
				return nil
			},
			want: "TTL",
		},
		{
			name: "lease bucket whose limits drop values",
			setup: func(t *testing.T, ns *server.Server, js jetstream.JetStream) []string {
				createBucket(t, js, jetstream.KeyValueConfig{Bucket: snowflake.DefaultBucket})
				discardOld(t, js, snowflake.DefaultBucket)
				return nil
			},
			want: "discard",
		},
		{
			name: "lease bucket whose epoch was deleted",
			setup: func(t *testing.T, ns *server.Server, js jetstream.JetStream) []string {
				b := createBucket(t, js, jetstream.KeyValueConfig{Bucket: snowflake.DefaultBucket})
				data, _ := json.Marshal(map[string]any{"version": 1, "epoch": snowflake.DefaultEpoch})
				if _, err := b.Put(ctx, "config", data); err != nil {
					t.Fatal(err)
				}
				if err := b.Delete(ctx, "config"); err != nil {
					t.Fatal(err)
				}
				return nil
			},
			want: protocol.Describe(snowflake.ErrEpochLost),
		},
		{
			name: "segment bucket with a TTL",
			setup: func(t *testing.T, ns *server.Server, js jetstream.JetStream) []string {
				createBucket(t, js, jetstream.KeyValueConfig{Bucket: kv.DefaultBucket, TTL: time.Hour})
				return nil
			},
			want: "TTL",
		},
		{
			name: "segment bucket whose limits drop values",
			setup: func(t *testing.T, ns *server.Server, js jetstream.JetStream) []string {
				createBucket(t, js, jetstream.KeyValueConfig{Bucket: kv.DefaultBucket})
				discardOld(t, js, kv.DefaultBucket)
				return nil
			},
			want: "discard",
		},
		{
			name: "segment bucket in memory",
			setup: func(t *testing.T, ns *server.Server, js jetstream.JetStream) []string {
				createBucket(t, js, jetstream.KeyValueConfig{Bucket: kv.DefaultBucket, Storage: jetstream.MemoryStorage})
				return nil
			},
			want: "memory",
		},
	}
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ns := testenv.NATS(t)
			js, err := jetstream.New(testenv.Connect(t, ns))
			if err != nil {
				t.Fatal(err)
			}
			args := append([]string{"serve", "--nats-url", ns.ClientURL(), "--shutdown-timeout", "2s"}, tt.setup(t, ns, js)...)
			ctx, cancel := context.WithTimeout(ctx, 60*time.Second)
			defer cancel()
			cmd := exec.CommandContext(ctx, exe, args...)
			cmd.Env = append(os.Environ(), benchChildEnv+"=1")
			var out bytes.Buffer
			cmd.Stdout, cmd.Stderr = &out, &out
			err = cmd.Run()
			var exit *exec.ExitError
			if !errors.As(err, &exit) || exit.ExitCode() == 0 || ctx.Err() != nil {
				t.Fatalf("serve %v: %v (want a start-up refusal, exit non-zero); output:\n%s", args, err, out.String())
			}
			if !strings.Contains(out.String(), tt.want) {
				t.Fatalf("serve %v exited %d without saying %q; output:\n%s", args, exit.ExitCode(), tt.want, out.String())
			}
		})
	}
}

// startPeer runs a worker (KV segment store, snowflake) on ns until the
// test ends and waits until it serves snowflake IDs.
func startPeer(t *testing.T, ns *server.Server) {
	t.Helper()
	logs := startServe(t, "serve", "--nats-url", ns.ClientURL())
	waitForID(t, testenv.Connect(t, ns), "id.snowflake", logs)
}

func createBucket(t *testing.T, js jetstream.JetStream, cfg jetstream.KeyValueConfig) jetstream.KeyValue {
	t.Helper()
	b, err := js.CreateKeyValue(context.Background(), cfg)
	if err != nil {
		t.Fatalf("create bucket %s: %v", cfg.Bucket, err)
	}
	return b
}

// discardOld gives the bucket's stream a message limit that drops the
// oldest values when reached.
func discardOld(t *testing.T, js jetstream.JetStream, bucket string) {
	t.Helper()
	ctx := context.Background()
	s, err := js.Stream(ctx, "KV_"+bucket)
	if err != nil {
		t.Fatal(err)
	}
	cfg := s.CachedInfo().Config
	cfg.MaxMsgs = 1000
	cfg.Discard = jetstream.DiscardOld
	if _, err := js.UpdateStream(ctx, cfg); err != nil {
		t.Fatalf("update stream %s: %v", cfg.Name, err)
	}
}
