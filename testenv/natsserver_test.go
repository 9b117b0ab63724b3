package testenv_test

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/dispenser-dev/dispenser/testenv"
)

// TestNATSServerRestart: a NATSServer started again comes back on the same
// URL with its JetStream store, and a client that knew only that URL
// reconnects to it.
func TestNATSServerRestart(t *testing.T) {
	n := testenv.StartNATSServer(t)
	url := n.URL()
	reconnected := make(chan struct{}, 1)
	nc, err := nats.Connect(url, nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond),
		nats.ReconnectHandler(func(*nats.Conn) { reconnected <- struct{}{} }))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	kv := testenv.CreateKeyValue(t, js, jetstream.KeyValueConfig{Bucket: "restart"})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := kv.Put(ctx, "k", []byte("v")); err != nil {
		t.Fatal(err)
	}

	n.Stop()
	if n.Server() != nil {
		t.Fatal("Server() of a stopped server is not nil")
	}
	if err := n.Start(); err != nil {
		t.Fatal(err)
	}
	if got := n.URL(); got != url {
		t.Fatalf("URL after the restart = %s, want %s", got, url)
	}
	select {
	case <-reconnected:
	case <-ctx.Done():
		t.Fatalf("the client of %s did not reconnect", url)
	}
	e, err := kv.Get(ctx, "k")
	if err != nil || string(e.Value()) != "v" {
		t.Fatalf("after the restart: Get(k) = %v, %v; want v: the store is kept", e, err)
	}
}

// TestNATSCluster: a three-server cluster whose servers are stopped and
// started one at a time keeps an R3 bucket's value, healthy again after
// each restart.
func TestNATSCluster(t *testing.T) {
	c := testenv.StartNATSCluster(t, 3)
	nc, err := nats.Connect(c.URLs(), nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	kv := testenv.CreateKeyValue(t, js, jetstream.KeyValueConfig{Bucket: "cluster", Replicas: 3})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := kv.Put(ctx, "k", []byte("v")); err != nil {
		t.Fatal(err)
	}
	for i, node := range c.Nodes {
		if name := node.Server().Name(); name != node.Opts.ServerName {
			t.Errorf("server %d is named %q, want %q", i, name, node.Opts.ServerName)
		}
		node.Stop()
		if err := node.Start(); err != nil {
			t.Fatal(err)
		}
		c.WaitHealthy(t)
	}
	if routes := c.Nodes[0].Server().NumRoutes(); routes < 2 {
		t.Errorf("n0 has %d routes after the restarts, want at least 2", routes)
	}
	e, err := kv.Get(ctx, "k")
	if err != nil || string(e.Value()) != "v" {
		t.Fatalf("after the restarts: Get(k) = %v, %v; want v", e, err)
	}
}
