package dispenser_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"

	"github.com/dispenser-dev/dispenser/dispenser"
	"github.com/dispenser-dev/dispenser/internal/tests/wait"
	"github.com/dispenser-dev/dispenser/segment"
	"github.com/dispenser-dev/dispenser/testenv"
)

func TestGracefulShutdownGivesBack(t *testing.T) {
	st := newStack(t, map[string]int64{"a": 1000})
	w := st.worker(t, segment.Settings{})
	nc := testenv.Connect(t, st.ns)
	if body, _ := request(t, nc, "id.segment.a", "10", nil); !strings.HasSuffix(body, "\n10") {
		t.Fatalf("got %q, want 1..10", body)
	}
	w.stop(t)
	tag, err := st.store.Tag(context.Background(), "a")
	if err != nil {
		t.Fatal(err)
	}
	if tag.MaxID != 11 {
		t.Fatalf("max_id after give-back = %d, want 11", tag.MaxID)
	}
	st.worker(t, segment.Settings{})
	if body, code := request(t, nc, "id.segment.a", "", nil); body != "11" {
		t.Fatalf("next worker: %q (code %q), want 11", body, code)
	}
}

// TestStopAnswersRequestsInFlight: a request parked while its segment is
// fetched is answered with IDs by a Stop that runs meanwhile, and Stop
// returns only after that answer, so that a SIGTERM loses no request it
// received (the allocator closes after Stop and would answer 503).
func TestStopAnswersRequestsInFlight(t *testing.T) {
	st := newStack(t, map[string]int64{"a": 10})
	w := st.worker(t, segment.Settings{MaxWait: time.Minute})
	nc := testenv.Connect(t, st.ns)
	release := lockTag(t, st.pool, "a") // the first fetch blocks
	inbox := nats.NewInbox()
	sub, err := nc.SubscribeSync(inbox)
	if err != nil {
		t.Fatal(err)
	}
	if err := nc.PublishRequest("id.segment.a", inbox, []byte("3")); err != nil {
		t.Fatal(err)
	}
	wait.For(t, 30*time.Second, "the request to wait for a segment", func() bool {
		for _, ts := range w.alloc.Stats() {
			if ts.Tag == "a" && ts.Waits > 0 {
				return true
			}
		}
		return false
	})

	stopped := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		stopped <- w.svc.Stop(ctx)
	}()
	// Stop has begun once the endpoint is gone; it must not return while
	// the parked request waits. The probes ask for an unknown tag: a probe
	// for "a" that arrived before the endpoint went would park too and
	// might take ID 1.
	wait.For(t, 30*time.Second, "the endpoint to go", func() bool {
		_, err := nc.Request("id.segment.probe", nil, time.Second)
		return errors.Is(err, nats.ErrNoResponders)
	})
	select {
	case err := <-stopped:
		t.Fatalf("Stop returned (%v) while a request was in flight", err)
	case <-time.After(200 * time.Millisecond):
	}
	release()
	if err := <-stopped; err != nil {
		t.Fatalf("Stop: %v", err)
	}
	if err := w.alloc.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	msg, err := sub.NextMsg(10 * time.Second)
	if err != nil {
		t.Fatalf("the request in flight got no answer: %v", err)
	}
	if code := msg.Header.Get(micro.ErrorCodeHeader); code != "" || string(msg.Data) != "1\n2\n3" {
		t.Fatalf("the request in flight got %q (code %q), want IDs 1 to 3", msg.Data, code)
	}
}

