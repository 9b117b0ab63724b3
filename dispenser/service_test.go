package dispenser_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dispenser-dev/dispenser/protocol"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nats.go/micro"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/dispenser-dev/dispenser/dispenser"
	"github.com/dispenser-dev/dispenser/internal/testdb"
	"github.com/dispenser-dev/dispenser/segment"
	"github.com/dispenser-dev/dispenser/segment/postgres"
	"github.com/dispenser-dev/dispenser/snowflake"
	"github.com/dispenser-dev/dispenser/testenv"
)

func TestMain(m *testing.M) { os.Exit(testenv.Run(m)) }

var quiet = slog.New(slog.DiscardHandler)

// stack is one NATS server and one migrated PostgreSQL database.
type stack struct {
	ns    *server.Server
	pool  *pgxpool.Pool
	store *postgres.Store
}

func newStack(tb testing.TB, tags map[string]int64) *stack {
	tb.Helper()
	db := testdb.New(tb, tags)
	return &stack{ns: testenv.NATS(tb), pool: db.Pool, store: db.Store}
}

// recorder wraps the real store and remembers the segments one worker got.
type recorder struct {
	segment.Store
	mu     sync.Mutex // protects allocs
	allocs map[string][]segment.Allocation
}

func (r *recorder) Fetch(ctx context.Context, tag string, step int64) (segment.Allocation, error) {
	a, err := r.Store.Fetch(ctx, tag, step)
	if err == nil {
		r.mu.Lock()
		r.allocs[tag] = append(r.allocs[tag], a)
		r.mu.Unlock()
	}
	return a, err
}

// owns reports whether the worker fetched the segment holding id.
func (r *recorder) owns(tag string, id int64) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, a := range r.allocs[tag] {
		if a.Start <= id && id < a.End {
			return true
		}
	}
	return false
}

// worker is one dispenser instance with its own connection and allocator.
type worker struct {
	rec   *recorder
	alloc *segment.Allocator
	svc   *dispenser.Service
}

func (st *stack) worker(tb testing.TB, s segment.Settings) *worker {
	tb.Helper()
	rec := &recorder{Store: st.store, allocs: map[string][]segment.Allocation{}}
	s.Store = rec
	s.Logger = quiet
	alloc, err := segment.New(s)
	if err != nil {
		tb.Fatal(err)
	}
	nc := testenv.Connect(tb, st.ns)
	svc, err := dispenser.New(dispenser.Config{Conn: nc, Segments: alloc, Logger: quiet})
	if err != nil {
		tb.Fatal(err)
	}
	w := &worker{rec: rec, alloc: alloc, svc: svc}
	tb.Cleanup(func() { w.stop(tb) })
	return w
}

func (w *worker) stop(tb testing.TB) {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := w.svc.Stop(ctx); err != nil {
		tb.Errorf("Stop: %v", err)
	}
	if err := w.alloc.Close(ctx); err != nil {
		tb.Errorf("Close: %v", err)
	}
}

// request sends one request and returns the reply body and error code.
func request(tb testing.TB, nc *nats.Conn, subject, body string, hdr nats.Header) (string, string) {
	tb.Helper()
	msg := &nats.Msg{Subject: subject, Data: []byte(body), Header: hdr}
	resp, err := nc.RequestMsg(msg, 10*time.Second)
	if err != nil {
		tb.Fatalf("request %s %q: %v", subject, body, err)
	}
	return string(resp.Data), resp.Header.Get(micro.ErrorCodeHeader)
}

// parseIDs parses a reply body and fails the test if it is malformed. Only
// the test's goroutine may call it; others use decodeIDs.
func parseIDs(tb testing.TB, body string) []int64 {
	tb.Helper()
	ids, err := decodeIDs(body)
	if err != nil {
		tb.Fatal(err)
	}
	return ids
}

