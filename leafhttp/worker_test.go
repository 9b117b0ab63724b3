package leafhttp_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nats.go/micro"

	"github.com/dispenser-dev/dispenser/internal/tests/testdb"
	"github.com/dispenser-dev/dispenser/leafhttp"
	"github.com/dispenser-dev/dispenser/segment"
	"github.com/dispenser-dev/dispenser/segment/kv"
	"github.com/dispenser-dev/dispenser/snowflake"
	"github.com/dispenser-dev/dispenser/tagmodel"
	"github.com/dispenser-dev/dispenser/testenv"
	"github.com/dispenser-dev/dispenser/worker"
	"github.com/dispenser-dev/dispenser/worker/pgstore"
)

func TestMain(m *testing.M) { os.Exit(testenv.Run(m)) }

// store is a segment store the tests run workers on: its opener for the
// workers and its Admin for the test's tags.
type store struct {
	name   string
	opener func(tb testing.TB, ns *server.Server) (worker.StoreOpener, tagmodel.Admin, tagmodel.Store)
}

// stores are the two segment stores: the JetStream KV bucket and
// PostgreSQL (a real server from testenv).
var stores = []store{
	{"kv", func(tb testing.TB, ns *server.Server) (worker.StoreOpener, tagmodel.Admin, tagmodel.Store) {
		tb.Helper()
		js, err := jetstream.New(testenv.Connect(tb, ns))
		if err != nil {
			tb.Fatal(err)
		}
		st, err := kv.New(context.Background(), js, kv.Settings{})
		if err != nil {
			tb.Fatal(err)
		}
		return worker.KV{}, st, st
	}},
	{"postgres", func(tb testing.TB, _ *server.Server) (worker.StoreOpener, tagmodel.Admin, tagmodel.Store) {
		tb.Helper()
		db := testdb.New(tb, nil)
		return pgstore.Postgres{URL: db.URL}, db.Store, db.Store
	}},
}

// cluster is an embedded nats-server with a store and its tags, on which
// a test starts workers.
type cluster struct {
	ns     *server.Server
	nc     *nats.Conn // the test's requests
	opener worker.StoreOpener
	admin  tagmodel.Admin
	rows   tagmodel.Store
}

func newCluster(tb testing.TB, st store, tags ...tagmodel.Tag) *cluster {
	tb.Helper()
	ns := testenv.NATS(tb)
	c := &cluster{ns: ns, nc: testenv.Connect(tb, ns)}
	c.opener, c.admin, c.rows = st.opener(tb, ns)
	for _, t := range tags {
		if t.MaxID == 0 {
			t.MaxID = 1
		}
		if err := c.admin.CreateTag(context.Background(), t); err != nil {
			tb.Fatal(err)
		}
	}
	return c
}

// start starts a worker with Leaf's HTTP API and returns its base URL.
func (c *cluster) start(tb testing.TB, name string) (*worker.Worker, string) {
	tb.Helper()
	logs := &testenv.LogBuffer{}
	w, err := worker.New(context.Background(), worker.Config{NATS: worker.NATS{URL: c.ns.ClientURL()}, Instance: name,
		Store: c.opener, Logger: logs.Logger(), HTTPAddr: "127.0.0.1:0", Owners: worker.Owners{Lease: time.Second},
		// The tests check what is handed out, not how fast: a request
		// waits for its segment (the default 100 ms got a 503 on a
		// machine at a load of 20, step 50 on PostgreSQL).
		Segment: segment.Settings{MaxWait: 5 * time.Second}})
	if err != nil {
		tb.Fatalf("worker %s: %v", name, err)
	}
	tb.Cleanup(func() {
		if err := w.Close(); err != nil {
			tb.Errorf("closing worker %s: %v", name, err)
		}
		if tb.Failed() {
			tb.Logf("worker %s's log:\n%s", name, logs)
		}
	})
	return w, "http://" + w.LeafAddr()
}

