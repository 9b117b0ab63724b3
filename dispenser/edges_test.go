package dispenser_test

import (
	"context"
	"math"
	"strconv"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/dispenser-dev/dispenser/dispenser"
	"github.com/dispenser-dev/dispenser/protocol"
	"github.com/dispenser-dev/dispenser/segment"
	"github.com/dispenser-dev/dispenser/snowflake"
	"github.com/dispenser-dev/dispenser/tagmodel"
	"github.com/dispenser-dev/dispenser/testenv"
)

// TestExhaustedTagIs410 spends a PostgreSQL tag that ends at 2^63-1, one ID
// at a time with the default list format: every ID is handed out once and
// lies below 2^63-1, the spent tag answers 410 (final, not 503) in every
// format, and the worker goes on serving other tags.
func TestExhaustedTagIs410(t *testing.T) {
	const start = 9223372036854775000
	st := newStack(t, map[string]int64{"other": 10})
	if err := st.store.CreateTag(context.Background(), tagmodel.Tag{Name: "edge", Step: 100, MaxID: start}); err != nil {
		t.Fatal(err)
	}
	st.worker(t, segment.Settings{})
	nc := testenv.Connect(t, st.ns)
	seen := map[int64]bool{}
	var code, body string
	for range 2000 {
		body, code = request(t, nc, "id.segment.edge", "", nil)
		if code != "" {
			break
		}
		id, err := strconv.ParseInt(body, 10, 64)
		if err != nil {
			t.Fatalf("reply %q: %v", body, err)
		}
		if id < start || id == math.MaxInt64 || seen[id] {
			t.Fatalf("ID %d: outside [%d, 2^63-1) or handed out twice", id, int64(start))
		}
		seen[id] = true
	}
	if code != protocol.CodeGone {
		t.Fatalf("after %d IDs: code %q (%q), want 410", len(seen), code, body)
	}
	// 807 IDs are left below 2^63-1: eight whole segments of step 100.
	if len(seen) != 800 {
		t.Errorf("IDs handed out = %d, want 800", len(seen))
	}
	for _, tt := range []struct {
		name, body string
		hdr        nats.Header
	}{
		{"one", "", nil},
		{"batch", "5", nil},
		{"range", "3", nats.Header{protocol.FormatHeader: []string{"range"}}},
	} {
		if body, code := request(t, nc, "id.segment.edge", tt.body, tt.hdr); code != protocol.CodeGone {
			t.Errorf("%s: code %q (%q), want 410", tt.name, code, body)
		}
	}
	if body, code := request(t, nc, "id.segment.other", "3", nil); code != "" || body != "1\n2\n3" {
		t.Errorf("other tag: %q (code %q), want 1..3", body, code)
	}
}

// TestAppendListAtMaxInt64: a run that ends at 2^63-1 is formatted once
// and the formatting ends.
func TestAppendListAtMaxInt64(t *testing.T) {
	got := string(protocol.AppendList(nil, []segment.Run{{First: math.MaxInt64 - 2, Last: math.MaxInt64}}))
	want := "9223372036854775805\n9223372036854775806\n9223372036854775807"
	if got != want {
		t.Fatalf("got %q, want %q", got, want)
	}
	if got := string(protocol.AppendList(nil, []segment.Run{{First: 5, Last: 4}})); got != "" {
		t.Fatalf("empty run: got %q, want nothing", got)
	}
}