// decodeIDs parses a reply body: IDs or first-last runs, one per line.
func decodeIDs(body string) ([]int64, error) {
	var ids []int64
	for _, line := range strings.Split(body, "\n") {
		if first, last, ok := strings.Cut(line, "-"); ok {
			f, err1 := strconv.ParseInt(first, 10, 64)
			l, err2 := strconv.ParseInt(last, 10, 64)
			if err1 != nil || err2 != nil || l < f {
				return nil, fmt.Errorf("bad range line %q in %q", line, body)
			}
			for id := f; id <= l; id++ {
				ids = append(ids, id)
			}
			continue
		}
		id, err := strconv.ParseInt(line, 10, 64)
		if err != nil {
			return nil, fmt.Errorf("bad ID line %q in %q", line, body)
		}
		ids = append(ids, id)
	}
	return ids, nil
}

func TestProtocol(t *testing.T) {
	st := newStack(t, map[string]int64{"orders": 100})
	st.worker(t, segment.Settings{})
	nc := testenv.Connect(t, st.ns)
	rangeHdr := nats.Header{protocol.FormatHeader: []string{"range"}}

	tests := []struct {
		name    string
		subject string
		body    string
		hdr     nats.Header
		want    string // reply body when code is ""
		code    string
	}{
		{"empty body gives one ID", "id.segment.orders", "", nil, "1", ""},
		{"a count gives a list", "id.segment.orders", "3", nil, "2\n3\n4", ""},
		{"range format", "id.segment.orders", "5", rangeHdr, "5-9", ""},
		{"list format by name", "id.segment.orders", "1", nats.Header{protocol.FormatHeader: []string{"list"}}, "10", ""},
		{"unknown headers are ignored", "id.segment.orders", "", nats.Header{"X-Trace": []string{"1"}}, "11", ""},
		{"zero", "id.segment.orders", "0", nil, "", "400"},
		{"negative", "id.segment.orders", "-5", nil, "", "400"},
		{"not a number", "id.segment.orders", "many", nil, "", "400"},
		{"over the maximum", "id.segment.orders", "10001", nil, "", "400"},
		{"binary garbage", "id.segment.orders", "\x00\x01\xff", nil, "", "400"},
		{"megabyte body", "id.segment.orders", strings.Repeat("7", 1<<20-1024), nil, "", "400"},
		{"bad format header", "id.segment.orders", "", nats.Header{protocol.FormatHeader: []string{"csv"}}, "", "400"},
		{"bad tag token", "id.segment.a$b", "", nil, "", "400"},
		{"dotted tag", "id.segment.orders.eu", "", nil, "", "400"},
		{"format header in lower case", "id.segment.orders", "2", nats.Header{"id-format": []string{"range"}}, "12-13", ""},
		{"sql in tag", "id.segment.x';DROP", "", nil, "", "400"},
		{"129-character tag", "id.segment." + strings.Repeat("t", 129), "", nil, "", "400"},
		{"quotes in tag", `id.segment.'o"rders'`, "", nil, "", "400"},
		{"unicode tag", "id.segment.zäh", "", nil, "", "400"},
		{"percent and semicolon", "id.segment.a%;--", "", nil, "", "400"},
		{"JSON body", "id.segment.orders", `{"count":3}`, nil, "", "400"},
		{"float count", "id.segment.orders", "2.5", nil, "", "400"},
		{"huge count", "id.segment.orders", "99999999999999999999", nil, "", "400"},
		{"format header twice", "id.segment.orders", "", nats.Header{protocol.FormatHeader: []string{"range", "list"}}, "", "400"},
		{"unknown tag", "id.segment.payments", "", nil, "", "404"},
		{"after all that, nothing was consumed", "id.segment.orders", "", nil, "14", ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			body, code := request(t, nc, tt.subject, tt.body, tt.hdr)
			if code != tt.code {
				t.Fatalf("code = %q (%q), want %q", code, body, tt.code)
			}
			if tt.code == "" && body != tt.want {
				t.Fatalf("body = %q, want %q", body, tt.want)
			}
		})
	}
	names, err := st.store.Tags(context.Background())
	if err != nil || len(names) != 1 || names[0] != "orders" {
		t.Errorf("tags after hostile requests: %v, %v; want only orders", names, err)
	}
}

