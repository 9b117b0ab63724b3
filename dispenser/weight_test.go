package dispenser_test

import (
	"context"
	"encoding/json"
	"math"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"

	"github.com/dispenser-dev/dispenser/dispenser"
	"github.com/dispenser-dev/dispenser/internal/tests/check"
	"github.com/dispenser-dev/dispenser/internal/tests/wait"
	"github.com/dispenser-dev/dispenser/tagmodel"
	"github.com/dispenser-dev/dispenser/testenv"
)

// serverWeight returns, per client connection ID, the queue subscriptions
// the server holds on the literal subject in the queue group "dispenser":
// the weights (every worker's segment endpoint is on id.segment.>).
func serverWeight(tb testing.TB, ns *server.Server, subject string) map[uint64]int {
	tb.Helper()
	sz, err := ns.Subsz(&server.SubszOptions{Subscriptions: true, Test: subject, Limit: 10000})
	if err != nil {
		tb.Fatal(err)
	}
	out := map[uint64]int{}
	for _, sub := range sz.Subs {
		if sub.Subject == subject && sub.Queue == "dispenser" {
			out[sub.Cid]++
		}
	}
	return out
}

// total is the number of subscriptions in a serverWeight.
func total(w map[uint64]int) int {
	n := 0
	for _, c := range w {
		n += c
	}
	return n
}

// weightStats is what the tests read of a worker's $SRV.STATS: the
// segment endpoint's requests and its ordered stats.
type weightStats struct {
	requests           int
	straight, received uint64
	forwarded          uint64
	weighted           []string
}

func statsOf(tb testing.TB, nc *nats.Conn, svc *dispenser.Service) weightStats {
	tb.Helper()
	resp, err := nc.Request("$SRV.STATS.dispenser."+svc.ID(), nil, 5*time.Second)
	if err != nil {
		tb.Fatal(err)
	}
	var st micro.Stats
	if err := json.Unmarshal(resp.Data, &st); err != nil {
		tb.Fatal(err)
	}
	for _, e := range st.Endpoints {
		if e.Name != "segment" {
			continue
		}
		var data struct {
			Ordered struct {
				Straight  uint64   `json:"straight"`
				Received  uint64   `json:"received"`
				Forwarded uint64   `json:"forwarded"`
				Weighted  []string `json:"weighted"`
			} `json:"ordered"`
		}
		if err := json.Unmarshal(e.Data, &data); err != nil {
			tb.Fatal(err)
		}
		o := data.Ordered
		return weightStats{requests: e.NumRequests, straight: o.Straight, received: o.Received, forwarded: o.Forwarded, weighted: o.Weighted}
	}
	tb.Fatal("no segment endpoint in the stats")
	return weightStats{}
}

// tagOwner requests tag until one of workers owns it, and returns it.
func tagOwner(tb testing.TB, nc *nats.Conn, tag string, workers []*orderedWorker) *orderedWorker {
	tb.Helper()
	var owner *orderedWorker
	wait.For(tb, 15*time.Second, "an owner of "+tag, func() bool {
		if _, code := request(tb, nc, "id.segment."+tag, "", nil); code != "" {
			return false
		}
		for _, w := range workers {
			if w.owners.Owns(tag) {
				owner = w
				return true
			}
		}
		return false
	})
	return owner
}

// weightedBy waits until the server holds the weight of subject, all of
// it on one connection, and returns that connection's ID.
func weightedBy(tb testing.TB, ns *server.Server, subject string) uint64 {
	tb.Helper()
	var cid uint64
	wait.For(tb, 15*time.Second, "the weight of "+subject+" on the server", func() bool {
		w := serverWeight(tb, ns, subject)
		for c, n := range w {
			cid = c
			return len(w) == 1 && n == dispenser.WeightSubs
		}
		return false
	})
	return cid
}