// get sends an HTTP request and returns its status, body and header.
func get(tb testing.TB, method, url string, header ...string) (int, string, http.Header) {
	tb.Helper()
	status, body, h, err := tryGet(method, url, header...)
	if err != nil {
		tb.Fatal(err)
	}
	return status, body, h
}

// tryGet is get for goroutines other than the test's.
func tryGet(method, url string, header ...string) (int, string, http.Header, error) {
	req, err := http.NewRequest(method, url, nil)
	if err != nil {
		return 0, "", nil, err
	}
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, "", nil, fmt.Errorf("%s %s: %w", method, url, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return 0, "", nil, fmt.Errorf("%s %s: reading the body: %w", method, url, err)
	}
	return resp.StatusCode, string(b), resp.Header, nil
}

// ids parses a body of IDs, one per line.
func ids(tb testing.TB, body string) []int64 {
	tb.Helper()
	out, err := parseIDs(body)
	if err != nil {
		tb.Fatal(err)
	}
	return out
}

func parseIDs(body string) ([]int64, error) {
	var out []int64
	for line := range strings.SplitSeq(body, "\n") {
		id, err := strconv.ParseInt(line, 10, 64)
		if err != nil {
			return nil, fmt.Errorf("body %q: %w", body, err)
		}
		out = append(out, id)
	}
	return out, nil
}

// httpIDs asks url for IDs over HTTP.
func httpIDs(url string) ([]int64, error) {
	status, body, _, err := tryGet(http.MethodGet, url)
	if err != nil {
		return nil, err
	}
	if status != http.StatusOK {
		return nil, fmt.Errorf("GET %s: %d %s", url, status, body)
	}
	return parseIDs(body)
}

// natsIDs asks subject for n IDs over NATS.
func natsIDs(tb testing.TB, nc *nats.Conn, subject string, n int) []int64 {
	tb.Helper()
	out, err := tryNATSIDs(nc, subject, n)
	if err != nil {
		tb.Fatal(err)
	}
	return out
}

func tryNATSIDs(nc *nats.Conn, subject string, n int) ([]int64, error) {
	body := []byte(nil)
	if n > 1 {
		body = []byte(strconv.Itoa(n))
	}
	resp, err := nc.Request(subject, body, 10*time.Second)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", subject, err)
	}
	if code := resp.Header.Get(micro.ErrorCodeHeader); code != "" {
		return nil, fmt.Errorf("%s: %s %s", subject, code, resp.Header.Get(micro.ErrorHeader))
	}
	return parseIDs(string(resp.Data))
}

