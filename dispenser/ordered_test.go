package dispenser_test

import (
	"context"
	"fmt"
	"slices"
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nats.go/micro"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/dispenser-dev/dispenser/dispenser"
	"github.com/dispenser-dev/dispenser/ownership"
	"github.com/dispenser-dev/dispenser/segment"
	"github.com/dispenser-dev/dispenser/testenv"
)

// observation is one answered request as a client saw it.
type observation struct {
	sent, received time.Time
	ids            []int64 // sorted
}

// checkLinearizable returns the number of requests B that got an ID not
// above every ID of a request A answered before B was sent: zero means the
// observations are linearizably increasing.
func checkLinearizable(obs []observation) (violations int, example string) {
	byRecv := slices.Clone(obs)
	sort.Slice(byRecv, func(i, j int) bool { return byRecv[i].received.Before(byRecv[j].received) })
	prefixMax := make([]int64, len(byRecv))
	for i, o := range byRecv {
		prefixMax[i] = o.ids[len(o.ids)-1]
		if i > 0 {
			prefixMax[i] = max(prefixMax[i], prefixMax[i-1])
		}
	}
	for _, b := range obs {
		// The requests answered before b was sent: byRecv[:k].
		k := sort.Search(len(byRecv), func(i int) bool { return !byRecv[i].received.Before(b.sent) })
		if k > 0 && prefixMax[k-1] >= b.ids[0] {
			violations++
			if example == "" {
				example = fmt.Sprintf("a request sent at %v got %d, but %d had been answered before", b.sent.Format(time.StampMicro), b.ids[0], prefixMax[k-1])
			}
		}
	}
	return violations, example
}

func TestCheckLinearizable(t *testing.T) {
	t0 := time.Now()
	at := func(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }
	tests := []struct {
		name string
		obs  []observation
		want int
	}{
		{"increasing", []observation{{at(0), at(1), []int64{1, 2}}, {at(2), at(3), []int64{3}}}, 0},
		{"concurrent may interleave", []observation{{at(0), at(5), []int64{5}}, {at(1), at(4), []int64{4}}}, 0},
		{"smaller after an answer", []observation{{at(0), at(1), []int64{5}}, {at(2), at(3), []int64{4}}}, 1},
		{"equal after an answer", []observation{{at(0), at(1), []int64{3, 4}}, {at(2), at(3), []int64{4, 5}}}, 1},
		{"later but not after", []observation{{at(0), at(3), []int64{5}}, {at(2), at(4), []int64{4}}}, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got, _ := checkLinearizable(tt.obs); got != tt.want {
				t.Fatalf("violations = %d, want %d", got, tt.want)
			}
		})
	}
}

// orderedWorker is a worker that also serves ordered tags.
type orderedWorker struct {
	*worker
	owners *ownership.Leases
	reg    *prometheus.Registry
}

func (st *stack) orderedWorker(tb testing.TB, name string) *orderedWorker {
	tb.Helper()
	rec := &recorder{Store: st.store, allocs: map[string][]segment.Allocation{}}
	alloc, err := segment.New(segment.Settings{Store: rec, Logger: quiet, MaxWait: 5 * time.Second, MaxStep: 100})
	if err != nil {
		tb.Fatal(err)
	}
	js, err := jetstream.New(testenv.Connect(tb, st.ns))
	if err != nil {
		tb.Fatal(err)
	}
	subject := "id.owner." + name
	owners, err := ownership.Open(context.Background(), js, ownership.Settings{
		Owner: name, Subject: subject, Lease: 2 * time.Second, Logger: quiet,
		OnAcquire: alloc.Reset, OnLose: alloc.Reset,
	})
	if err != nil {
		tb.Fatal(err)
	}
	reg := prometheus.NewPedanticRegistry()
	svc, err := dispenser.New(dispenser.Config{Conn: testenv.Connect(tb, st.ns), Segments: alloc, Logger: quiet,
		Owners: owners, OwnerSubject: subject, Registerer: reg})
	if err != nil {
		tb.Fatal(err)
	}
	w := &orderedWorker{worker: &worker{rec: rec, alloc: alloc, svc: svc}, owners: owners, reg: reg}
	tb.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		svc.Stop(ctx)
		owners.Close()
		alloc.Close(ctx)
	})
	return w
}