func createOrdered(tb testing.TB, st *stack, tag string) {
	tb.Helper()
	if err := st.store.CreateTag(context.Background(), tagmodel.Tag{Name: tag, Step: 100, MaxID: 1, Ordered: true}); err != nil {
		tb.Fatal(err)
	}
}

// TestWeightFollowsOwnership: the owner of an ordered tag that serves it
// weights the tag's queue group, and only the owner: the weight goes when
// it loses the tag (released while it keeps running), comes back on
// whichever worker owns the tag next, and goes when that worker stops.
func TestWeightFollowsOwnership(t *testing.T) {
	st := newStack(t, nil)
	createOrdered(t, st, "seq")
	long := func(o *orderedOptions) { o.owners.Lease = 15 * time.Second }
	workers := []*orderedWorker{st.orderedWorker(t, "w0", long), st.orderedWorker(t, "w1", long), st.orderedWorker(t, "w2", long)}
	nc := testenv.Connect(t, st.ns)
	const subject = "id.segment.seq"

	first := tagOwner(t, nc, "seq", workers)
	weightedBy(t, st.ns, subject)
	for _, w := range workers {
		got := statsOf(t, nc, w.svc).weighted
		if want := []string(nil); w == first {
			want = []string{"seq"}
			if !slices.Equal(got, want) {
				t.Fatalf("owner %s weights %v, want %v", w.name, got, want)
			}
		} else if len(got) != 0 {
			t.Fatalf("%s, not the owner, weights %v", w.name, got)
		}
	}

	first.owners.Release("seq") // first keeps running
	wait.For(t, 15*time.Second, "the weight gone after the owner released the tag", func() bool {
		return total(serverWeight(t, st.ns, subject)) == 0
	})
	if got := dispenser.Weighted(first.svc); len(got) != 0 {
		t.Fatalf("the former owner still weights %v", got)
	}

	second := tagOwner(t, nc, "seq", workers) // first again, maybe
	weightedBy(t, st.ns, subject)
	second.owners.Close() // a graceful stop: hand over, then drain
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := second.svc.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	wait.For(t, 15*time.Second, "the weight gone after the owner stopped", func() bool {
		return total(serverWeight(t, st.ns, subject)) == 0
	})
}

// TestWeightMovesWithTheWorker: a worker that moves to another connection
// (Service.Move) drops the weight on the old one, whose segment endpoint
// leaves its queue group, and weights the tag again on the new one.
func TestWeightMovesWithTheWorker(t *testing.T) {
	st := newStack(t, nil)
	createOrdered(t, st, "seq")
	w := st.orderedWorker(t, "w0", func(o *orderedOptions) { o.owners.Lease = 15 * time.Second })
	nc := testenv.Connect(t, st.ns)
	const subject = "id.segment.seq"
	tagOwner(t, nc, "seq", []*orderedWorker{w})
	before := weightedBy(t, st.ns, subject)

	nc2 := testenv.Connect(t, st.ns)
	cid2, err := nc2.GetClientID()
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	old, err := w.svc.Move(ctx, nc2)
	if err != nil {
		t.Fatalf("Move: %v", err)
	}
	if n := old.NumSubscriptions(); n != 0 {
		t.Fatalf("old connection after Move: %d subscriptions, want 0", n)
	}
	if after := weightedBy(t, st.ns, subject); after != cid2 || after == before {
		t.Fatalf("after Move the weight is on connection %d, want %d (the new one; the old one was %d)", after, cid2, before)
	}
}

