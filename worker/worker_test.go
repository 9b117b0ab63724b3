package worker

import (
	"context"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
)

// TestEmbeddedNATSSyncsEveryWrite: the zero-setup mode's nats-server must
// write every JetStream message to disk before acknowledging it, or a crash
// of the machine can roll back a tag's max_id or a lease's bound.
func TestEmbeddedNATSSyncsEveryWrite(t *testing.T) {
	ns, err := StartEmbedded(Embedded{Listen: "127.0.0.1:-1", DataDir: t.TempDir()}, "")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(ns.Close)
	if cfg := ns.JetStreamConfig(); cfg == nil || !cfg.SyncAlways {
		t.Fatalf("JetStream config %+v: want SyncAlways", cfg)
	}
}

// TestNewRejectsBadConfigBeforeStarting: a Config that cannot work fails
// with ErrConfig, and nothing was started: the embedded nats-server's data
// directory was not created.
func TestNewRejectsBadConfigBeforeStarting(t *testing.T) {
	for _, tt := range []struct {
		name string
		edit func(*Config)
	}{
		{"max batch too large", func(c *Config) { c.MaxBatch = 2_000_000 }},
		{"negative max batch", func(c *Config) { c.MaxBatch = -1 }},
		{"prefetch ratio above 1", func(c *Config) { c.Segment.PrefetchRatio = 1.5 }},
		{"negative max step", func(c *Config) { c.Segment.MaxStep = -1 }},
		{"negative max wait", func(c *Config) { c.Segment.MaxWait = -time.Second }},
		{"owners lease too short", func(c *Config) { c.Owners.Lease = time.Millisecond }},
		{"owners replicas", func(c *Config) { c.Owners.Replicas = 6 }},
		{"heartbeat not below lease", func(c *Config) { c.Snowflake.Lease, c.Snowflake.Heartbeat = time.Second, 2*time.Second }},
		{"epoch in the future", func(c *Config) { c.Snowflake.Epoch = time.Now().Add(time.Hour) }},
		{"TLS cert without key", func(c *Config) { c.NATS.TLSCert = "cert.pem" }},
		{"segment replicas", func(c *Config) { c.Store = KV{Replicas: 7} }},
		{"inbox prefix with a wildcard", func(c *Config) { c.InboxPrefix = "_INBOX_*" }},
		{"inbox prefix with a trailing dot", func(c *Config) { c.InboxPrefix = "_INBOX_d." }},
		{"inbox prefix in JetStream", func(c *Config) { c.JSInboxPrefix = "$JS.API" }},
		{"inbox prefix under the service's", func(c *Config) { c.InboxPrefix = "id.inbox" }},
		{"inbox prefix with a space", func(c *Config) { c.JSInboxPrefix = "_INBOX d" }},
		{"negative HTTP read timeout", func(c *Config) { c.HTTP.ReadTimeout = -time.Second }},
		{"negative HTTP max conns", func(c *Config) { c.HTTP.MaxConns = -1 }},
	} {
		t.Run(tt.name, func(t *testing.T) {
			dir := filepath.Join(t.TempDir(), "data")
			c := Config{Embedded: Embedded{Listen: "127.0.0.1:-1", DataDir: dir}}
			tt.edit(&c)
			w, err := New(context.Background(), c)
			if err == nil {
				w.Close()
			}
			if !errors.Is(err, ErrConfig) {
				t.Errorf("err = %v, want %v", err, ErrConfig)
			}
			if _, err := os.Stat(dir); !os.IsNotExist(err) {
				t.Errorf("data directory after a refused Config: %v, want it absent", err)
			}
		})
	}
}

// TestZeroConfigServes: the zero Config, but for the embedded server's
// address and directory, starts a worker that serves, and Close stops it
// (twice is harmless).
func TestZeroConfigServes(t *testing.T) {
	w, err := New(context.Background(), Config{Embedded: Embedded{Listen: "127.0.0.1:-1", DataDir: t.TempDir()},
		Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	url := w.URL()
	if url == "" {
		t.Fatal("URL is empty")
	}
	nc, err := nats.Connect(url)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	resp, err := nc.Request("id.snowflake", nil, 10*time.Second)
	if err != nil || len(resp.Data) == 0 || resp.Header.Get("Nats-Service-Error-Code") != "" {
		t.Fatalf("id.snowflake: %v, %v", resp, err)
	}
	if err := w.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if err := w.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if w.ns.Running() {
		t.Fatal("embedded nats-server still running after Close")
	}
}

// TestMoveURLs: a worker leaving a server in lame-duck mode connects with
// the configured URLs first, then the discovered ones, which nats.go
// reports without user information and get the configured URL's. Before,
// the move used nats.Conn.Servers(), which drops the user and password of
// a configured URL, so a worker whose credentials were in its URL could
// not log in elsewhere and did not move.
func TestMoveURLs(t *testing.T) {
	for _, tt := range []struct {
		name, configured string
		discovered       []string
		want             string
	}{
		{"credentials carried", "nats://u:p@a:4222", []string{"nats://b:4222", "nats://c:4222"},
			"nats://u:p@a:4222,nats://u:p@b:4222,nats://u:p@c:4222"},
		{"several configured", "nats://u:p@a:4222,nats://u:p@b:4222", []string{"nats://c:4222"},
			"nats://u:p@a:4222,nats://u:p@b:4222,nats://u:p@c:4222"},
		{"token", "nats://tok@a:4222", []string{"nats://b:4222"}, "nats://tok@a:4222,nats://tok@b:4222"},
		{"no credentials", "nats://a:4222", []string{"nats://b:4222"}, "nats://a:4222,nats://b:4222"},
		{"nothing discovered", "nats://u:p@a:4222", nil, "nats://u:p@a:4222"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			if got := moveURLs(tt.configured, tt.discovered); got != tt.want {
				t.Errorf("moveURLs(%q, %q) = %q, want %q", tt.configured, tt.discovered, got, tt.want)
			}
		})
	}
}