// TestLeafClient: a client that knows only Leaf's paths gets IDs from a
// worker on either store: a bare decimal for /api/segment/get/{key} with
// any method Leaf maps, the next IDs of the tag on each call, a snowflake
// ID for /api/snowflake/get/{key} whatever the key, and its fields from
// /decodeSnowflakeId in Leaf's JSON.
func TestLeafClient(t *testing.T) {
	for _, st := range stores {
		t.Run(st.name, func(t *testing.T) {
			c := newCluster(t, st, tagmodel.Tag{Name: "orders", Step: 1000, MaxID: 100})
			w, base := c.start(t, "leaf-client")
			var got []int64
			for _, method := range []string{http.MethodGet, http.MethodPost, http.MethodGet} {
				status, body, h := get(t, method, base+"/api/segment/get/orders")
				if status != http.StatusOK || strings.ContainsAny(body, " \n") {
					t.Fatalf("%s /api/segment/get/orders: %d %q, want 200 and a bare decimal", method, status, body)
				}
				if cc := h.Get("Cache-Control"); cc != "no-store" {
					t.Errorf("Cache-Control %q, want no-store", cc)
				}
				got = append(got, ids(t, body)...)
			}
			if want := []int64{100, 101, 102}; !slices.Equal(got, want) {
				t.Errorf("IDs %v, want %v", got, want)
			}
			status, body, _ := get(t, http.MethodGet, base+"/api/segment/get/orders?count=3")
			if batch := ids(t, body); status != http.StatusOK || !slices.Equal(batch, []int64{103, 104, 105}) {
				t.Errorf("count=3: %d %q, want 103 104 105 one per line", status, body)
			}
			status, body, _ = get(t, http.MethodGet, base+"/api/segment/get/orders?count=3&format=range")
			if status != http.StatusOK || body != "106-108" {
				t.Errorf("count=3&format=range: %d %q, want 106-108", status, body)
			}

			for _, key := range []string{"anything", "<b>", "a.b"} {
				status, body, _ := get(t, http.MethodGet, base+"/api/snowflake/get/"+url.PathEscape(key))
				if status != http.StatusOK {
					t.Fatalf("/api/snowflake/get/%s: %d %q", key, status, body)
				}
				id := ids(t, body)[0]
				status, body, _ = get(t, http.MethodGet, fmt.Sprintf("%s/decodeSnowflakeId?snowflakeId=%d", base, id))
				var d map[string]string
				if err := json.Unmarshal([]byte(body), &d); err != nil || status != http.StatusOK {
					t.Fatalf("decode %d: %d %q %v", id, status, body, err)
				}
				p := snowflake.Decode(id, snowflake.DefaultEpoch)
				want := map[string]string{
					"timestamp":  fmt.Sprintf("%d(%s)", p.Time.UnixMilli(), p.Time.Local().Format("2006-01-02 15:04:05.000")),
					"sequenceId": strconv.FormatInt(p.Sequence, 10),
					"workerId":   strconv.FormatInt(p.Worker, 10),
				}
				if fmt.Sprint(d) != fmt.Sprint(want) {
					t.Errorf("decode %d: %v, want %v", id, d, want)
				}
				if since := time.Since(p.Time); since < 0 || since > time.Minute {
					t.Errorf("snowflake ID %d's time %v is not now", id, p.Time)
				}
			}
			_ = w
		})
	}
}

// TestIDsOverHTTPAndNATSUnique: two workers, each asked over HTTP and over
// NATS at once, segment and snowflake: every ID is handed out once.
func TestIDsOverHTTPAndNATSUnique(t *testing.T) {
	for _, st := range stores {
		t.Run(st.name, func(t *testing.T) {
			// A small step: the workers fetch many segments meanwhile.
			c := newCluster(t, st, tagmodel.Tag{Name: "orders", Step: 50})
			var bases []string
			for i := range 2 {
				_, base := c.start(t, fmt.Sprintf("unique-%d", i))
				bases = append(bases, base)
			}
			const rounds = 60
			var mu sync.Mutex
			seen := map[string][]int64{}
			add := func(kind string, got []int64) {
				mu.Lock()
				seen[kind] = append(seen[kind], got...)
				mu.Unlock()
			}
			var wg sync.WaitGroup
			for g := range 8 {
				wg.Go(func() {
					base := bases[g%2]
					for i := range rounds {
						n := 1 + i%5
						var seg, sf []int64
						var err1, err2 error
						if g%4 < 2 { // HTTP
							seg, err1 = httpIDs(fmt.Sprintf("%s/api/segment/get/orders?count=%d", base, n))
							sf, err2 = httpIDs(fmt.Sprintf("%s/api/snowflake/get/x?count=%d", base, n))
						} else {
							seg, err1 = tryNATSIDs(c.nc, "id.segment.orders", n)
							sf, err2 = tryNATSIDs(c.nc, "id.snowflake", n)
						}
						if err := errors.Join(err1, err2); err != nil {
							t.Error(err)
							return
						}
						add("segment", seg)
						add("snowflake", sf)
					}
				})
			}
			wg.Wait()
			for kind, got := range seen {
				// 4 goroutines over each path, 60 rounds of 1..5 IDs: 3 each on average.
				if want := 8 * rounds * 3; len(got) != want {
					t.Errorf("%s: %d IDs, want %d", kind, len(got), want)
				}
				slices.Sort(got)
				for i := 1; i < len(got); i++ {
					if got[i] == got[i-1] {
						t.Fatalf("%s ID %d handed out twice", kind, got[i])
					}
				}
			}
		})
	}
}

