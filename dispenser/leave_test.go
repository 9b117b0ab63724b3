package dispenser_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/dispenser-dev/dispenser/dispenser"
	"github.com/dispenser-dev/dispenser/protocol"
	"github.com/dispenser-dev/dispenser/segment"
	"github.com/dispenser-dev/dispenser/snowflake"
	"github.com/dispenser-dev/dispenser/tagmodel"
	"github.com/dispenser-dev/dispenser/testenv"
)

// downSnowflake is a snowflake generator that an operator of the test can
// take down: while down, AppendIDs fails with snowflake.ErrFenced, as a
// worker whose lease lapsed. It does not say whether it can serve
// (no Servable): a worker with it stays in the queue group.
type downSnowflake struct {
	g    *snowflake.Generator
	down atomic.Bool
}

func newDownSnowflake(tb testing.TB, workerID int) *downSnowflake {
	tb.Helper()
	g, err := snowflake.New(snowflake.Settings{WorkerID: workerID})
	if err != nil {
		tb.Fatal(err)
	}
	return &downSnowflake{g: g}
}

func (d *downSnowflake) AppendIDs(dst []int64, n int) ([]int64, error) {
	if d.down.Load() {
		return dst, snowflake.ErrFenced
	}
	return d.g.AppendIDs(dst, n)
}
func (d *downSnowflake) Epoch() time.Time           { return d.g.Epoch() }
func (d *downSnowflake) Layout() snowflake.Layout   { return d.g.Layout() }
func (d *downSnowflake) Unavailable(err error) bool { return snowflake.Unavailable(err) }
func (d *downSnowflake) Stats() any                 { return nil }

// servableSnowflake says whether it can serve: honestly (Servable is
// !down), or, with lie set, always yes, so that only a request that finds
// it down can take it out of the queue group.
type servableSnowflake struct {
	*downSnowflake
	lie atomic.Bool
}

func (s *servableSnowflake) Servable() bool { return s.lie.Load() || !s.down.Load() }

// sfOutcome is what a run of requests got.
type sfOutcome struct {
	ids     map[int64]bool
	byID    map[string]int // replies per answering worker
	failed  map[string]int // error replies by code
	noResp  int            // nats.ErrNoResponders
	handful []string       // the first error descriptions, for the message
}

// askSnowflake sends n single requests one after another and records what
// each got; every ID must be new.
func askSnowflake(tb testing.TB, nc *nats.Conn, n int, o *sfOutcome) {
	tb.Helper()
	for range n {
		msg := &nats.Msg{Subject: "id.snowflake", Header: nats.Header{protocol.WorkerHeader: []string{"1"}}}
		resp, err := nc.RequestMsg(msg, 10*time.Second)
		if err == nats.ErrNoResponders {
			o.noResp++
			continue
		}
		if err != nil {
			tb.Fatalf("request: %v", err)
		}
		if code := resp.Header.Get(micro.ErrorCodeHeader); code != "" {
			o.failed[code]++
			if len(o.handful) < 3 {
				o.handful = append(o.handful, code+" "+resp.Header.Get(micro.ErrorHeader))
			}
			continue
		}
		id, err := strconv.ParseInt(string(resp.Data), 10, 64)
		if err != nil {
			tb.Fatalf("reply %q: %v", resp.Data, err)
		}
		if o.ids[id] {
			tb.Fatalf("ID %d handed out twice", id)
		}
		o.ids[id] = true
		o.byID[resp.Header.Get(protocol.WorkerHeader)]++
	}
}

func newOutcome() *sfOutcome {
	return &sfOutcome{ids: map[int64]bool{}, byID: map[string]int{}, failed: map[string]int{}}
}

// serving returns what the worker's $SRV.INFO says of its snowflake
// endpoint: "true" in the queue group, "false" out of it.
func serving(tb testing.TB, nc *nats.Conn, id string) string {
	tb.Helper()
	resp, err := nc.Request("$SRV.INFO."+dispenser.Name+"."+id, nil, 10*time.Second)
	if err != nil {
		tb.Fatalf("$SRV.INFO: %v", err)
	}
	var info micro.Info
	if err := json.Unmarshal(resp.Data, &info); err != nil {
		tb.Fatal(err)
	}
	for _, e := range info.Endpoints {
		if e.Name == "snowflake" {
			return e.Metadata[dispenser.ServingMetadata]
		}
	}
	tb.Fatalf("no snowflake endpoint in %s", resp.Data)
	return ""
}

