package dispenser_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dispenser-dev/dispenser/protocol"
	"github.com/dispenser-dev/dispenser/tagmodel"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"

	"github.com/dispenser-dev/dispenser/dispenser"
	"github.com/dispenser-dev/dispenser/segment"
	"github.com/dispenser-dev/dispenser/snowflake"
	"github.com/dispenser-dev/dispenser/testenv"
)

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
	tagmodel.Store
	down atomic.Bool
}

var errDown = errors.New("store unreachable")

func (d *downStore) Tags(ctx context.Context) ([]string, error) {
	if d.down.Load() {
		return nil, errDown
	}
	return d.Store.Tags(ctx)
}

func (d *downStore) Tag(ctx context.Context, name string) (tagmodel.Tag, error) {
	if d.down.Load() {
		return tagmodel.Tag{}, errDown
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
type failingFetch struct{ tagmodel.Store }

func (f *failingFetch) Fetch(context.Context, string, int64) (tagmodel.Allocation, error) {
	return tagmodel.Allocation{}, errors.New("dial tcp 10.0.0.7:5432: connection refused")
}

// brokenSnowflake fails with an error the service does not know.
type brokenSnowflake struct{}

func (brokenSnowflake) AppendIDs(dst []int64, n int) ([]int64, error) {
	return dst, errors.New("disk on fire at /var/lib/x")
}
func (brokenSnowflake) Unavailable(error) bool   { return false }
func (brokenSnowflake) Epoch() time.Time         { return snowflake.DefaultEpoch }
func (brokenSnowflake) Layout() snowflake.Layout { return snowflake.DefaultLayout }
func (brokenSnowflake) Stats() any               { return nil }

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
