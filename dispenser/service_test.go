package dispenser_test

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"
	dto "github.com/prometheus/client_model/go"

	"github.com/dispenser-dev/dispenser/dispenser"
	"github.com/dispenser-dev/dispenser/internal/tests/testdb"
	"github.com/dispenser-dev/dispenser/segment"
	"github.com/dispenser-dev/dispenser/segment/postgres"
	"github.com/dispenser-dev/dispenser/tagmodel"
	"github.com/dispenser-dev/dispenser/testenv"
)

func TestMain(m *testing.M) { os.Exit(testenv.Run(m)) }

var quiet = slog.New(slog.DiscardHandler)

// stack is one NATS server and one migrated PostgreSQL database.
type stack struct {
	ns    *server.Server
	pool  *pgxpool.Pool
	store *postgres.Store
	// other, if set, is the store of the stack's workers instead of store.
	other tagmodel.Store
}

func newStack(tb testing.TB, tags map[string]int64) *stack {
	tb.Helper()
	db := testdb.New(tb, tags)
	return &stack{ns: testenv.NATS(tb), pool: db.Pool, store: db.Store}
}

// recorder wraps the real store and remembers the segments one worker got.
type recorder struct {
	tagmodel.Store
	mu     sync.Mutex // protects allocs
	allocs map[string][]tagmodel.Allocation
}

func (r *recorder) Fetch(ctx context.Context, tag string, step int64) (tagmodel.Allocation, error) {
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
	var store tagmodel.Store = st.store
	if st.other != nil {
		store = st.other
	}
	rec := &recorder{Store: store, allocs: map[string][]tagmodel.Allocation{}}
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