// TestOrderedTagOverHTTP: an ordered tag's IDs asked one after the other
// over the HTTP API of two workers and over NATS strictly increase: the
// HTTP path keeps the tag's promise, whichever worker owns it.
func TestOrderedTagOverHTTP(t *testing.T) {
	c := newCluster(t, stores[0], tagmodel.Tag{Name: "ledger", Step: 100, Ordered: true})
	var bases []string
	for i := range 2 {
		_, base := c.start(t, fmt.Sprintf("ordered-%d", i))
		bases = append(bases, base)
	}
	var last int64
	for i := range 60 {
		var got []int64
		switch i % 3 {
		case 0, 1:
			status, body, _ := get(t, http.MethodGet, fmt.Sprintf("%s/api/segment/get/ledger?count=%d", bases[i%3], 1+i%4))
			if status != http.StatusOK {
				t.Fatalf("request %d over HTTP of worker %d: %d %s", i, i%3, status, body)
			}
			got = ids(t, body)
		case 2:
			got = natsIDs(t, c.nc, "id.segment.ledger", 1+i%4)
		}
		for _, id := range got {
			if id <= last {
				t.Fatalf("request %d: ID %d after %d: not increasing", i, id, last)
			}
			last = id
		}
	}
	// format=formatted has no meaning for an ordered tag, as over NATS.
	status, body, _ := get(t, http.MethodGet, bases[0]+"/api/segment/get/ledger?format=formatted")
	if status != http.StatusBadRequest || !strings.Contains(body, "ordered tags have no formatted numbers") {
		t.Errorf("format=formatted of an ordered tag: %d %s, want 400", status, body)
	}
}

// TestFormattedOverHTTP: format=formatted writes a tag's numbers in its
// format, as Id-Format: formatted does over NATS; without it the same tag
// answers plain numbers, continuing one sequence.
func TestFormattedOverHTTP(t *testing.T) {
	c := newCluster(t, stores[0], tagmodel.Tag{Name: "invoice", Step: 100, Reset: tagmodel.ResetDay, Format: "INV-{date:20060102}-{seq:6}"})
	_, base := c.start(t, "formatted")
	before := time.Now().UTC().Format("20060102")
	status, body, _ := get(t, http.MethodGet, base+"/api/segment/get/invoice?format=formatted&count=2")
	after := time.Now().UTC().Format("20060102") // the day may change meanwhile
	want := func(day string) string { return "INV-" + day + "-000001\nINV-" + day + "-000002" }
	if status != http.StatusOK || body != want(before) && body != want(after) {
		t.Errorf("formatted: %d %q, want %q", status, body, want(before))
	}
	status, body, _ = get(t, http.MethodGet, base+"/api/segment/get/invoice")
	if status != http.StatusOK || body != "3" {
		t.Errorf("plain: %d %q, want 3", status, body)
	}
}

// leafError reads the body of a failed ID request.
func leafError(tb testing.TB, body string) leafhttp.Error {
	tb.Helper()
	var e leafhttp.Error
	if err := json.Unmarshal([]byte(body), &e); err != nil {
		tb.Fatalf("error body %q is not JSON: %v", body, err)
	}
	return e
}

