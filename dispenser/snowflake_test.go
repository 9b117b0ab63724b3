package dispenser_test

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dispenser-dev/dispenser/protocol"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nats.go/micro"

	"github.com/dispenser-dev/dispenser/dispenser"
	"github.com/dispenser-dev/dispenser/snowflake"
	"github.com/dispenser-dev/dispenser/testenv"
)

func TestSnowflakeEndpoints(t *testing.T) {
	ns := testenv.NATS(t)
	js, err := jetstream.New(testenv.Connect(t, ns))
	if err != nil {
		t.Fatal(err)
	}
	w, err := snowflake.Start(context.Background(), js, snowflake.NodeSettings{Instance: "w1", Settings: snowflake.Settings{Logger: quiet}})
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
	// Snowflake IDs have no format.
	if body, code := request(t, nc, "id.snowflake", "", nats.Header{protocol.FormatHeader: []string{"formatted"}}); code != "400" {
		t.Errorf("Id-Format: formatted: %q code %q, want 400", body, code)
	}
	// A closed worker (lease released) never answers an ID: it hands the
	// request on (answering 503 when nobody else can serve it) and leaves
	// the queue group (no responders).
	if err := w.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	resp, err := nc.Request("id.snowflake", nil, 10*time.Second)
	if code := ""; err == nil {
		code = resp.Header.Get(micro.ErrorCodeHeader)
		if code != "503" {
			t.Fatalf("after Close: %q code %q, want 503", resp.Data, code)
		}
	} else if !errors.Is(err, nats.ErrNoResponders) {
		t.Fatalf("after Close: %v; want 503 or no responders", err)
	}
}

// sfWorker is one snowflake worker process stand-in: a leased worker ID and
// a service on their own connections.
type sfWorker struct {
	w   *snowflake.Node
	svc *dispenser.Service
}

func startSnowflake(tb testing.TB, ns *server.Server, instance string) *sfWorker {
	tb.Helper()
	js, err := jetstream.New(testenv.Connect(tb, ns))
	if err != nil {
		tb.Fatal(err)
	}
	w, err := snowflake.Start(context.Background(), js, snowflake.NodeSettings{Instance: instance, Settings: snowflake.Settings{Logger: quiet}})
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
