package dispenser_test

import (
	"context"
	"errors"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/dispenser-dev/dispenser/dispenser"
	"github.com/dispenser-dev/dispenser/internal/tests/wait"
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
	wait.For(t, 30*time.Second, "the worker's connection reconnecting", wc.IsReconnecting)
	sick.down.Store(true) // the watcher leaves the group while reconnecting
	wait.For(t, 30*time.Second, "the worker leaving the queue group", func() bool { return !svc.Serving()["snowflake"] })
	if !wc.IsReconnecting() {
		t.Fatal("the worker left its queue group after its connection was back: the test needs it reconnecting")
	}
	d.set(true)
	wait.For(t, 30*time.Second, "the worker's connection back", wc.IsConnected)
	// The subscription is gone on the worker's side (at once, or once a
	// drain completed after the reconnect).
	wait.For(t, 30*time.Second, "the worker's subscription gone", func() bool { return wc.NumSubscriptions() < subs })
	// A flush cut short by a reconnect is tried again.
	wait.For(t, 30*time.Second, "a flush of the worker's connection", func() bool { return wc.Flush() == nil })
	_, err = nc.Request("id.snowflake", nil, 2*time.Second)
	if !errors.Is(err, nats.ErrNoResponders) {
		t.Fatalf("request after the worker left its queue group while reconnecting: %v, want %v (the server still has its subscription)", err, nats.ErrNoResponders)
	}
}

// silentConn is a connection that can die without its client noticing:
// once killed, the server sees it closed, while the client's writes
// vanish and its reads wait, as for a worker frozen while its server
// closed its connection.
type silentConn struct {
	net.Conn
	dead   atomic.Bool
	closed chan struct{}
	once   sync.Once
}

func (c *silentConn) kill() { c.dead.Store(true); _ = c.Conn.Close() }

func (c *silentConn) Read(b []byte) (int, error) {
	n, err := c.Conn.Read(b)
	if err != nil && c.dead.Load() {
		<-c.closed
	}
	return n, err
}

func (c *silentConn) Write(b []byte) (int, error) {
	if c.dead.Load() {
		return len(b), nil
	}
	return c.Conn.Write(b)
}

func (c *silentConn) Close() error {
	c.once.Do(func() { close(c.closed) })
	return c.Conn.Close()
}

type silentDialer struct {
	mu   sync.Mutex // protects last
	last *silentConn
}

func (d *silentDialer) Dial(network, address string) (net.Conn, error) {
	c, err := net.Dial(network, address)
	if err != nil {
		return nil, err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	d.last = &silentConn{Conn: c, closed: make(chan struct{})}
	return d.last, nil
}

func (d *silentDialer) kill() {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.last.kill()
}

// heldSnowflake is a servableSnowflake whose AppendIDs waits while held.
type heldSnowflake struct {
	*servableSnowflake
	held sync.RWMutex // write-locked: AppendIDs waits
}

func (h *heldSnowflake) AppendIDs(dst []int64, n int) ([]int64, error) {
	h.held.RLock()
	defer h.held.RUnlock()
	return h.servableSnowflake.AppendIDs(dst, n)
}

// TestLeaveOnADeadConnection: the other way a drain's UNSUB is lost. A
// worker's connection died without it noticing yet (its server closed
// it, as for a frozen worker), requests are queued in its subscription,
// and it leaves the queue group: the UNSUB goes nowhere, the reconnect
// resends the still draining subscription, and nats.go drops it locally
// once the queued requests are answered. The server must not keep it: a
// request then finds no responders, not a member that never answers.
func TestLeaveOnADeadConnection(t *testing.T) {
	ns := testenv.NATS(t)
	d := &silentDialer{}
	wc, err := nats.Connect(ns.ClientURL(), nats.SetCustomDialer(d), nats.MaxReconnects(-1), nats.ReconnectWait(10*time.Millisecond),
		nats.PingInterval(300*time.Millisecond), nats.MaxPingsOutstanding(2))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(wc.Close)
	sick := &heldSnowflake{servableSnowflake: &servableSnowflake{downSnowflake: newDownSnowflake(t, 2)}}
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
	sick.held.Lock() // the handler waits in AppendIDs: requests queue up
	for range 3 {
		if err := nc.PublishRequest("id.snowflake", nc.NewInbox(), nil); err != nil {
			t.Fatal(err)
		}
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	d.kill()
	sick.down.Store(true) // the watcher drains the subscription on the dead connection
	wait.For(t, 30*time.Second, "the worker leaving the queue group", func() bool { return !svc.Serving()["snowflake"] })
	if wc.Stats().Reconnects > 0 || !wc.IsConnected() {
		t.Fatal("the worker's connection noticed its death before the worker left: the test needs it unnoticed")
	}
	wait.For(t, 30*time.Second, "the worker's connection reconnected", func() bool { return wc.Stats().Reconnects >= 1 && wc.IsConnected() })
	sick.held.Unlock()
	wait.For(t, 30*time.Second, "the worker's subscription gone", func() bool { return wc.NumSubscriptions() < subs })
	// Whatever the worker does about the server's copy, it does now;
	// give it the time a reconnect takes before asking.
	for deadline := time.Now().Add(2 * time.Second); time.Now().Before(deadline) && wc.Stats().Reconnects < 2; {
		time.Sleep(5 * time.Millisecond)
	}
	wait.For(t, 30*time.Second, "the worker's connection back", wc.IsConnected)
	// A flush cut short by a reconnect is tried again.
	wait.For(t, 30*time.Second, "a flush of the worker's connection", func() bool { return wc.Flush() == nil })
	_, err = nc.Request("id.snowflake", nil, 2*time.Second)
	if !errors.Is(err, nats.ErrNoResponders) {
		t.Fatalf("request after the worker left its queue group on a dead connection: %v, want %v (the server still has its subscription)", err, nats.ErrNoResponders)
	}
}