// TestHostileRequests: requests a client controls badly get a clear
// error, in Leaf's shape where Leaf has one, and take no ID: the tag's
// next ID afterwards is the one before them.
func TestHostileRequests(t *testing.T) {
	c := newCluster(t, stores[0], tagmodel.Tag{Name: "orders", Step: 1000})
	_, base := c.start(t, "hostile")
	long := strings.Repeat("a", 129)
	for _, tt := range []struct {
		name, method, path string
		status, code       int    // code: Leaf's, in the error body; 0: not an error body
		desc               string // in the description (or the body)
	}{
		{"dotted key", "GET", "/api/segment/get/orders.x", 400, -2, `invalid tag "orders.x"`},
		{"key with a slash", "GET", "/api/segment/get/orders/x", 400, -2, `invalid tag "orders/x"`},
		{"empty key", "GET", "/api/segment/get/", 400, -2, `invalid tag ""`},
		{"key too long", "GET", "/api/segment/get/" + long, 400, -2, "invalid tag"},
		{"markup key", "GET", "/api/segment/get/%3Cscript%3Ealert(1)%3C%2Fscript%3E", 400, -2, `invalid tag "<script>alert(1)</script>"`},
		{"NUL in key", "GET", "/api/segment/get/a%00b", 400, -2, `invalid tag "a\x00b"`},
		{"unknown key", "GET", "/api/segment/get/nope", 404, -2, "unknown tag"},
		{"count 0", "GET", "/api/segment/get/orders?count=0", 400, -2, "bad count 0"},
		{"count negative", "GET", "/api/segment/get/orders?count=-1", 400, -2, "bad count"},
		{"count above max batch", "GET", "/api/segment/get/orders?count=10001", 400, -2, "want 1..10000"},
		{"count huge", "GET", "/api/segment/get/orders?count=99999999999999999999", 400, -2, "bad count"},
		{"count not a number", "GET", "/api/segment/get/orders?count=ten", 400, -2, "bad count"},
		{"count twice", "GET", "/api/segment/get/orders?count=1&count=2", 400, -2, "count given 2 times"},
		{"bad format", "GET", "/api/segment/get/orders?format=xml", 400, -2, "want list, range or formatted"},
		{"formatted without a format", "GET", "/api/segment/get/orders?format=formatted", 400, -2, "no format"},
		{"malformed query", "GET", "/api/segment/get/orders?count=%zz", 400, -2, "malformed query"},
		{"HEAD takes no ID", "HEAD", "/api/segment/get/orders", 405, 0, ""},
		{"OPTIONS takes no ID", "OPTIONS", "/api/segment/get/orders", 405, 0, "takes no IDs"},
		{"snowflake count 0", "GET", "/api/snowflake/get/x?count=0", 400, -1, "bad count"},
		{"snowflake formatted", "GET", "/api/snowflake/get/x?format=formatted", 400, -1, "snowflake IDs have no format"},
		{"decode without id", "GET", "/decodeSnowflakeId", 400, 0, "want one snowflakeId parameter"},
		{"decode not a number", "GET", "/decodeSnowflakeId?snowflakeId=%3Cb%3E", 400, 0, `snowflakeId "<b>" is not a snowflake ID`},
		{"decode negative", "GET", "/decodeSnowflakeId?snowflakeId=-5", 400, 0, "not a snowflake ID"},
		{"decode twice", "GET", "/decodeSnowflakeId?snowflakeId=1&snowflakeId=2", 400, 0, "got 2"},
		{"cache by POST", "POST", "/cache", 405, 0, "use GET"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			status, body, h := get(t, tt.method, base+tt.path)
			if status != tt.status {
				t.Fatalf("status %d, want %d; body %s", status, tt.status, body)
			}
			if strings.HasPrefix(h.Get("Content-Type"), "application/json") && strings.ContainsAny(body, "<>&") {
				t.Errorf("JSON body %s has markup characters unescaped", body)
			}
			text := body // what the body says, decoded
			var msg struct {
				ErrorMsg string `json:"errorMsg"`
			}
			if json.Unmarshal([]byte(body), &msg) == nil && msg.ErrorMsg != "" {
				text = msg.ErrorMsg
			}
			if tt.code == 0 {
				if !strings.Contains(text, tt.desc) {
					t.Errorf("body %s lacks %q", body, tt.desc)
				}
				return
			}
			e := leafError(t, body)
			if !strings.Contains(e.Description, tt.desc) {
				t.Errorf("description %q lacks %q", e.Description, tt.desc)
			}
			if e.Code != tt.code || e.Status != tt.status || e.Message != fmt.Sprintf("Result{id=%d, status=EXCEPTION}", tt.code) ||
				e.Error != http.StatusText(tt.status) {
				t.Errorf("error body %+v: want Leaf code %d, status %d", e, tt.code, tt.status)
			}
			if ct := h.Get("Content-Type"); ct != "application/json" {
				t.Errorf("Content-Type %q, want application/json", ct)
			}
		})
	}
	// Nothing was taken.
	if got := natsIDs(t, c.nc, "id.segment.orders", 1); got[0] != 1 {
		t.Errorf("first ID after the hostile requests: %d, want 1", got[0])
	}
}