// TestWeightSendsMostRequestsStraight: with three workers, a plain NATS
// requester's requests for an ordered tag reach its owner straight from
// the queue group, bar (N-1)/(N+K) of them on average, which the others
// forward; every request is served by the owner once, counted in the
// segment endpoint's requests, and the IDs stay linearizable.
func TestWeightSendsMostRequestsStraight(t *testing.T) {
	st := newStack(t, nil)
	createOrdered(t, st, "seq")
	long := func(o *orderedOptions) { o.owners.Lease = 15 * time.Second }
	workers := []*orderedWorker{st.orderedWorker(t, "w0", long), st.orderedWorker(t, "w1", long), st.orderedWorker(t, "w2", long)}
	nc := testenv.Connect(t, st.ns)
	owner := tagOwner(t, nc, "seq", workers)
	weightedBy(t, st.ns, "id.segment.seq")

	before := statsOf(t, nc, owner.svc)
	const requests = 800
	obs := load(t, st, "id.segment.seq", 8, requests)
	checkUnique(t, obs)
	if n, ex := check.Linearizable(obs); n != 0 {
		t.Fatalf("%d of %d requests broke linearizable increase: %s", n, len(obs), example(ex))
	}
	after := statsOf(t, nc, owner.svc)
	straight, received := after.straight-before.straight, after.received-before.received
	if straight+received != requests {
		t.Fatalf("the owner served %d straight and %d forwarded requests, want %d in all", straight, received, requests)
	}
	if got := after.requests - before.requests; got != int(straight) {
		t.Errorf("the owner's segment endpoint counted %d requests, want the %d that reached it straight", got, straight)
	}
	var forwarded uint64
	for _, w := range workers {
		if w != owner {
			forwarded += statsOf(t, nc, w.svc).forwarded
		}
	}
	// Forwarded: Binomial(800, p), p = (N-1)/(N+K) = 2/35, mean 46, sd
	// 6.6. Without the weight p = 2/3, mean 533. The bound is 20 sd
	// above the mean: no chance draw reaches it.
	const n, k = 3, dispenser.WeightSubs
	p := float64(n-1) / float64(n+k)
	bound := uint64(requests*p + 20*math.Sqrt(requests*p*(1-p)))
	t.Logf("straight %d, forwarded %d (expected %.0f, bound %d)", straight, received, requests*p, bound)
	if received > bound {
		t.Errorf("%d of %d requests were forwarded to the owner, want at most %d (expected %.0f)", received, requests, bound, requests*p)
	}
	if received > forwarded {
		t.Errorf("the owner received %d forwarded requests, the others forwarded %d", received, forwarded)
	}
}

