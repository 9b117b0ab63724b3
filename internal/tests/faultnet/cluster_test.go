package faultnet_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/dispenser-dev/dispenser/internal/tests/faultnet"
	"github.com/dispenser-dev/dispenser/testenv"
)

// TestClusterIsolateStreamLeader isolates the node leading a 3-replica KV
// bucket's stream: the isolated node's routes go down, the majority
// elects a leader and accepts a revision-checked update that the isolated
// replica does not see, and after the heal the isolated replica catches
// up.
func TestClusterIsolateStreamLeader(t *testing.T) {
	c := faultnet.NewCluster(t, 3, faultnet.ClusterOptions{})
	ctx := context.Background()
	js, err := jetstream.New(testenv.Connect(t, c.Servers[0]))
	if err != nil {
		t.Fatal(err)
	}
	testenv.CreateKeyValue(t, js, jetstream.KeyValueConfig{Bucket: "faultnet", Replicas: 3})
	const stream = "KV_faultnet"
	info, err := js.Stream(ctx, stream)
	if err != nil {
		t.Fatal(err)
	}
	names := []string{c.Servers[0].Name(), c.Servers[1].Name(), c.Servers[2].Name()}
	iso := slices.Index(names, info.CachedInfo().Cluster.Leader)
	if iso < 0 {
		t.Fatalf("stream leader %q is none of %v", info.CachedInfo().Cluster.Leader, names)
	}
	major := (iso + 1) % 3
	mjs, err := jetstream.New(testenv.Connect(t, c.Servers[major]))
	if err != nil {
		t.Fatal(err)
	}
	kv, err := mjs.KeyValue(ctx, "faultnet")
	if err != nil {
		t.Fatal(err)
	}
	rev, err := kv.Put(ctx, "k", []byte("v1"))
	if err != nil {
		t.Fatal(err)
	}

	start := time.Now()
	c.Isolate(iso)
	// The majority elects a new leader and takes a revision-checked update.
	var newRev uint64
	for deadline := start.Add(30 * time.Second); ; {
		uctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		newRev, err = kv.Update(uctx, "k", []byte("v2"), rev)
		cancel()
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("update on the majority (n%d) with n%d isolated: still failing after 30s: %v", major, iso, err)
		}
	}
	t.Logf("n%d (stream leader) isolated: first update on the majority after %v", iso, time.Since(start))
	c.WaitRoutes(t, iso, 0)
	t.Logf("n%d reports no routes after %v", iso, time.Since(start))
	if seq, ok := c.StreamLastSeq(t, iso, stream); !ok || seq >= newRev {
		t.Fatalf("isolated n%d's replica: last seq %d (replica %v); want one below the majority's update (%d)", iso, seq, ok, newRev)
	}

	healed := time.Now()
	c.Heal()
	for i := range c.Servers {
		c.WaitRoutes(t, i, 2)
	}
	t.Logf("routes back on every node %v after the heal", time.Since(healed))
	for deadline := healed.Add(30 * time.Second); ; {
		if seq, _ := c.StreamLastSeq(t, iso, stream); seq >= newRev {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("n%d's replica did not catch up to seq %d within 30s of the heal", iso, newRev)
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Logf("n%d's replica caught up %v after the heal", iso, time.Since(healed))
	ijs, err := jetstream.New(testenv.Connect(t, c.Servers[iso]))
	if err != nil {
		t.Fatal(err)
	}
	ikv, err := ijs.KeyValue(ctx, "faultnet")
	if err != nil {
		t.Fatal(err)
	}
	e, err := ikv.Get(ctx, "k")
	if err != nil || string(e.Value()) != "v2" || e.Revision() != newRev {
		t.Fatalf("read through n%d after the heal: %v; want v2 at revision %d", iso, err, newRev)
	}
}

// TestClientLink connects a client to each server through its ClientLink:
// it reaches that server, and a black hole on the link cuts it off while a
// direct connection still works.
func TestClientLink(t *testing.T) {
	t.Parallel() // mostly waits (routes, pings, latency), on a cluster of its own
	c := faultnet.NewCluster(t, 3, faultnet.ClusterOptions{NoAdvertise: true})
	direct := testenv.Connect(t, c.Servers[0])
	for i, s := range c.Servers {
		l := c.ClientLink(t, fmt.Sprintf("client-n%d", i), i)
		nc, err := nats.Connect("nats://"+l.Addr(), nats.Timeout(2*time.Second))
		if err != nil {
			t.Fatalf("connect through the link to n%d: %v", i, err)
		}
		t.Cleanup(nc.Close)
		if got := nc.ConnectedServerName(); got != s.Name() {
			t.Fatalf("a client through the link to n%d is connected to %q, want %q", i, got, s.Name())
		}
		subject := fmt.Sprintf("faultnet.client.%d", i)
		if _, err := nc.Subscribe(subject, func(m *nats.Msg) { m.Respond([]byte("ok")) }); err != nil {
			t.Fatal(err)
		}
		if err := nc.Flush(); err != nil {
			t.Fatal(err)
		}
		// Wait until the subscription reached n0 (over a route for n1, n2).
		for deadline := time.Now().Add(10 * time.Second); ; {
			_, err := direct.Request(subject, nil, time.Second)
			if err == nil {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("request from n0 to a client of n%d: %v after 10s", i, err)
			}
		}
		l.BlackHole(faultnet.Both)
		if _, err := direct.Request(subject, nil, time.Second); err == nil {
			t.Fatalf("request to a client behind a black-holed link to n%d answered", i)
		}
		l.Heal()
		if _, err := direct.Request(subject, nil, 10*time.Second); err != nil {
			t.Fatalf("request to the client through the healed link to n%d: %v", i, err)
		}
	}
}

// TestHealCuts isolates a node of a cluster whose route links all have a
// latency and heals it at once with HealCuts: requests cross the links
// again both ways, and still take at least the latency. (It heals before
// the routes go down: connections that die in a black hole make removing
// it under a latency slow, see Link.Remove.)
func TestHealCuts(t *testing.T) {
	t.Parallel() // mostly waits (routes, pings, latency), on a cluster of its own
	const delay = 200 * time.Millisecond
	c := faultnet.NewCluster(t, 3, faultnet.ClusterOptions{})
	var ncs []*nats.Conn
	for i, s := range c.Servers {
		nc := testenv.Connect(t, s)
		if _, err := nc.Subscribe(fmt.Sprintf("faultnet.heal.%d", i), func(m *nats.Msg) { m.Respond(nil) }); err != nil {
			t.Fatal(err)
		}
		if err := nc.Flush(); err != nil {
			t.Fatal(err)
		}
		ncs = append(ncs, nc)
	}
	// request asks server to's responder through server from and returns
	// how long the answer took.
	request := func(from, to int, timeout time.Duration) (time.Duration, error) {
		start := time.Now()
		_, err := ncs[from].Request(fmt.Sprintf("faultnet.heal.%d", to), nil, timeout)
		return time.Since(start), err
	}
	for _, from := range []int{0, 2} {
		// n1's subscription reaches the other servers over the routes a
		// moment after its flush: until then a request finds no
		// responders (seen on a busy machine). Wait for the interest.
		for deadline := time.Now().Add(10 * time.Second); ; {
			_, err := request(from, 1, 10*time.Second)
			if errors.Is(err, nats.ErrNoResponders) && time.Now().Before(deadline) {
				time.Sleep(10 * time.Millisecond)
				continue
			}
			if err != nil {
				t.Fatalf("n%d to n1 before the faults: %v", from, err)
			}
			break
		}
	}
	for _, row := range c.Links {
		for _, l := range row {
			if l != nil {
				l.Latency(faultnet.Both, delay, 0)
			}
		}
	}
	c.Isolate(1)
	if _, err := request(0, 1, 500*time.Millisecond); err == nil {
		t.Fatalf("n0 to n1 answered with n1 isolated")
	}
	c.HealCuts(t)
	for _, from := range []int{0, 2} {
		took, err := request(from, 1, 10*time.Second)
		if err != nil {
			t.Fatalf("n%d to n1 after HealCuts: %v", from, err)
		}
		if took < delay {
			t.Fatalf("n%d to n1 after HealCuts took %v; want at least the routes' latency %v, which must stay", from, took, delay)
		}
		t.Logf("n%d to n1 after HealCuts: %v", from, took)
	}
}

// TestClientPings black-holes the link of a client that serves a queue
// group: the server pings its clients every ClientPingInterval and drops
// the silent one, so its subscription leaves the group and requests get
// no responders, instead of going into the black hole for minutes.
func TestClientPings(t *testing.T) {
	t.Parallel() // mostly waits (routes, pings, latency), on a cluster of its own
	c := faultnet.NewCluster(t, 3, faultnet.ClusterOptions{NoAdvertise: true})
	l := c.ClientLink(t, "worker-n0", 0)
	nc, err := nats.Connect("nats://"+l.Addr(), nats.Name("behind-the-link"), nats.NoReconnect())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	if _, err := nc.QueueSubscribe("faultnet.svc", "workers", func(m *nats.Msg) { m.Respond(nil) }); err != nil {
		t.Fatal(err)
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	client := testenv.Connect(t, c.Servers[0])
	if _, err := client.Request("faultnet.svc", nil, 5*time.Second); err != nil {
		t.Fatalf("request before the cut: %v", err)
	}
	l.BlackHole(faultnet.Both)
	// Wait for the event with a generous deadline (ClientDetect is 3 s;
	// nats-server's default ping interval, 2 min, would not get there).
	const within = 30 * time.Second
	start := time.Now()
	for {
		_, err := client.Request("faultnet.svc", nil, time.Second)
		if errors.Is(err, nats.ErrNoResponders) {
			break
		}
		if time.Since(start) > within {
			t.Fatalf("requests to the queue group of a client behind a black hole: %v after %v; want no responders once the server dropped it", err, within)
		}
	}
	t.Logf("the server dropped the silent client's subscription after %v (ClientDetect %v)", time.Since(start).Round(time.Millisecond), faultnet.ClientDetect)
}