// TestSnowflakeBatchAboveGeneratorLimitIs400: with the server's max payload
// raised and MaxBatch above snowflake.MaxCount, a batch the generator
// cannot issue is the requester's mistake: 400, not 500.
func TestSnowflakeBatchAboveGeneratorLimitIs400(t *testing.T) {
	opts := testenv.NATSOptions(t.TempDir())
	opts.MaxPayload = 8 << 20
	ns := testenv.StartNATS(t, opts)
	t.Cleanup(func() { ns.Shutdown(); ns.WaitForShutdown() })
	js, err := jetstream.New(testenv.Connect(t, ns))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	w, err := snowflake.Start(ctx, js, snowflake.NodeSettings{Settings: snowflake.Settings{Logger: quiet}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { w.Close(context.Background()) })
	svc, err := dispenser.New(dispenser.Config{Conn: testenv.Connect(t, ns), Snowflake: w, MaxBatch: 200000, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { svc.Stop(context.Background()) })
	nc := testenv.Connect(t, ns)
	if body, code := request(t, nc, "id.snowflake", strconv.Itoa(snowflake.MaxCount+1), nil); code != protocol.CodeBadRequest {
		t.Fatalf("batch of MaxCount+1: code %q (%.80q), want 400", code, body)
	}
	body, code := request(t, nc, "id.snowflake", strconv.Itoa(snowflake.MaxCount), nil)
	if code != "" {
		t.Fatalf("batch of MaxCount: code %q (%q), want IDs", code, body)
	}
	if ids := parseIDs(t, body); len(ids) != snowflake.MaxCount {
		t.Fatalf("batch of MaxCount: %d IDs, want %d", len(ids), snowflake.MaxCount)
	}
}

// TestFullBatchFits: on a server with a small max payload, the largest
// MaxBatch New accepts leaves room for the reply's headers, so a full batch
// of 19-digit IDs with the Id-Worker header arrives whole; one ID more is
// refused at start; and a batch whose reply in runs might not fit is
// refused with 400 before it takes an ID.
func TestFullBatchFits(t *testing.T) {
	const maxPayload = 20000
	opts := testenv.NATSOptions(t.TempDir())
	opts.MaxPayload = maxPayload
	ns := testenv.StartNATS(t, opts)
	t.Cleanup(ns.Shutdown)
	st := newStack(t, nil)
	const start = 1_000_000_000_000_000_000 // 19 digits
	if err := st.store.CreateTag(context.Background(), tagmodel.Tag{Name: "wide", Step: 100000, MaxID: start}); err != nil {
		t.Fatal(err)
	}
	alloc, err := segment.New(segment.Settings{Store: st.store, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = alloc.Close(context.Background()) })
	nc := testenv.Connect(t, ns)
	limit := (maxPayload - 1024) / 20
	if _, err := dispenser.New(dispenser.Config{Conn: nc, Segments: alloc, Logger: quiet, MaxBatch: maxPayload / 20}); err == nil {
		t.Fatalf("New accepted MaxBatch %d: a full list of 19-digit IDs leaves no room for headers", maxPayload/20)
	}
	svc, err := dispenser.New(dispenser.Config{Conn: nc, Segments: alloc, Logger: quiet, MaxBatch: limit})
	if err != nil {
		t.Fatalf("New with MaxBatch %d: %v", limit, err)
	}
	t.Cleanup(func() { _ = svc.Stop(context.Background()) })
	app := testenv.Connect(t, ns)
	body, code := request(t, app, "id.segment.wide", strconv.Itoa(limit), nats.Header{protocol.WorkerHeader: []string{"1"}})
	if code != "" {
		t.Fatalf("a full batch: code %q", code)
	}
	ids := parseIDs(t, body)
	if len(ids) != limit || ids[0] != start || ids[len(ids)-1] != start+int64(limit)-1 {
		t.Fatalf("a full batch: %d IDs from %d, want %d from %d", len(ids), ids[0], limit, int64(start))
	}
	// In runs a reply may take 40 bytes an ID: refused, nothing taken.
	if body, code := request(t, app, "id.segment.wide", strconv.Itoa(limit), nats.Header{protocol.FormatHeader: []string{"range"}}); code != protocol.CodeBadRequest {
		t.Fatalf("a full batch in runs: %q code %q, want 400", body, code)
	}
	if body, code := request(t, app, "id.segment.wide", "", nil); code != "" || body != strconv.FormatInt(start+int64(limit), 10) {
		t.Fatalf("next ID: %q code %q, want %d: the refused batch took IDs", body, code, start+int64(limit))
	}
}