// TestWeightLeftWhileReconnecting: an owner that loses its tag while its
// NATS connection is reconnecting drops the weight for the server too,
// once connected again (as TestLeaveWhileReconnecting for an endpoint):
// otherwise the server keeps subscriptions that the worker dropped
// locally, and requests the group gives them time out.
func TestWeightLeftWhileReconnecting(t *testing.T) {
	st := newStack(t, nil)
	createOrdered(t, st, "seq")
	d := &gateDialer{open: true}
	wc, err := nats.Connect(st.ns.ClientURL(), nats.SetCustomDialer(d), nats.MaxReconnects(-1), nats.ReconnectWait(10*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(wc.Close)
	w := st.orderedWorker(t, "w0", func(o *orderedOptions) { o.owners.Lease = 15 * time.Second; o.conn = wc })
	nc := testenv.Connect(t, st.ns)
	const subject = "id.segment.seq"
	tagOwner(t, nc, "seq", []*orderedWorker{w})
	weightedBy(t, st.ns, subject)
	subs := wc.NumSubscriptions()

	d.set(false)
	wait.For(t, 30*time.Second, "the worker's connection reconnecting", wc.IsReconnecting)
	w.owners.Release("seq") // the weigher drops the weight while reconnecting
	wait.For(t, 30*time.Second, "the weight dropped", func() bool { return len(dispenser.Weighted(w.svc)) == 0 })
	if !wc.IsReconnecting() {
		t.Fatal("the weight was dropped after the connection was back: the test needs it reconnecting")
	}
	d.set(true)
	wait.For(t, 30*time.Second, "the worker's connection back", wc.IsConnected)
	wait.For(t, 30*time.Second, "the weight's subscriptions gone on the worker's side", func() bool {
		return wc.NumSubscriptions() <= subs-dispenser.WeightSubs
	})
	// Whatever the worker does about the server's copies, it does now;
	// give it the time a reconnect takes.
	for deadline := time.Now().Add(2 * time.Second); time.Now().Before(deadline) && wc.Stats().Reconnects < 2; {
		time.Sleep(5 * time.Millisecond)
	}
	wait.For(t, 30*time.Second, "the worker's connection back", wc.IsConnected)
	wait.For(t, 30*time.Second, "a flush of the worker's connection", func() bool { return wc.Flush() == nil })
	if n := total(serverWeight(t, st.ns, subject)); n != 0 {
		t.Fatalf("the server holds %d weight subscriptions the worker dropped while reconnecting, want 0", n)
	}
	// Unsubscribed while reconnecting, they were not resent: no forced
	// reconnect was needed to drop the server's copies.
	if n := wc.Stats().Reconnects; n != 1 {
		t.Fatalf("the worker's connection reconnected %d times, want 1 (a forced reconnect: the weight was not unsubscribed while reconnecting)", n)
	}
}

// TestWeightLeftOnADeadConnection: the other way a drain's UNSUB is lost
// (as TestLeaveOnADeadConnection for an endpoint): the owner's connection
// died without it noticing yet, requests are queued in the weight's
// subscriptions, and the weight is dropped; the reconnect resends the
// still draining subscriptions, which nats.go drops locally once the
// queued requests are handled. The server must not keep them.
func TestWeightLeftOnADeadConnection(t *testing.T) {
	st := newStack(t, nil)
	d := &silentDialer{}
	wc, err := nats.Connect(st.ns.ClientURL(), nats.SetCustomDialer(d), nats.MaxReconnects(-1), nats.ReconnectWait(10*time.Millisecond),
		nats.PingInterval(300*time.Millisecond), nats.MaxPingsOutstanding(2))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(wc.Close)
	w := st.orderedWorker(t, "w0", func(o *orderedOptions) { o.conn = wc })
	held := make(chan struct{})
	var once sync.Once
	release := func() { once.Do(func() { close(held) }) }
	t.Cleanup(release)
	leave, err := dispenser.Weigh(w.svc, "held", func() { <-held })
	if err != nil {
		t.Fatal(err)
	}
	const subject = "id.segment.held"
	weightedBy(t, st.ns, subject)
	subs := wc.NumSubscriptions()
	nc := testenv.Connect(t, st.ns)
	for range 3 * dispenser.WeightSubs { // the weight's handlers wait: requests queue up
		if err := nc.PublishRequest(subject, nc.NewInbox(), nil); err != nil {
			t.Fatal(err)
		}
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}

	d.kill()
	leave() // drains the weight on the dead connection
	if wc.Stats().Reconnects > 0 || !wc.IsConnected() {
		t.Fatal("the worker's connection noticed its death before the weight was dropped: the test needs it unnoticed")
	}
	wait.For(t, 30*time.Second, "the worker's connection reconnected", func() bool { return wc.Stats().Reconnects >= 1 && wc.IsConnected() })
	release()
	wait.For(t, 30*time.Second, "the weight's subscriptions gone on the worker's side", func() bool {
		return wc.NumSubscriptions() <= subs-dispenser.WeightSubs
	})
	for deadline := time.Now().Add(2 * time.Second); time.Now().Before(deadline) && wc.Stats().Reconnects < 2; {
		time.Sleep(5 * time.Millisecond)
	}
	wait.For(t, 30*time.Second, "the worker's connection back", wc.IsConnected)
	wait.For(t, 30*time.Second, "a flush of the worker's connection", func() bool { return wc.Flush() == nil })
	if n := total(serverWeight(t, st.ns, subject)); n != 0 {
		t.Fatalf("the server holds %d weight subscriptions the worker dropped on a dead connection, want 0", n)
	}
}