// waitServing waits until the worker's snowflake endpoint is in (want
// "true") or out of ("false") its queue group.
func waitServing(tb testing.TB, nc *nats.Conn, id, want string) {
	tb.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for serving(tb, nc, id) != want {
		if time.Now().After(deadline) {
			tb.Fatalf("worker %s: snowflake serving never became %s", id, want)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// startSnowflakeService serves sf on its own connection to ns.
func startSnowflakeService(tb testing.TB, ns *server.Server, sf dispenser.Snowflake) *dispenser.Service {
	tb.Helper()
	svc, err := dispenser.New(dispenser.Config{Conn: testenv.Connect(tb, ns), Snowflake: sf, Logger: quiet})
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { svc.Stop(context.Background()) })
	return svc
}

// TestUnservableWorkerLeavesQueueGroup is issue 37 point 1 for snowflake:
// a worker that cannot issue (its lease lapsed) leaves the queue group
// until it can, so that while a healthy worker is there no request gets a
// 503; and it comes back once it can issue.
func TestUnservableWorkerLeavesQueueGroup(t *testing.T) {
	ns := testenv.NATS(t)
	healthy := startSnowflakeService(t, ns, newDownSnowflake(t, 1))
	sick := &servableSnowflake{downSnowflake: newDownSnowflake(t, 2)}
	svc := startSnowflakeService(t, ns, sick)
	nc := testenv.Connect(t, ns)

	o := newOutcome()
	askSnowflake(t, nc, 200, o)
	if o.byID[svc.ID()] == 0 || o.byID[healthy.ID()] == 0 || len(o.failed) > 0 || o.noResp > 0 {
		t.Fatalf("both serving: replies by worker %v, errors %v (%v), no responders %d; want both workers, no error",
			o.byID, o.failed, o.handful, o.noResp)
	}

	sick.down.Store(true)
	waitServing(t, nc, svc.ID(), "false")
	if got := svc.Serving(); got["snowflake"] || !got["snowflake_decode"] {
		t.Errorf("Serving() of a worker that cannot issue = %v, want snowflake false, snowflake_decode true", got)
	}
	o = newOutcome()
	askSnowflake(t, nc, 500, o)
	if len(o.failed) > 0 || o.noResp > 0 || o.byID[svc.ID()] > 0 {
		t.Fatalf("one worker down: errors %v (%v), no responders %d, replies by worker %v; want all from %s",
			o.failed, o.handful, o.noResp, o.byID, healthy.ID())
	}

	sick.down.Store(false)
	waitServing(t, nc, svc.ID(), "true")
	o = newOutcome()
	for o.byID[svc.ID()] == 0 {
		askSnowflake(t, nc, 20, o)
	}
	if len(o.failed) > 0 || o.noResp > 0 {
		t.Fatalf("back up: errors %v (%v), no responders %d", o.failed, o.handful, o.noResp)
	}
}

// TestUnservableWorkerHandsOn: a request that reaches a worker that cannot
// issue before the worker noticed (its generator still says it can serve)
// is handed to a worker that can, within the request, and the worker
// leaves the queue group: no request gets a 503 while a healthy worker is
// there. The sick worker's generator claims to be servable, so the
// watcher puts it back each time and every request it gets takes the
// hand-off path.
func TestUnservableWorkerHandsOn(t *testing.T) {
	ns := testenv.NATS(t)
	healthy := startSnowflakeService(t, ns, newDownSnowflake(t, 1))
	sick := &servableSnowflake{downSnowflake: newDownSnowflake(t, 2)}
	sick.lie.Store(true)
	sick.down.Store(true)
	svc := startSnowflakeService(t, ns, sick)
	nc := testenv.Connect(t, ns)

	// Until the sick worker has handed on some requests (it rejoins every
	// servableEvery, so requests keep reaching it).
	o := newOutcome()
	deadline := time.Now().Add(60 * time.Second)
	for dispenser.HandedOff(svc) < 20 {
		if time.Now().After(deadline) {
			t.Fatalf("the sick worker handed on only %d requests", dispenser.HandedOff(svc))
		}
		askSnowflake(t, nc, 50, o)
	}
	if len(o.failed) > 0 || o.noResp > 0 || o.byID[svc.ID()] > 0 {
		t.Fatalf("errors %v (%v), no responders %d, replies by worker %v; want all %d from %s",
			o.failed, o.handful, o.noResp, o.byID, len(o.ids), healthy.ID())
	}

	// A request already handed through as many workers as may be is
	// answered, never handed on again.
	healthy.Stop(context.Background())
	msg := &nats.Msg{Subject: "id.snowflake", Header: nats.Header{protocol.HopHeader: []string{"a,b,c"}}}
	for {
		resp, err := nc.RequestMsg(msg, 10*time.Second)
		if err == nats.ErrNoResponders {
			continue // between leaving and joining again
		}
		if err != nil {
			t.Fatal(err)
		}
		if code := resp.Header.Get(micro.ErrorCodeHeader); code != protocol.CodeUnavailable {
			t.Fatalf("a handed-on request to a worker that cannot serve: %q code %q, want 503", resp.Data, code)
		}
		break
	}
}

// TestZeroUnavailableCheckFires is the self-test of the two above: a worker
// that cannot issue and stays in the queue group (its generator does not
// say whether it can serve) answers some requests 503 while a healthy
// worker is there, so the checks that want none can fail.
func TestZeroUnavailableCheckFires(t *testing.T) {
	ns := testenv.NATS(t)
	startSnowflakeService(t, ns, newDownSnowflake(t, 1))
	sick := newDownSnowflake(t, 2)
	sick.down.Store(true)
	startSnowflakeService(t, ns, sick)
	nc := testenv.Connect(t, ns)
	o := newOutcome()
	askSnowflake(t, nc, 200, o)
	if o.failed[protocol.CodeUnavailable] == 0 {
		t.Fatalf("a worker that stays subscribed while it cannot issue: errors %v; want some 503 among 200 requests", o.failed)
	}
}

// cutStore is a segment store a test can take down for one worker: Fetch
// fails while down, as from a worker cut from its database.
type cutStore struct {
	tagmodel.Store
	down atomic.Bool
}

var errCutStore = errors.New("test: store unreachable from this worker")

func (d *cutStore) Fetch(ctx context.Context, tag string, step int64) (tagmodel.Allocation, error) {
	if d.down.Load() {
		return tagmodel.Allocation{}, errCutStore
	}
	return d.Store.Fetch(ctx, tag, step)
}

// TestSegmentRequestHandedOn is issue 37 point 1 for segment tags: a
// worker that cannot get a segment for a tag (its store unreachable from
// it, nothing in its buffers) hands the request to another worker, which
// answers it: no 503 while a worker that reaches the store is there. With
// none (the other stopped), the request is answered 503, so the check can
// fail.
func TestSegmentRequestHandedOn(t *testing.T) {
	tags := map[string]int64{}
	for i := range 40 {
		tags[fmt.Sprintf("t%02d", i)] = 10
	}
	st := newStack(t, tags)
	healthy := st.worker(t, segment.Settings{})
	down := &cutStore{Store: st.store}
	alloc, err := segment.New(segment.Settings{Store: down, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewPedanticRegistry()
	sick, err := dispenser.New(dispenser.Config{Conn: testenv.Connect(t, st.ns), Segments: alloc, Logger: quiet, Registerer: reg})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sick.Stop(context.Background()); alloc.Close(context.Background()) })
	down.down.Store(true)
	nc := testenv.Connect(t, st.ns)

	seen := map[string]map[int64]bool{}
	i := 0
	for ; dispenser.HandedOff(sick) < 3; i++ {
		if i == len(tags) {
			t.Fatalf("the worker without its store handed on %d of %d requests", dispenser.HandedOff(sick), i)
		}
		tag := fmt.Sprintf("t%02d", i)
		for range 2 {
			body, code := request(t, nc, "id.segment."+tag, "", nil)
			if code != "" {
				t.Fatalf("%s: code %s (%s) with a worker that reaches the store in the group; handed on %d", tag, code, body, dispenser.HandedOff(sick))
			}
			id := parseIDs(t, body)[0]
			if seen[tag] == nil {
				seen[tag] = map[int64]bool{}
			}
			if seen[tag][id] {
				t.Fatalf("%s: ID %d twice", tag, id)
			}
			seen[tag][id] = true
		}
	}

	// The metric counts them as the segment endpoint's (it said
	// snowflake, and only for a worker with snowflake IDs).
	fams, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	if got, ok := metricValue(fams, "dispenser_requests_handed_off_total", map[string]string{"endpoint": "segment"}); !ok || got != float64(dispenser.HandedOff(sick)) {
		t.Errorf("dispenser_requests_handed_off_total{endpoint=segment} = %v (found %v), want %d", got, ok, dispenser.HandedOff(sick))
	}

	// Alone, the worker without its store answers 503.
	healthy.stop(t)
	for ; i < len(tags); i++ {
		if _, code := request(t, nc, fmt.Sprintf("id.segment.t%02d", i), "", nil); code == protocol.CodeUnavailable {
			return
		}
	}
	t.Fatal("a worker that cannot reach its store, alone, never answered 503")
}