func TestBatchAcrossSegmentBoundary(t *testing.T) {
	st := newStack(t, map[string]int64{"a": 10})
	w := st.worker(t, segment.Settings{MaxStep: 10, PrefetchRatio: 1})
	nc := testenv.Connect(t, st.ns)
	request(t, nc, "id.segment.a", "8", nil) // 1..8
	// Another worker fetches 11..20, so our next segment is 21..30.
	if _, err := st.store.Fetch(context.Background(), "a", 0); err != nil {
		t.Fatal(err)
	}
	hdr := nats.Header{protocol.FormatHeader: []string{"range"}}
	body, code := request(t, nc, "id.segment.a", "5", hdr)
	if code != "" || body != "9-10\n21-23" {
		t.Fatalf("got %q (code %q), want two runs 9-10 and 21-23", body, code)
	}
	if !w.rec.owns("a", 23) || w.rec.owns("a", 15) {
		t.Fatal("worker's recorded segments do not match the reply")
	}
}

// lockTag holds tag's row locked, so that every fetch of it blocks, until
// the returned func is called.
func lockTag(tb testing.TB, pool *pgxpool.Pool, tag string) (release func()) {
	tb.Helper()
	ctx := context.Background()
	tx, err := pool.Begin(ctx)
	if err != nil {
		tb.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "SELECT 1 FROM leaf_alloc WHERE biz_tag = $1 FOR UPDATE", tag); err != nil {
		tb.Fatal(err)
	}
	var once sync.Once
	release = func() { once.Do(func() { tx.Rollback(ctx) }) }
	tb.Cleanup(release)
	return release
}