// TestMonitorViews: /cache and /db show, in JSON, a worker's buffers and
// the store's rows with the field names of Leaf's SegmentBufferView and
// LeafAlloc, and in HTML with Leaf's columns.
func TestMonitorViews(t *testing.T) {
	for _, st := range stores {
		t.Run(st.name, func(t *testing.T) {
			c := newCluster(t, st, tagmodel.Tag{Name: "orders", Step: 1000, MaxID: 10}, tagmodel.Tag{Name: "idle", Step: 7, MaxID: 5})
			_, base := c.start(t, "monitor")
			natsIDs(t, c.nc, "id.segment.orders", 3) // 10, 11, 12
			status, body, h := get(t, http.MethodGet, base+"/cache", "Accept", "application/json")
			var cache []map[string]any
			if err := json.Unmarshal([]byte(body), &cache); err != nil || status != http.StatusOK {
				t.Fatalf("/cache: %d %q %v", status, body, err)
			}
			var orders map[string]any
			for _, row := range cache {
				if row["key"] == "orders" {
					orders = row
				}
			}
			want := map[string]any{"key": "orders", "initOk": true, "nextReady": false, "pos": 0.0,
				"value0": 13.0, "max0": 1010.0, "step0": 1000.0, "value1": 0.0, "max1": 0.0, "step1": 0.0}
			if fmt.Sprint(orders) != fmt.Sprint(want) {
				t.Errorf("/cache's orders: %v, want %v", orders, want)
			}
			if h.Get(leafhttp.TotalHeader) != strconv.Itoa(len(cache)) {
				t.Errorf("%s %q, want %d", leafhttp.TotalHeader, h.Get(leafhttp.TotalHeader), len(cache))
			}

			status, body, _ = get(t, http.MethodGet, base+"/db?format=json")
			var db []map[string]any
			if err := json.Unmarshal([]byte(body), &db); err != nil || status != http.StatusOK {
				t.Fatalf("/db: %d %q %v", status, body, err)
			}
			if len(db) != 2 {
				t.Fatalf("/db: %v, want the two tags", db)
			}
			for i, want := range []struct {
				key         string
				maxID, step float64
			}{{"idle", 5, 7}, {"orders", 1010, 1000}} {
				row := db[i]
				if row["key"] != want.key || row["maxId"] != want.maxID || row["step"] != want.step || len(row) != 4 {
					t.Errorf("/db row %d: %v, want key %s, maxId %v, step %v and updateTime", i, row, want.key, want.maxID, want.step)
				}
				if _, err := time.Parse("2006-01-02 15:04:05", fmt.Sprint(row["updateTime"])); err != nil {
					t.Errorf("/db row %d's updateTime: %v", i, err)
				}
			}

			_, page, h := get(t, http.MethodGet, base+"/cache")
			for _, want := range []string{"<th class=\"name\">name</th><th>init</th><th>next</th><th>pos</th><th>value0</th><th>max0</th><th>step0</th><th>value1</th><th>max1</th><th>step1</th>",
				`<tr data-key="orders"><td class="name">orders</td><td>true</td><td>false</td><td>0</td><td>13</td><td>1010</td><td>1000</td>`} {
				if !strings.Contains(page, want) {
					t.Errorf("/cache HTML lacks %q:\n%s", want, page)
				}
			}
			if ct := h.Get("Content-Type"); ct != "text/html; charset=utf-8" {
				t.Errorf("/cache Content-Type %q", ct)
			}
			_, page, _ = get(t, http.MethodGet, base+"/db")
			for _, want := range []string{`<th class="name">tag</th><th>max</th><th>step</th><th class="name">update</th>`,
				`<tr data-key="orders"><td class="name">orders</td><td>1010</td><td>1000</td>`} {
				if !strings.Contains(page, want) {
					t.Errorf("/db HTML lacks %q:\n%s", want, page)
				}
			}
		})
	}
}

