package dispenser_test

import (
	"context"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/dispenser-dev/dispenser/protocol"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"

	"github.com/dispenser-dev/dispenser/internal/tests/check"
	"github.com/dispenser-dev/dispenser/segment"
	"github.com/dispenser-dev/dispenser/testenv"
)

func TestProtocol(t *testing.T) {
	st := newStack(t, map[string]int64{"orders": 100})
	// A generous wait: the unknown tag's lookup in the store took longer
	// than the default 100 ms on a busy machine, and answered 503.
	st.worker(t, segment.Settings{MaxWait: 10 * time.Second})
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
		// MaxDepth 1: one step per fetch, a switch every 100 IDs, however
		// much the clients wait (the multi-step fetch would take fewer).
		st.worker(t, segment.Settings{MaxStep: 100, MaxDepth: 1, MaxWait: 5 * time.Second}),
		st.worker(t, segment.Settings{MaxStep: 100, MaxDepth: 1, MaxWait: 5 * time.Second}),
		st.worker(t, segment.Settings{MaxStep: 100, MaxDepth: 1, MaxWait: 5 * time.Second}),
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
		var inc check.Increasing
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
			if prev, ok := inc.Next(owner, id); !ok {
				t.Fatalf("tag %s: worker %d issued %d after %d", r.tag, owner, id, prev)
			}
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