func TestUnavailableWhenStoreBlocks(t *testing.T) {
	st := newStack(t, map[string]int64{"a": 10})
	st.worker(t, segment.Settings{MaxWait: 50 * time.Millisecond})
	nc := testenv.Connect(t, st.ns)
	release := lockTag(t, st.pool, "a")
	if body, code := request(t, nc, "id.segment.a", "", nil); code != "503" {
		t.Fatalf("with the row locked: code %q (%q), want 503", code, body)
	}
	release()
	var body, code string
	for range 100 { // the parked fetch completes once the lock is gone
		if body, code = request(t, nc, "id.segment.a", "", nil); code == "" {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	if code != "" || body != "1" {
		t.Fatalf("after release: %q (code %q), want 1", body, code)
	}
}

func TestSlowTagDoesNotDelayOthers(t *testing.T) {
	st := newStack(t, map[string]int64{"slow": 10, "fast": 10})
	st.worker(t, segment.Settings{MaxWait: time.Minute})
	nc := testenv.Connect(t, st.ns)
	release := lockTag(t, st.pool, "slow")
	inbox := nats.NewInbox()
	sub, err := nc.SubscribeSync(inbox)
	if err != nil {
		t.Fatal(err)
	}
	if err := nc.PublishRequest("id.segment.slow", inbox, nil); err != nil {
		t.Fatal(err)
	}
	// While slow's fetch is blocked in Postgres, fast is served.
	for i := range 20 {
		body, code := request(t, nc, "id.segment.fast", "", nil)
		if code != "" || body != strconv.Itoa(i+1) {
			t.Fatalf("fast request %d: %q (code %q)", i, body, code)
		}
	}
	if msg, err := sub.NextMsg(10 * time.Millisecond); err == nil {
		t.Fatalf("slow tag answered %q while its row is locked", msg.Data)
	}
	release()
	msg, err := sub.NextMsg(10 * time.Second)
	if err != nil {
		t.Fatalf("slow tag after release: %v", err)
	}
	if string(msg.Data) != "1" {
		t.Fatalf("slow tag: %q, want 1", msg.Data)
	}
}

// TestThreeWorkersNoDuplicates runs three workers in one queue group with
// step 100 (a segment switch every 100 IDs) under 16 concurrent clients.
func TestThreeWorkersNoDuplicates(t *testing.T) {
	if testing.Short() {
		t.Log("short mode: fewer IDs")
	}
	tags := []string{"a", "b", "c"}
	st := newStack(t, map[string]int64{"a": 100, "b": 100, "c": 100})
	workers := []*worker{
		// A generous wait: the claim is zero failed requests, and a fetch
		// on a loaded 2-core machine can take longer than the default.
		st.worker(t, segment.Settings{MaxStep: 100, MaxWait: 5 * time.Second}),
		st.worker(t, segment.Settings{MaxStep: 100, MaxWait: 5 * time.Second}),
		st.worker(t, segment.Settings{MaxStep: 100, MaxWait: 5 * time.Second}),
	}
	total := 200_000
	if testing.Short() {
		total = 30_000
	}
	const clients = 16
	type got struct {
		tag string
		ids []int64 // in the order this client received them
	}
	results := make(chan got, clients*len(tags))
	var wg sync.WaitGroup
	for c := range clients {
		nc := testenv.Connect(t, st.ns) // here: Connect may call t.Fatal
		wg.Add(1)
		go func() {
			defer wg.Done()
			mine := map[string][]int64{}
			n := 0
			for i := 0; n < total/clients; i++ {
				tag := tags[(c+i)%len(tags)]
				count := 1 + (i*7+c)%9
				var hdr nats.Header
				if i%4 == 0 {
					hdr = nats.Header{protocol.FormatHeader: []string{"range"}}
				}
				resp, err := nc.RequestMsg(&nats.Msg{Subject: "id.segment." + tag, Data: []byte(strconv.Itoa(count)), Header: hdr}, 10*time.Second)
				if err != nil {
					t.Errorf("client %d: %v", c, err)
					return
				}
				if code := resp.Header.Get(micro.ErrorCodeHeader); code != "" {
					t.Errorf("client %d: error %s: %s", c, code, resp.Header.Get(micro.ErrorHeader))
					return
				}
				ids, err := decodeIDs(string(resp.Data))
				if err != nil {
					t.Errorf("client %d: %v", c, err)
					return
				}
				if len(ids) != count {
					t.Errorf("client %d: asked for %d IDs, got %d", c, count, len(ids))
					return
				}
				mine[tag] = append(mine[tag], ids...)
				n += count
			}
			for tag, ids := range mine {
				results <- got{tag, ids}
			}
		}()
	}
	wg.Wait()
	close(results)
	if t.Failed() {
		t.FailNow()
	}

	seen := map[string]map[int64]bool{}
	n := 0
	for r := range results {
		if seen[r.tag] == nil {
			seen[r.tag] = map[int64]bool{}
		}
		// Per worker, the IDs one client got must increase: a worker issues
		// in increasing order, and this client waited for each reply.
		last := make([]int64, len(workers))
		for _, id := range r.ids {
			if seen[r.tag][id] {
				t.Fatalf("tag %s: duplicate ID %d", r.tag, id)
			}
			seen[r.tag][id] = true
			n++
			owner := -1
			for i, w := range workers {
				if w.rec.owns(r.tag, id) {
					if owner >= 0 {
						t.Fatalf("tag %s: ID %d in segments of workers %d and %d", r.tag, id, owner, i)
					}
					owner = i
				}
			}
			if owner < 0 {
				t.Fatalf("tag %s: ID %d is in no worker's segment", r.tag, id)
			}
			if id <= last[owner] {
				t.Fatalf("tag %s: worker %d issued %d after %d", r.tag, owner, id, last[owner])
			}
			last[owner] = id
		}
	}
	if n < total {
		t.Fatalf("collected %d IDs, want at least %d", n, total)
	}
	fetches := 0
	for i, w := range workers {
		k := 0
		for _, tag := range tags {
			k += len(w.rec.allocs[tag])
		}
		if k == 0 {
			t.Errorf("worker %d fetched nothing: the queue group did not spread the load", i)
		}
		fetches += k
	}
	if fetches < total/100 {
		t.Errorf("%d segment fetches for %d IDs with step 100, want at least %d", fetches, n, total/100)
	}
	t.Logf("%d IDs over %d tags, %d segment fetches, no duplicates", n, len(tags), fetches)
}

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
	waitUntil(t, "the request to wait for a segment", func() bool {
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
	waitUntil(t, "the endpoint to go", func() bool {
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

// waitUntil polls cond until it holds, failing the test after 30 s.
func waitUntil(tb testing.TB, what string, cond func() bool) {
	tb.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			tb.Fatalf("timed out after 30s waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
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

func TestMetrics(t *testing.T) {
	st := newStack(t, map[string]int64{"orders": 100})
	alloc, err := segment.New(segment.Settings{Store: st.store, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewPedanticRegistry()
	svc, err := dispenser.New(dispenser.Config{Conn: testenv.Connect(t, st.ns), Segments: alloc, Logger: quiet, Registerer: reg,
		MetricsTags: []string{"orders"}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { svc.Stop(context.Background()); alloc.Close(context.Background()) })
	nc := testenv.Connect(t, st.ns)
	request(t, nc, "id.segment.orders", "5", nil)
	request(t, nc, "id.segment.orders", "", nil)
	request(t, nc, "id.segment.nope", "", nil)
	request(t, nc, "id.segment.orders", "zero", nil)

	tests := []struct {
		name   string
		metric string
		labels map[string]string
		want   float64
	}{
		{"IDs issued", "dispenser_ids_total", map[string]string{"endpoint": "segment", "tag": "orders"}, 6},
		{"good requests", "dispenser_requests_total", map[string]string{"endpoint": "segment", "tag": "orders", "code": "200"}, 2},
		{"unknown tag", "dispenser_requests_total", map[string]string{"endpoint": "segment", "tag": "", "code": "404"}, 1},
		{"bad count of a named tag", "dispenser_requests_total", map[string]string{"endpoint": "segment", "tag": "orders", "code": "400"}, 1},
		{"fetches", "dispenser_segment_fetches_total", map[string]string{"tag": "orders"}, 1},
		{"step", "dispenser_segment_step", map[string]string{"tag": "orders"}, 100},
		{"latency samples", "dispenser_request_duration_seconds", map[string]string{"endpoint": "segment"}, 4},
	}
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, ok := metricValue(families, tt.metric, tt.labels)
			if !ok || got != tt.want {
				t.Fatalf("%s%v = %v (found %v), want %v", tt.metric, tt.labels, got, ok, tt.want)
			}
		})
	}
}

// metricValue finds one sample: a counter's or gauge's value, a histogram's
// sample count.
func metricValue(families []*dto.MetricFamily, name string, labels map[string]string) (float64, bool) {
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
	next:
		for _, m := range f.GetMetric() {
			if len(m.GetLabel()) != len(labels) {
				continue
			}
			for _, l := range m.GetLabel() {
				if labels[l.GetName()] != l.GetValue() {
					continue next
				}
			}
			switch {
			case m.Counter != nil:
				return m.Counter.GetValue(), true
			case m.Gauge != nil:
				return m.Gauge.GetValue(), true
			case m.Histogram != nil:
				return float64(m.Histogram.GetSampleCount()), true
			}
		}
	}
	return 0, false
}

func TestSnowflakeEndpoints(t *testing.T) {
	ns := testenv.NATS(t)
	js, err := jetstream.New(testenv.Connect(t, ns))
	if err != nil {
		t.Fatal(err)
	}
	w, err := snowflake.StartWorker(context.Background(), js, snowflake.WorkerSettings{Instance: "w1", Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	svc, err := dispenser.New(dispenser.Config{Conn: testenv.Connect(t, ns), Snowflake: w, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { svc.Stop(context.Background()) })
	nc := testenv.Connect(t, ns)
	workerID, _ := w.WorkerID()

	one, code := request(t, nc, "id.snowflake", "", nil)
	if code != "" {
		t.Fatalf("single: code %s", code)
	}
	first := parseIDs(t, one)[0]
	batch, code := request(t, nc, "id.snowflake", "5000", nil)
	ids := parseIDs(t, batch)
	if code != "" || len(ids) != 5000 {
		t.Fatalf("batch: %d IDs, code %q; want 5000", len(ids), code)
	}
	prev := first
	for _, id := range ids {
		if id <= prev {
			t.Fatalf("snowflake IDs not increasing: %d after %d", id, prev)
		}
		prev = id
	}
	ranges, _ := request(t, nc, "id.snowflake", "100", nats.Header{protocol.FormatHeader: []string{"range"}})
	if got := parseIDs(t, ranges); len(got) != 100 || got[0] <= prev {
		t.Fatalf("range format: %d IDs starting %d, want 100 above %d", len(got), got[0], prev)
	}

	body, code := request(t, nc, "id.snowflake.decode", strconv.FormatInt(first, 10), nil)
	want := snowflake.Decode(first, w.Epoch())
	if code != "" || !strings.Contains(body, `"worker":`+strconv.Itoa(workerID)) || !strings.Contains(body, want.Time.Format(snowflake.TimeLayout)) {
		t.Fatalf("decode: %s (code %q), want worker %d time %s", body, code, workerID, want.Time.Format(snowflake.TimeLayout))
	}
	for _, tt := range []struct{ name, subject, body, code string }{
		{"zero", "id.snowflake", "0", "400"},
		{"too many", "id.snowflake", "10001", "400"},
		{"garbage", "id.snowflake", "\xff", "400"},
		{"decode garbage", "id.snowflake.decode", "abc", "400"},
		{"decode negative", "id.snowflake.decode", "-1", "400"},
	} {
		if _, code := request(t, nc, tt.subject, tt.body, nil); code != tt.code {
			t.Errorf("%s: code %q, want %s", tt.name, code, tt.code)
		}
	}
	// A closed worker (lease released) answers 503, never an ID.
	if err := w.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	if body, code := request(t, nc, "id.snowflake", "", nil); code != "503" {
		t.Fatalf("after Close: %q code %q, want 503", body, code)
	}
}

func TestWorkerHeader(t *testing.T) {
	st := newStack(t, map[string]int64{"a": 10})
	w := st.worker(t, segment.Settings{})
	nc := testenv.Connect(t, st.ns)
	resp, err := nc.RequestMsg(&nats.Msg{Subject: "id.segment.a", Header: nats.Header{protocol.WorkerHeader: []string{""}}}, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if got := resp.Header.Get(protocol.WorkerHeader); got == "" || got != w.svc.ID() {
		t.Fatalf("%s = %q, want the worker's ID %q", protocol.WorkerHeader, got, w.svc.ID())
	}
	// Error replies name the worker too.
	resp, err = nc.RequestMsg(&nats.Msg{Subject: "id.segment.nope", Header: nats.Header{protocol.WorkerHeader: []string{""}}}, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if code, got := resp.Header.Get(micro.ErrorCodeHeader), resp.Header.Get(protocol.WorkerHeader); code != "404" || got != w.svc.ID() {
		t.Fatalf("error reply: code %q, worker %q; want 404 from %q", code, got, w.svc.ID())
	}
	// Without the request header, the reply has no headers at all.
	resp, err = nc.Request("id.segment.a", nil, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Header) != 0 {
		t.Fatalf("reply headers %v, want none", resp.Header)
	}
}

// downStore is the real store behind a switch that makes it unreachable.
type downStore struct {
	segment.Store
	down atomic.Bool
}

var errDown = errors.New("store unreachable")

func (d *downStore) Tags(ctx context.Context) ([]string, error) {
	if d.down.Load() {
		return nil, errDown
	}
	return d.Store.Tags(ctx)
}

func (d *downStore) Tag(ctx context.Context, name string) (segment.Tag, error) {
	if d.down.Load() {
		return segment.Tag{}, errDown
	}
	return d.Store.Tag(ctx, name)
}

// A worker whose store is down at start-up must not take a share of the
// segment requests: it joins the segment endpoint once its tag list loads.
// 503 descriptions do not leak the store's details to requesters.
func TestUnavailableDescriptionIsGeneric(t *testing.T) {
	st := newStack(t, map[string]int64{"a": 10})
	store := &downStore{Store: st.store}
	alloc, err := segment.New(segment.Settings{Store: &failingFetch{store}, Logger: quiet, MaxWait: 20 * time.Millisecond, RetryMin: time.Millisecond, RetryMax: 5 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	svc, err := dispenser.New(dispenser.Config{Conn: testenv.Connect(t, st.ns), Segments: alloc, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { svc.Stop(context.Background()); alloc.Close(context.Background()) })
	resp, err := testenv.Connect(t, st.ns).Request("id.segment.a", nil, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	code, desc := resp.Header.Get(micro.ErrorCodeHeader), resp.Header.Get(micro.ErrorHeader)
	if code != "503" || strings.Contains(desc, "10.0.0.7") || !strings.Contains(desc, "try again") {
		t.Fatalf("reply %s %q: want 503 without the store's details", code, desc)
	}
}

// failingFetch fails every fetch with an error that names an address.
type failingFetch struct{ segment.Store }

func (f *failingFetch) Fetch(context.Context, string, int64) (segment.Allocation, error) {
	return segment.Allocation{}, errors.New("dial tcp 10.0.0.7:5432: connection refused")
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

// sfWorker is one snowflake worker process stand-in: a leased worker ID and
// a service on their own connections.
type sfWorker struct {
	w   *snowflake.Worker
	svc *dispenser.Service
}

func startSnowflake(tb testing.TB, ns *server.Server, instance string) *sfWorker {
	tb.Helper()
	js, err := jetstream.New(testenv.Connect(tb, ns))
	if err != nil {
		tb.Fatal(err)
	}
	w, err := snowflake.StartWorker(context.Background(), js, snowflake.WorkerSettings{Instance: instance, Logger: quiet})
	if err != nil {
		tb.Fatal(err)
	}
	svc, err := dispenser.New(dispenser.Config{Conn: testenv.Connect(tb, ns), Snowflake: w, Logger: quiet})
	if err != nil {
		tb.Fatal(err)
	}
	sw := &sfWorker{w: w, svc: svc}
	tb.Cleanup(func() { sw.stop(tb) })
	return sw
}

func (sw *sfWorker) stop(tb testing.TB) {
	tb.Helper()
	if err := sw.svc.Stop(context.Background()); err != nil {
		tb.Error(err)
	}
	if err := sw.w.Close(context.Background()); err != nil {
		tb.Error(err)
	}
}

// TestSnowflakeThreeWorkersNoDuplicates: three workers in one queue group,
// 16 clients, 200,000 snowflake IDs, and halfway one worker is stopped and
// replaced by a new one with the same instance name. Only 503 is retried,
// and only for a while: any other error code fails the test at once.
func TestSnowflakeThreeWorkersNoDuplicates(t *testing.T) {
	ns := testenv.NATS(t)
	workers := []*sfWorker{startSnowflake(t, ns, "sf-0"), startSnowflake(t, ns, "sf-1"), startSnowflake(t, ns, "sf-2")}
	total := 200_000
	if testing.Short() {
		total = 40_000
	}
	const clients, batch = 16, 25
	// How long a client keeps retrying 503 (a worker without a valid
	// lease) before it fails the test: a generous bound for a loaded
	// machine, far below the test's timeout.
	const retry503For = 30 * time.Second
	var issued atomic.Int64
	halfway := make(chan struct{})
	var halfOnce sync.Once
	type reply struct {
		worker string
		ids    []int64
	}
	results := make([][]reply, clients)
	var wg sync.WaitGroup
	for c := range clients {
		nc := testenv.Connect(t, ns) // here: Connect may call t.Fatal
		wg.Go(func() {
			lastOK := time.Now()
			for n := 0; n < total/clients; {
				msg := &nats.Msg{Subject: "id.snowflake", Data: []byte(strconv.Itoa(batch)), Header: nats.Header{protocol.WorkerHeader: []string{""}}}
				resp, err := nc.RequestMsg(msg, 10*time.Second)
				if err != nil {
					t.Errorf("client %d: %v", c, err)
					return
				}
				switch code := resp.Header.Get(micro.ErrorCodeHeader); code {
				case "":
				case protocol.CodeUnavailable:
					if time.Since(lastOK) > retry503For {
						t.Errorf("client %d: 503 (%s) for %v", c, resp.Header.Get(micro.ErrorHeader), retry503For)
						return
					}
					time.Sleep(10 * time.Millisecond)
					continue
				default:
					t.Errorf("client %d: error %s %q", c, code, resp.Header.Get(micro.ErrorHeader))
					return
				}
				lastOK = time.Now()
				ids, err := decodeIDs(string(resp.Data))
				if err != nil {
					t.Errorf("client %d: %v", c, err)
					return
				}
				if len(ids) != batch {
					t.Errorf("client %d: %d IDs, want %d", c, len(ids), batch)
					return
				}
				results[c] = append(results[c], reply{resp.Header.Get(protocol.WorkerHeader), ids})
				n += batch
				if issued.Add(batch) >= int64(total/2) {
					halfOnce.Do(func() { close(halfway) })
				}
			}
		})
	}
	clientsDone := make(chan struct{})
	go func() { wg.Wait(); close(clientsDone) }()
	// Halfway, worker 0 is replaced, on the test's goroutine (startSnowflake
	// may call t.Fatal), unless the clients ended before.
	select {
	case <-halfway:
		workers[0].stop(t)
		workers[0] = startSnowflake(t, ns, "sf-0")
	case <-clientsDone:
	}
	<-clientsDone
	if t.Failed() {
		t.FailNow()
	}
	select {
	case <-halfway:
	default:
		t.Fatalf("clients ended after %d IDs, before half of %d", issued.Load(), total)
	}
	seen := make(map[int64]bool, total)
	perWorker := map[string]bool{}
	for c, rs := range results {
		last := map[string]int64{}
		for _, r := range rs {
			perWorker[r.worker] = true
			for _, id := range r.ids {
				if seen[id] {
					t.Fatalf("duplicate snowflake ID %d", id)
				}
				seen[id] = true
				if id <= last[r.worker] {
					t.Fatalf("client %d: worker %s issued %d after %d", c, r.worker, id, last[r.worker])
				}
				last[r.worker] = id
			}
		}
	}
	if len(seen) < total {
		t.Fatalf("%d IDs, want %d", len(seen), total)
	}
	if len(perWorker) != 4 {
		t.Errorf("%d worker processes answered, want 4 (three and the replacement)", len(perWorker))
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

// brokenSnowflake fails with an error the service does not know.
type brokenSnowflake struct{}

func (brokenSnowflake) AppendIDs(dst []int64, n int) ([]int64, error) {
	return dst, errors.New("disk on fire at /var/lib/x")
}
func (brokenSnowflake) Unavailable(error) bool { return false }
func (brokenSnowflake) Epoch() time.Time       { return snowflake.DefaultEpoch }
func (brokenSnowflake) Stats() any             { return nil }

func TestUnexpectedErrorIs500(t *testing.T) {
	ns := testenv.NATS(t)
	svc, err := dispenser.New(dispenser.Config{Conn: testenv.Connect(t, ns), Snowflake: brokenSnowflake{}, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { svc.Stop(context.Background()) })
	resp, err := testenv.Connect(t, ns).Request("id.snowflake", nil, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	code, desc := resp.Header.Get(micro.ErrorCodeHeader), resp.Header.Get(micro.ErrorHeader)
	if code != "500" || strings.Contains(desc, "/var/lib") || len(resp.Data) != 0 {
		t.Fatalf("reply %s %q %q: want 500 with a generic description and no body", code, desc, resp.Data)
	}
}
