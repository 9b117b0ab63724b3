// Package testenv starts the real dependencies that dispenser's tests and
// benchmarks run against: embedded NATS servers with JetStream and a
// throwaway PostgreSQL cluster.
package testenv

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// NATSOptions returns server options for an embedded nats-server on a random
// loopback port with JetStream storing under dir.
func NATSOptions(dir string) *server.Options {
	return &server.Options{
		Host:      "127.0.0.1",
		Port:      server.RANDOM_PORT,
		NoLog:     true,
		NoSigs:    true,
		JetStream: true,
		StoreDir:  dir,
	}
}

// StartNATS starts an embedded nats-server with opts and waits until it
// accepts connections. The caller shuts it down.
func StartNATS(tb testing.TB, opts *server.Options) *server.Server {
	tb.Helper()
	s, err := server.NewServer(opts)
	if err != nil {
		tb.Fatalf("testenv: nats-server: %v", err)
	}
	s.Start()
	if !s.ReadyForConnections(10 * time.Second) {
		s.Shutdown()
		tb.Fatalf("testenv: nats-server not ready within 10s")
	}
	return s
}

// NATS starts an embedded nats-server with JetStream on a random loopback
// port, storing in tb.TempDir(), and shuts it down in Cleanup.
func NATS(tb testing.TB) *server.Server {
	tb.Helper()
	s := StartNATS(tb, NATSOptions(tb.TempDir()))
	tb.Cleanup(func() {
		s.Shutdown()
		s.WaitForShutdown()
	})
	return s
}

// Connect connects to s and closes the connection in Cleanup.
func Connect(tb testing.TB, s *server.Server, opts ...nats.Option) *nats.Conn {
	tb.Helper()
	nc, err := nats.Connect(s.ClientURL(), opts...)
	if err != nil {
		tb.Fatalf("testenv: connect to %s: %v", s.ClientURL(), err)
	}
	tb.Cleanup(nc.Close)
	return nc
}

// streamStoreFailed is nats-server's JSStreamStoreFailedF: "error creating
// store for stream".
const streamStoreFailed jetstream.ErrorCode = 10049

// CreateKeyValue creates a KV bucket. Right after a bucket of the same name
// was deleted, nats-server may still be removing the old stream's files and
// refuse the create ("error creating store for stream", 10049); the create
// is then tried again until it succeeds, at most for 10 s.
func CreateKeyValue(tb testing.TB, js jetstream.JetStream, cfg jetstream.KeyValueConfig) jetstream.KeyValue {
	tb.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		kv, err := js.CreateKeyValue(context.Background(), cfg)
		var apiErr *jetstream.APIError
		switch {
		case err == nil:
			return kv
		case errors.As(err, &apiErr) && apiErr.ErrorCode == streamStoreFailed && time.Now().Before(deadline):
			time.Sleep(20 * time.Millisecond)
		default:
			tb.Fatalf("create bucket %q: %v", cfg.Bucket, err)
		}
	}
}

// Subscribe subscribes nc to subject synchronously and flushes, so that the
// server knows the subscription before the caller sends anything.
func Subscribe(tb testing.TB, nc *nats.Conn, subject string) *nats.Subscription {
	tb.Helper()
	sub, err := nc.SubscribeSync(subject)
	if err != nil {
		tb.Fatal(err)
	}
	if err := nc.Flush(); err != nil {
		tb.Fatal(err)
	}
	return sub
}