// load sends requests for subject from clients concurrent clients until
// total requests are answered, and returns what each saw.
func load(tb testing.TB, st *stack, subject string, clients, total int) []observation {
	tb.Helper()
	var mu sync.Mutex
	var obs []observation
	var wg sync.WaitGroup
	errs := make(chan error, clients)
	for c := range clients {
		nc := testenv.Connect(tb, st.ns)
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range total / clients {
				n := 1 + (i+c)%4
				sent := time.Now()
				resp, err := nc.Request(subject, []byte(fmt.Sprint(n)), 10*time.Second)
				received := time.Now()
				if err != nil {
					errs <- fmt.Errorf("client %d: %w", c, err)
					return
				}
				if code := resp.Header.Get(micro.ErrorCodeHeader); code != "" {
					errs <- fmt.Errorf("client %d: %s %s", c, code, resp.Header.Get(micro.ErrorHeader))
					return
				}
				ids, err := decodeIDs(string(resp.Data))
				if err != nil || len(ids) != n {
					errs <- fmt.Errorf("client %d: reply %q (%v), want %d IDs", c, resp.Data, err, n)
					return
				}
				slices.Sort(ids)
				mu.Lock()
				obs = append(obs, observation{sent, received, ids})
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		tb.Fatal(err)
	}
	return obs
}

func checkUnique(tb testing.TB, obs []observation) {
	tb.Helper()
	seen := map[int64]bool{}
	for _, o := range obs {
		for _, id := range o.ids {
			if seen[id] {
				tb.Fatalf("ID %d handed out twice", id)
			}
			seen[id] = true
		}
	}
}

// TestOrderedTagIsLinearizable: three workers, concurrent clients, batches:
// an ordered tag's IDs increase linearizably, while a plain tag's, served by
// the same workers, do not (the checker catches that).
func TestOrderedTagIsLinearizable(t *testing.T) {
	st := newStack(t, map[string]int64{"plain": 100})
	if err := st.store.CreateTag(context.Background(), segment.Tag{Name: "seq", Step: 100, MaxID: 1, Ordered: true}); err != nil {
		t.Fatal(err)
	}
	workers := []*orderedWorker{st.orderedWorker(t, "w0"), st.orderedWorker(t, "w1"), st.orderedWorker(t, "w2")}
	const clients, total = 24, 2400

	plain := load(t, st, "id.segment.plain", clients, total)
	checkUnique(t, plain)
	if n, _ := checkLinearizable(plain); n == 0 {
		t.Fatal("the checker found no violation on a plain tag served by three workers; it cannot be trusted")
	}

	ordered := load(t, st, "id.segment.seq", clients, total)
	checkUnique(t, ordered)
	if n, example := checkLinearizable(ordered); n != 0 {
		t.Fatalf("%d of %d requests for the ordered tag broke linearizable increase: %s", n, len(ordered), example)
	}
	owners := 0
	for _, w := range workers {
		if w.owners.Owns("seq") {
			owners++
		}
	}
	if owners != 1 {
		t.Fatalf("%d workers own the ordered tag, want 1", owners)
	}
	var owned, forwarded float64
	for _, w := range workers {
		families, err := w.reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		o, ok1 := metricValue(families, "dispenser_ordered_owned_tags", map[string]string{})
		f, ok2 := metricValue(families, "dispenser_ordered_forwarded_total", map[string]string{})
		if !ok1 || !ok2 {
			t.Fatal("ownership metrics missing")
		}
		owned, forwarded = owned+o, forwarded+f
	}
	if owned != 1 || forwarded == 0 {
		t.Errorf("metrics: %v tags owned, %v requests forwarded over all workers; want 1 and some", owned, forwarded)
	}
}

// TestOrderedTagHandover moves an ordered tag twice under load: its owner
// releases it while it keeps running (it must then forward like any other
// worker, or, if it claims the tag again, serve only segments fetched after
// that), and the next owner stops gracefully. The IDs stay linearizable.
func TestOrderedTagHandover(t *testing.T) {
	st := newStack(t, nil)
	if err := st.store.CreateTag(context.Background(), segment.Tag{Name: "seq", Step: 10, MaxID: 1, Ordered: true}); err != nil {
		t.Fatal(err)
	}
	workers := []*orderedWorker{st.orderedWorker(t, "w0"), st.orderedWorker(t, "w1"), st.orderedWorker(t, "w2")}
	nc := testenv.Connect(t, st.ns)
	owner := func() *orderedWorker {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for time.Now().Before(deadline) {
			if _, code := request(t, nc, "id.segment.seq", "", nil); code == "" {
				for _, w := range workers {
					if w.owners.Owns("seq") {
						return w
					}
				}
			}
			time.Sleep(10 * time.Millisecond)
		}
		t.Fatal("nobody owns the ordered tag")
		return nil
	}
	first := owner()
	done := make(chan []observation)
	go func() { done <- loadNoFatal(st, "id.segment.seq", 8, 1600) }()
	time.Sleep(100 * time.Millisecond)
	first.owners.Release("seq") // first keeps running
	time.Sleep(100 * time.Millisecond)
	second := owner() // any worker, first too: then from fresh segments only
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	second.owners.Close() // a graceful stop: hand over, then drain
	if err := second.svc.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	obs := <-done
	checkUnique(t, obs)
	if n, example := checkLinearizable(obs); n != 0 {
		t.Fatalf("%d of %d requests broke linearizable increase across the handovers: %s", n, len(obs), example)
	}
	if len(obs) < 1400 {
		t.Fatalf("only %d of 1600 requests answered across two graceful handovers", len(obs))
	}
}

// loadNoFatal is load for a goroutine other than the test's: failed
// requests are left out (a handover may fail a few with 503).
func loadNoFatal(st *stack, subject string, clients, total int) []observation {
	var mu sync.Mutex
	var obs []observation
	var wg sync.WaitGroup
	for range clients {
		nc, err := nats.Connect(st.ns.ClientURL())
		if err != nil {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer nc.Close()
			for range total / clients {
				sent := time.Now()
				resp, err := nc.Request(subject, []byte("2"), 10*time.Second)
				received := time.Now()
				if err != nil || resp.Header.Get(micro.ErrorCodeHeader) != "" {
					continue
				}
				ids, err := decodeIDs(string(resp.Data))
				if err != nil || len(ids) != 2 {
					continue
				}
				mu.Lock()
				obs = append(obs, observation{sent, received, ids})
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	return obs
}
