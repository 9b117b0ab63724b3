package client_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/dispenser-dev/dispenser/client"
	"github.com/dispenser-dev/dispenser/testenv"
)

// A request waiting for its reply when its connection closes ends at once
// with nats.ErrConnectionClosed, as nats.go's requests do, not at its
// deadline. Seen failing without replies.wakeAll: context deadline
// exceeded, after the deadline.
func TestConnectionClosedEndsTheRequest(t *testing.T) {
	ns := testenv.NATS(t)
	nc := testenv.Connect(t, ns)
	got := make(chan *nats.Msg, 1)
	worker := testenv.Connect(t, ns)
	if _, err := worker.ChanSubscribe("id.segment.*", got); err != nil {
		t.Fatal(err)
	}
	if err := worker.Flush(); err != nil {
		t.Fatal(err)
	}
	c := newClient(t, nc, client.WithoutRetries())
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	out := make(chan error, 1)
	go func() {
		_, err := c.Segment(ctx, "orders")
		out <- err
	}()
	select {
	case <-got: // the request is out, its reply awaited
	case <-ctx.Done():
		t.Fatal("no request within 30 s")
	}
	nc.Close()
	if err := <-out; !errors.Is(err, nats.ErrConnectionClosed) {
		t.Fatalf("Segment: %v; want nats.ErrConnectionClosed", err)
	}
}

// Clients on one connection share its reply subscription, and a request
// after the connection closed fails with nats.ErrConnectionClosed.
func TestClientsShareTheirConnectionsReplies(t *testing.T) {
	nc, _ := serve(t, map[string]int64{"orders": 100})
	before := nc.NumSubscriptions()
	a, b := newClient(t, nc), newClient(t, nc)
	for _, c := range []*client.Client{a, b, a} {
		if _, err := c.Segment(context.Background(), "orders"); err != nil {
			t.Fatal(err)
		}
	}
	if got := nc.NumSubscriptions() - before; got != 1 {
		t.Errorf("%d new subscriptions for two clients; want 1", got)
	}
	nc.Close()
	if _, err := a.Segment(context.Background(), "orders"); !errors.Is(err, nats.ErrConnectionClosed) {
		t.Errorf("Segment after Close: %v; want nats.ErrConnectionClosed", err)
	}
}