// TestHTTPInMetrics: the requests of Leaf's HTTP API are in the service's
// metrics with transport="http" and the path's kind as endpoint (never the
// URL: an unknown path is "other", a tag not in --metrics-tags is ""),
// beside the NATS requests (transport="nats").
func TestHTTPInMetrics(t *testing.T) {
	c := newCluster(t, stores[0], tagmodel.Tag{Name: "orders", Step: 100})
	port, err := testenv.ServerPort()
	if err != nil {
		t.Fatal(err)
	}
	metricsAddr := "127.0.0.1:" + strconv.Itoa(port)
	logs := &testenv.LogBuffer{}
	w, err := worker.New(context.Background(), worker.Config{NATS: worker.NATS{URL: c.ns.ClientURL()}, Instance: "m",
		Store: c.opener, Logger: logs.Logger(), HTTPAddr: "127.0.0.1:0", MetricsAddr: metricsAddr, MetricsTags: []string{"orders"}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := w.Close(); err != nil {
			t.Error(err)
		}
		if t.Failed() {
			t.Logf("worker log:\n%s", logs)
		}
	})
	base := "http://" + w.LeafAddr()
	for _, r := range []struct {
		method, path string
		status       int
	}{
		{"GET", "/api/segment/get/orders?count=5", 200},
		{"POST", "/api/segment/get/orders", 200},
		{"GET", "/api/segment/get/nope", 404},
		{"HEAD", "/api/segment/get/orders", 405},
		{"GET", "/api/snowflake/get/x?count=3", 200},
		{"GET", "/decodeSnowflakeId?snowflakeId=1", 200},
		{"GET", "/cache", 200},
		{"GET", "/no/such/path", 404},
	} {
		if status, body, _ := get(t, r.method, base+r.path); status != r.status {
			t.Fatalf("%s %s: %d %s, want %d", r.method, r.path, status, body, r.status)
		}
	}
	natsIDs(t, c.nc, "id.segment.orders", 2)

	_, metrics, _ := get(t, "GET", "http://"+metricsAddr+"/metrics")
	for _, want := range []string{
		`dispenser_ids_total{endpoint="segment",tag="orders",transport="http"} 6`,
		`dispenser_ids_total{endpoint="segment",tag="orders",transport="nats"} 2`,
		`dispenser_requests_total{code="200",endpoint="segment",tag="orders",transport="http"} 2`,
		`dispenser_requests_total{code="200",endpoint="segment",tag="orders",transport="nats"} 1`,
		`dispenser_requests_total{code="404",endpoint="segment",tag="",transport="http"} 1`,
		`dispenser_requests_total{code="405",endpoint="segment",tag="",transport="http"} 1`,
		`dispenser_ids_total{endpoint="snowflake",tag="",transport="http"} 3`,
		`dispenser_requests_total{code="200",endpoint="snowflake_decode",tag="",transport="http"} 1`,
		`dispenser_requests_total{code="200",endpoint="cache",tag="",transport="http"} 1`,
		`dispenser_requests_total{code="404",endpoint="other",tag="",transport="http"} 1`,
		`dispenser_request_duration_seconds_count{endpoint="segment",transport="http"} 4`,
		`dispenser_request_duration_seconds_count{endpoint="segment",transport="nats"} 1`,
	} {
		if !strings.Contains(metrics, want+"\n") {
			t.Errorf("/metrics lacks %s", want)
		}
	}
	if strings.Contains(metrics, "no/such") || strings.Contains(metrics, `tag="nope"`) {
		t.Errorf("/metrics has a label value from a URL:\n%s", metrics)
	}
}