func TestMicroDiscovery(t *testing.T) {
	st := newStack(t, map[string]int64{"orders": 100})
	st.worker(t, segment.Settings{MaxWait: 5 * time.Second}) // a busy machine's first fetch may be slow
	nc := testenv.Connect(t, st.ns)
	if body, code := request(t, nc, "id.segment.orders", "", nil); code != "" {
		t.Fatalf("first request: %q code %s", body, code)
	}

	resp, err := nc.Request("$SRV.INFO.dispenser", nil, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	info := string(resp.Data)
	for _, want := range []string{`"name":"dispenser"`, `"subject":"id.segment.\u003e"`, `"queue_group":"dispenser"`} {
		if !strings.Contains(info, want) {
			t.Errorf("info %s lacks %s", info, want)
		}
	}
	resp, err = nc.Request("$SRV.STATS.dispenser", nil, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	stats := string(resp.Data)
	for _, want := range []string{`"tag":"orders"`, `"next_ready"`, `"fetches":1`, `"last_fetch_latency_ms"`} {
		if !strings.Contains(stats, want) {
			t.Errorf("stats %s lacks %s", stats, want)
		}
	}
}

func TestSegmentEndpointWaitsForTagList(t *testing.T) {
	st := newStack(t, map[string]int64{"a": 10})
	store := &downStore{Store: st.store}
	store.down.Store(true)
	alloc, err := segment.New(segment.Settings{Store: store, Logger: quiet, RetryMin: time.Millisecond, RetryMax: 10 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	svc, err := dispenser.New(dispenser.Config{Conn: testenv.Connect(t, st.ns), Segments: alloc, Logger: quiet, ReadyTimeout: 20 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { svc.Stop(context.Background()); alloc.Close(context.Background()) })
	nc := testenv.Connect(t, st.ns)
	if _, err := nc.Request("id.segment.a", nil, time.Second); !errors.Is(err, nats.ErrNoResponders) {
		t.Fatalf("with the store down: err = %v, want no responders (the endpoint is not there yet)", err)
	}
	store.down.Store(false)
	deadline := time.Now().Add(10 * time.Second)
	for {
		resp, err := nc.Request("id.segment.a", nil, time.Second)
		if err == nil {
			if string(resp.Data) != "1" {
				t.Fatalf("got %q (code %q), want 1", resp.Data, resp.Header.Get(micro.ErrorCodeHeader))
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("segment endpoint never appeared: %v", err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestShuttingDownIs503(t *testing.T) {
	st := newStack(t, map[string]int64{"a": 10})
	w := st.worker(t, segment.Settings{})
	nc := testenv.Connect(t, st.ns)
	request(t, nc, "id.segment.a", "", nil)
	if err := w.alloc.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	if body, code := request(t, nc, "id.segment.a", "9", nil); code != "503" {
		t.Fatalf("after the allocator closed: %q code %q, want 503", body, code)
	}
}

// TestMoveLosesNoRequest: the only worker moves to a new connection
// (Service.Move, as when its server enters lame-duck mode) and the old one
// is closed right after, while clients keep asking back to back: no
// request fails or goes unanswered, no ID comes twice, and the service
// answers under a new micro service ID on the new connection.
func TestMoveLosesNoRequest(t *testing.T) {
	st := newStack(t, map[string]int64{"a": 100})
	w := st.worker(t, segment.Settings{})
	nc := testenv.Connect(t, st.ns)
	var (
		mu       sync.Mutex // protects answered, failed and seen
		answered int
		failed   []string
		seen     = map[int64]bool{}
		dups     []int64
	)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			for ctx.Err() == nil {
				resp, err := nc.Request("id.segment.a", []byte("3"), 5*time.Second)
				mu.Lock()
				switch {
				case err != nil:
					failed = append(failed, err.Error())
				case resp.Header.Get(micro.ErrorCodeHeader) != "":
					failed = append(failed, resp.Header.Get(micro.ErrorCodeHeader)+" "+resp.Header.Get(micro.ErrorHeader))
				default:
					ids, err := decodeIDs(string(resp.Data))
					if err != nil {
						failed = append(failed, err.Error())
					}
					for _, id := range ids {
						if seen[id] {
							dups = append(dups, id)
						}
						seen[id] = true
					}
					answered++
				}
				mu.Unlock()
			}
		})
	}
	answers := func() int { mu.Lock(); defer mu.Unlock(); return answered }
	wait.For(t, 30*time.Second, "answers before the move", func() bool { return answers() >= 200 })
	before := w.svc.ID()
	nc2 := testenv.Connect(t, st.ns)
	moveCtx, moveCancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer moveCancel()
	old, err := w.svc.Move(moveCtx, nc2)
	if err != nil {
		t.Fatalf("Move: %v", err)
	}
	if n := old.NumSubscriptions(); n != 0 {
		t.Errorf("old connection after Move: %d subscriptions, want 0", n)
	}
	old.Close()
	moved := answers()
	wait.For(t, 30*time.Second, "answers after the move", func() bool { return answers() >= moved+200 })
	cancel()
	wg.Wait()
	if len(failed) > 0 {
		t.Errorf("%d requests failed, e.g. %s", len(failed), failed[0])
	}
	if len(dups) > 0 {
		t.Errorf("%d IDs handed out twice, e.g. %d", len(dups), dups[0])
	}
	if after := w.svc.ID(); after == before {
		t.Errorf("service ID after Move = %s, want a new one", after)
	}
	if _, err := w.svc.Move(moveCtx, testenv.Connect(t, st.ns)); err != nil {
		t.Errorf("second Move: %v", err)
	}
}

// TestStartingWorkerWarmsPeersTags: a worker that starts next to one that
// served tags a and b loads a and b before it joins, so that it answers
// their first requests from memory; without the warm-up their first
// request waits for a fetch (and fails with 503 after MaxWait if the
// store is slow then, as in a leader election of the witness bucket).
func TestStartingWorkerWarmsPeersTags(t *testing.T) {
	st := newStack(t, map[string]int64{"a": 100, "b": 100, "idle": 100})
	start := func() *segment.Allocator {
		t.Helper()
		alloc, err := segment.New(segment.Settings{Store: st.store, Logger: quiet})
		if err != nil {
			t.Fatal(err)
		}
		svc, err := dispenser.New(dispenser.Config{Conn: testenv.Connect(t, st.ns), Segments: alloc, Logger: quiet,
			PeerCheck: 200 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			svc.Stop(ctx)
			alloc.Close(ctx)
		})
		return alloc
	}
	start()
	nc := testenv.Connect(t, st.ns)
	for _, tag := range []string{"a", "b"} {
		if _, code := request(t, nc, "id.segment."+tag, "", nil); code != "" {
			t.Fatalf("%s: code %s", tag, code)
		}
	}
	second := start()
	for _, tag := range []string{"a", "b"} {
		if _, pending, err := second.TakeNow(tag, 1, nil); err != nil || pending != nil {
			t.Errorf("second worker, first request of %s: waits for a fetch (%v), err %v; want it served from memory", tag, pending != nil, err)
		}
	}
	if second.Known("idle") {
		t.Errorf("second worker loaded tag idle, which no peer served")
	}
}
