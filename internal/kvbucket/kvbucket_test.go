package kvbucket_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/dispenser-dev/dispenser/internal/kvbucket"
	"github.com/dispenser-dev/dispenser/testenv"
)

func newJetStream(tb testing.TB) jetstream.JetStream {
	tb.Helper()
	js, err := jetstream.New(testenv.Connect(tb, testenv.NATS(tb)))
	if err != nil {
		tb.Fatalf("jetstream: %v", err)
	}
	return js
}

// TestCheck creates buckets the way an operator might (nats kv add, then
// perhaps nats stream edit) on a real server and checks each.
func TestCheck(t *testing.T) {
	js := newJetStream(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	// edit changes the stream behind a bucket, as nats stream edit would.
	edit := func(change func(*jetstream.StreamConfig)) func(t *testing.T, bucket string) {
		return func(t *testing.T, bucket string) {
			t.Helper()
			s, err := js.Stream(ctx, "KV_"+bucket)
			if err != nil {
				t.Fatal(err)
			}
			cfg := s.CachedInfo().Config
			change(&cfg)
			if _, err := js.UpdateStream(ctx, cfg); err != nil {
				t.Fatalf("edit stream: %v", err)
			}
		}
	}
	tests := []struct {
		name    string
		cfg     jetstream.KeyValueConfig
		then    func(t *testing.T, bucket string)
		req     kvbucket.Requirements
		wantErr error
		wantMsg string // part of the error message: what to change
	}{
		{name: "default"},
		{name: "history", cfg: jetstream.KeyValueConfig{History: 10}},
		{name: "byte limit with discard new", cfg: jetstream.KeyValueConfig{MaxBytes: 1 << 20}},
		{name: "message limit with discard new", then: edit(func(c *jetstream.StreamConfig) { c.MaxMsgs = 1000 })},
		{name: "value size limit", cfg: jetstream.KeyValueConfig{MaxValueSize: 1024}},
		{name: "compressed", cfg: jetstream.KeyValueConfig{Compression: true}},
		{name: "memory, allowed", cfg: jetstream.KeyValueConfig{Storage: jetstream.MemoryStorage}, req: kvbucket.Requirements{AllowMemory: true}},
		{name: "one replica, one asked for", req: kvbucket.Requirements{MinReplicas: 1}},
		{name: "TTL", cfg: jetstream.KeyValueConfig{TTL: time.Hour}, wantErr: kvbucket.ErrTTL, wantMsg: "--max-age 0"},
		{name: "TTL added later", then: edit(func(c *jetstream.StreamConfig) { c.MaxAge, c.Duplicates = time.Minute, time.Minute }), wantErr: kvbucket.ErrTTL},
		{name: "limit markers", cfg: jetstream.KeyValueConfig{LimitMarkerTTL: time.Minute}, wantErr: kvbucket.ErrTTL, wantMsg: "per-message TTLs"},
		{name: "message limit with discard old", then: edit(func(c *jetstream.StreamConfig) {
			c.MaxMsgs, c.Discard = 1000, jetstream.DiscardOld
		}), wantErr: kvbucket.ErrLimits, wantMsg: "1000 messages"},
		{name: "byte limit with discard old", cfg: jetstream.KeyValueConfig{MaxBytes: 1 << 20}, then: edit(func(c *jetstream.StreamConfig) {
			c.Discard = jetstream.DiscardOld
		}), wantErr: kvbucket.ErrLimits, wantMsg: "--discard new"},
		{name: "memory", cfg: jetstream.KeyValueConfig{Storage: jetstream.MemoryStorage}, wantErr: kvbucket.ErrMemoryStorage},
		{name: "fewer replicas than asked for", req: kvbucket.Requirements{MinReplicas: 3}, wantErr: kvbucket.ErrReplicas, wantMsg: "--replicas 3"},
	}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tt.cfg.Bucket = "b" + string(rune('a'+i))
			kv, err := js.CreateKeyValue(ctx, tt.cfg)
			if err != nil {
				t.Fatalf("create bucket: %v", err)
			}
			if tt.then != nil {
				tt.then(t, tt.cfg.Bucket)
			}
			err = kvbucket.Check(ctx, kv, tt.req)
			if !errors.Is(err, tt.wantErr) || (tt.wantErr == nil) != (err == nil) {
				t.Fatalf("Check: got error %v, want %v", err, tt.wantErr)
			}
			if err != nil && (!strings.Contains(err.Error(), tt.cfg.Bucket) || !strings.Contains(err.Error(), tt.wantMsg)) {
				t.Errorf("error %q does not name the bucket %q and %q", err, tt.cfg.Bucket, tt.wantMsg)
			}
		})
	}
}

// TestCheckConfig covers what a single test server cannot create.
func TestCheckConfig(t *testing.T) {
	base := jetstream.StreamConfig{Name: "KV_b", Replicas: 3, MaxMsgs: -1, MaxBytes: -1, MaxAge: 0, Discard: jetstream.DiscardNew}
	tests := []struct {
		name    string
		change  func(*jetstream.StreamConfig)
		req     kvbucket.Requirements
		wantErr error
	}{
		{name: "three replicas, three asked for", req: kvbucket.Requirements{MinReplicas: 3}},
		{name: "three replicas, one asked for", req: kvbucket.Requirements{MinReplicas: 1}},
		{name: "five replicas, three asked for", change: func(c *jetstream.StreamConfig) { c.Replicas = 5 }, req: kvbucket.Requirements{MinReplicas: 3}},
		{name: "one replica, three asked for", change: func(c *jetstream.StreamConfig) { c.Replicas = 1 }, req: kvbucket.Requirements{MinReplicas: 3}, wantErr: kvbucket.ErrReplicas},
		{name: "replicas unset, two asked for", change: func(c *jetstream.StreamConfig) { c.Replicas = 0 }, req: kvbucket.Requirements{MinReplicas: 2}, wantErr: kvbucket.ErrReplicas},
		{name: "discard old without limits", change: func(c *jetstream.StreamConfig) { c.Discard = jetstream.DiscardOld }},
		{name: "per-key history with discard old", change: func(c *jetstream.StreamConfig) { c.Discard, c.MaxMsgsPerSubject = jetstream.DiscardOld, 1 }},
		{name: "interest retention", change: func(c *jetstream.StreamConfig) { c.Retention = jetstream.InterestPolicy }, wantErr: kvbucket.ErrLimits},
		{name: "work queue retention", change: func(c *jetstream.StreamConfig) { c.Retention = jetstream.WorkQueuePolicy }, wantErr: kvbucket.ErrLimits},
		{name: "TTL and limits: TTL reported first", change: func(c *jetstream.StreamConfig) {
			c.MaxAge, c.MaxMsgs, c.Discard = time.Hour, 5, jetstream.DiscardOld
		}, wantErr: kvbucket.ErrTTL},
		{name: "a nanosecond TTL", change: func(c *jetstream.StreamConfig) { c.MaxAge = 1 }, wantErr: kvbucket.ErrTTL},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := base
			if tt.change != nil {
				tt.change(&cfg)
			}
			err := kvbucket.CheckConfig("b", cfg, tt.req)
			if !errors.Is(err, tt.wantErr) || (tt.wantErr == nil) != (err == nil) {
				t.Fatalf("CheckConfig: got error %v, want %v", err, tt.wantErr)
			}
		})
	}
}
