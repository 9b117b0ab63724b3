package dispenser_test

import (
	"context"
	"errors"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/dispenser-dev/dispenser/dispenser"
	"github.com/dispenser-dev/dispenser/testenv"
)

// gateDialer dials the server only while open; close cuts the connection
// it dialed last, so that the client stays reconnecting until open.
type gateDialer struct {
	mu   sync.Mutex // protects open and last
	open bool
	last net.Conn
}

func (d *gateDialer) Dial(network, address string) (net.Conn, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if !d.open {
		return nil, errors.New("gate closed")
	}
	c, err := net.Dial(network, address)
	d.last = c
	return c, err
}

func (d *gateDialer) set(open bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.open = open
	if !open && d.last != nil {
		_ = d.last.Close()
	}
}

// TestLeaveWhileReconnecting: a worker whose snowflake generator stops
// being able to issue while its NATS connection is reconnecting (seen in
// the chaos suite: a worker thawed after a freeze finds its connection
// stale and its lease lapsed at the same moment) leaves the queue group
// for the server too, once it is connected again. nats.go sends no UNSUB
// for a subscription drained while reconnecting, resends it at the
// reconnect and then drops it locally: the server would keep a member
// that never answers, and requests it picks time out (the chaos suite's
// long mode: clients on the other nodes timed out for 6 s after a heal).
// With no other worker, a request must find no responders.
func TestLeaveWhileReconnecting(t *testing.T) {
	ns := testenv.NATS(t)
	d := &gateDialer{open: true}
	wc, err := nats.Connect(ns.ClientURL(), nats.SetCustomDialer(d), nats.MaxReconnects(-1), nats.ReconnectWait(10*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(wc.Close)
	sick := &servableSnowflake{downSnowflake: newDownSnowflake(t, 2)}
	svc, err := dispenser.New(dispenser.Config{Conn: wc, Snowflake: sick, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { svc.Stop(context.Background()) })
	nc := testenv.Connect(t, ns)
	if _, err := nc.Request("id.snowflake", nil, 10*time.Second); err != nil {
		t.Fatalf("serving: %v", err)
	}

	subs := wc.NumSubscriptions()
	d.set(false)
	waitUntil(t, "the worker's connection reconnecting", wc.IsReconnecting)
	sick.down.Store(true) // the watcher leaves the group while reconnecting
	waitUntil(t, "the worker leaving the queue group", func() bool { return !svc.Serving()["snowflake"] })
	if !wc.IsReconnecting() {
		t.Fatal("the worker left its queue group after its connection was back: the test needs it reconnecting")
	}
	d.set(true)
	waitUntil(t, "the worker's connection back", wc.IsConnected)
	// The subscription is gone on the worker's side (at once, or once a
	// drain completed after the reconnect).
	waitUntil(t, "the worker's subscription gone", func() bool { return wc.NumSubscriptions() < subs })
	if err := wc.Flush(); err != nil {
		t.Fatal(err)
	}
	_, err = nc.Request("id.snowflake", nil, 2*time.Second)
	if !errors.Is(err, nats.ErrNoResponders) {
		t.Fatalf("request after the worker left its queue group while reconnecting: %v, want %v (the server still has its subscription)", err, nats.ErrNoResponders)
	}
}
