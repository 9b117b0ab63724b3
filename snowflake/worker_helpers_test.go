package snowflake

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/dispenser-dev/dispenser/testenv"
)

// Short leases keep the tests fast; no test asserts how long anything took.
const (
	testLease     = 300 * time.Millisecond
	testHeartbeat = 20 * time.Millisecond
)

// newJetStream starts an embedded nats-server and returns a JetStream
// context on it.
func newJetStream(tb testing.TB) jetstream.JetStream {
	tb.Helper()
	nc := testenv.Connect(tb, testenv.NATS(tb))
	js, err := jetstream.New(nc)
	if err != nil {
		tb.Fatalf("jetstream: %v", err)
	}
	return js
}

// fakeSettings returns worker settings on clock c with short leases.
func fakeSettings(tb testing.TB, c *fakeClock, instance string) NodeSettings {
	tb.Helper()
	return NodeSettings{
		Instance:  instance,
		Lease:     testLease,
		Heartbeat: testHeartbeat,
		Settings: Settings{
			Now:    c.Now,
			Logger: testLogger(tb).With("test_instance", instance),
			mono:   c.Mono,
			sleep:  c.Sleep,
		},
	}
}

// startWorker starts a worker and closes it in Cleanup.
func startWorker(tb testing.TB, js jetstream.JetStream, s NodeSettings) *Node {
	tb.Helper()
	w, err := tryStartWorker(tb, js, s)
	if err != nil {
		tb.Fatalf("Start(%q): %v", s.Instance, err)
	}
	return w
}

// tryStartWorker starts a worker; if it succeeds, Cleanup closes it.
func tryStartWorker(tb testing.TB, js jetstream.JetStream, s NodeSettings) (*Node, error) {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	w, err := Start(ctx, js, s)
	if err != nil {
		return nil, err
	}
	tb.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := w.Close(ctx); err != nil {
			tb.Errorf("Close(%q): %v", s.Instance, err)
		}
	})
	return w, nil
}

// crash stops w as kill -9 would: no more heartbeats, no release.
func crash(tb testing.TB, w *Node) {
	tb.Helper()
	w.closeOnce.Do(func() {
		w.cancel()
		<-w.done
		w.gen.revoke(ErrClosed)
		w.mu.Lock()
		w.closed = true
		w.mu.Unlock()
	})
}

func workerID(tb testing.TB, w *Node) int {
	tb.Helper()
	id, ok := w.WorkerID()
	if !ok {
		tb.Fatalf("worker %q holds no worker ID", w.Instance())
	}
	return id
}

// issue takes n IDs from w and fails the test on error.
func issue(tb testing.TB, w *Node, n int) []int64 {
	tb.Helper()
	ids, err := w.AppendIDs(nil, n)
	if err != nil {
		tb.Fatalf("AppendIDs(%q): %v", w.Instance(), err)
	}
	return ids
}

func openKV(tb testing.TB, js jetstream.JetStream) jetstream.KeyValue {
	tb.Helper()
	kv, err := js.KeyValue(context.Background(), DefaultBucket)
	if err != nil {
		tb.Fatalf("open bucket: %v", err)
	}
	return kv
}

func readLease(tb testing.TB, kv jetstream.KeyValue, id int) (leaseRecord, uint64) {
	tb.Helper()
	e, err := kv.Get(context.Background(), workerKey(id))
	if err != nil {
		tb.Fatalf("read lease %d: %v", id, err)
	}
	var r leaseRecord
	if err := json.Unmarshal(e.Value(), &r); err != nil {
		tb.Fatalf("decode lease %d %s: %v", id, e.Value(), err)
	}
	return r, e.Revision()
}

// fillOthers writes live leases held by "squatter" for every worker ID but
// the given ones, as if 1024 workers ran.
func fillOthers(tb testing.TB, kv jetstream.KeyValue, now time.Time, except ...int) {
	tb.Helper()
	ctx := context.Background()
	for id := range MaxWorkerID + 1 {
		if contains(except, id) {
			continue
		}
		data, err := json.Marshal(squatter(id, now))
		if err != nil {
			tb.Fatal(err)
		}
		if _, err := kv.Create(ctx, workerKey(id), data); err != nil {
			tb.Fatalf("fill worker ID %d: %v", id, err)
		}
	}
}

func squatter(id int, now time.Time) leaseRecord {
	return leaseRecord{
		Version: recordVersion, Worker: id, Instance: "squatter", Session: "squatter",
		Epoch: DefaultEpoch, LeaseMS: time.Hour.Milliseconds(),
		Heartbeat: now, Expires: now.Add(time.Hour), Bound: now.Add(time.Hour),
	}
}

func contains(ids []int, id int) bool {
	for _, x := range ids {
		if x == id {
			return true
		}
	}
	return false
}

// release marks a squatter's lease released, as its graceful shutdown would.
func release(tb testing.TB, kv jetstream.KeyValue, id int) {
	tb.Helper()
	r, rev := readLease(tb, kv, id)
	r.Released = true
	r.Bound = r.Heartbeat
	data, _ := json.Marshal(r)
	if _, err := kv.Update(context.Background(), workerKey(id), data, rev); err != nil {
		tb.Fatalf("release %d: %v", id, err)
	}
}

func timestampOf(id int64) int64 { return Decode(id, time.Time{}).Timestamp }

func maxTimestamp(ids []int64) int64 {
	m := int64(-1)
	for _, id := range ids {
		m = max(m, timestampOf(id))
	}
	return m
}

// service is the interface the dispenser service expects of a Node.
type service interface {
	AppendIDs(dst []int64, n int) ([]int64, error)
	Unavailable(err error) bool
	Decode(id int64) any
	Stats() any
}

var _ service = (*Node)(nil)
