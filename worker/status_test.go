package worker

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nats.go/micro"

	"github.com/dispenser-dev/dispenser/ownership"
	"github.com/dispenser-dev/dispenser/segment"
	"github.com/dispenser-dev/dispenser/segment/kv"
	"github.com/dispenser-dev/dispenser/snowflake"
	"github.com/dispenser-dev/dispenser/tagmodel"
	"github.com/dispenser-dev/dispenser/testenv"
)

// TestStatusRender: the status page escapes what it shows (error strings,
// tag names with "=" as period tags have, owner names) and lists at most
// StatusTagLimit tags, saying how many more there are.
func TestStatusRender(t *testing.T) {
	tags := func(n int, name string) []segment.TagStats {
		out := make([]segment.TagStats, n)
		for i := range out {
			out[i] = segment.TagStats{Tag: fmt.Sprintf("%s%06d", name, i), Step: 100,
				Current: &segment.SegmentStats{Start: 1, Cursor: 5, End: 101, Step: 100}}
		}
		return out
	}
	hostile := `<script>alert("x")</script>`
	for _, tt := range []struct {
		name    string
		status  Status
		want    []string // in the page
		notWant []string // not in the page
	}{
		{
			name: "hostile strings are escaped",
			status: Status{Instance: "w<1>", Store: `kv:"segments"&<b>`, Tags: []segment.TagStats{
				{Tag: "a=20261124", LastError: hostile, Current: &segment.SegmentStats{Start: 10, Cursor: 11, End: 20}},
			}, Ordered: &ownership.Stats{Owner: hostile, Owned: []string{"b=20261124"}}},
			want: []string{`&lt;script&gt;alert(&#34;x&#34;)&lt;/script&gt;`, `a=20261124`, `data-tag="a=20261124"`,
				`w&lt;1&gt;`, `kv:&#34;segments&#34;&amp;&lt;b&gt;`, `<li>b=20261124</li>`, `<td>10</td><td>11</td><td>20</td>`},
			notWant: []string{hostile, "<b>", "more tags", "more owned"},
		},
		{
			name:    "200 tags: all, no more line",
			status:  Status{Tags: tags(StatusTagLimit, "t")},
			want:    []string{"t000000", "t000199", "200 tags in memory."},
			notWant: []string{"t000200", "more tags"},
		},
		{
			name: "100,000 tags: the first 200 and a more line",
			status: Status{Tags: tags(100_000, "t"),
				Ordered: &ownership.Stats{Owned: func() []string {
					var o []string
					for _, t := range tags(250, "o") {
						o = append(o, t.Tag)
					}
					return o
				}()}},
			want: []string{"t000000", "t000199", "100000 tags in memory; the first 200 by name.",
				"… and 99800 more tags not shown", "owns 250 ordered tags", "o000199", "… and 50 more owned tags not shown"},
			notWant: []string{"t000200", "o000200"},
		},
		{
			name: "snowflake",
			status: Status{Snowflake: &snowflake.NodeStats{WorkerID: 17, Held: true, LeaseExpires: time.Now()},
				HasRollbacks: true, Rollbacks: 3},
			want:    []string{`<td class="name" id="snowflake-worker-id">17</td>`, ">valid<", `<span class="bad">3</span> since start`},
			notWant: []string{"No snowflake IDs"},
		},
		{
			name:   "no snowflake",
			status: Status{},
			want:   []string{"No snowflake IDs", "0 tags in memory."},
		},
	} {
		t.Run(tt.name, func(t *testing.T) {
			s := tt.status
			s.limit()
			var b strings.Builder
			if err := s.Render(&b); err != nil {
				t.Fatal(err)
			}
			page := b.String()
			for _, want := range tt.want {
				if !strings.Contains(page, want) {
					t.Errorf("page lacks %q", want)
				}
			}
			for _, notWant := range tt.notWant {
				if strings.Contains(page, notWant) {
					t.Errorf("page has %q", notWant)
				}
			}
			if rows := strings.Count(page, `<tr class="tag"`); rows > StatusTagLimit {
				t.Errorf("%d tag rows, want at most %d", rows, StatusTagLimit)
			}
			if t.Failed() && len(page) < 20_000 {
				t.Logf("page:\n%s", page)
			}
		})
	}
}

// statusWorker starts a worker on a fresh nats-server with the KV store,
// metrics on a free port, the tags "orders" (requested a few times) and
// "invoices" (ordered, requested once); it returns the worker and the
// status page's URL.
func statusWorker(tb testing.TB) (*Worker, string) {
	tb.Helper()
	ns := testenv.NATS(tb)
	ctx := context.Background()
	js, err := jetstream.New(testenv.Connect(tb, ns))
	if err != nil {
		tb.Fatal(err)
	}
	store, err := kv.New(ctx, js, kv.Settings{})
	if err != nil {
		tb.Fatal(err)
	}
	for _, tag := range []tagmodel.Tag{{Name: "orders", Step: 1000, MaxID: 1}, {Name: "invoices", Step: 10, MaxID: 1, Ordered: true}} {
		if err := store.CreateTag(ctx, tag); err != nil {
			tb.Fatal(err)
		}
	}
	logs := &testenv.LogBuffer{}
	w, err := New(ctx, Config{NATS: NATS{URL: ns.ClientURL()}, Instance: "status-test", Logger: logs.Logger(),
		MetricsAddr: "127.0.0.1:0"})
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		w.Close()
		if tb.Failed() {
			tb.Logf("worker's log:\n%s", logs)
		}
	})
	nc := testenv.Connect(tb, ns)
	for _, subject := range []string{"id.segment.orders", "id.segment.orders", "id.segment.orders", "id.segment.invoices", "id.snowflake"} {
		resp, err := nc.Request(subject, nil, 30*time.Second)
		if err != nil || resp.Header.Get(micro.ErrorCodeHeader) != "" {
			tb.Fatalf("%s: %v %v", subject, err, resp)
		}
	}
	return w, "http://" + w.httpAddr + "/status"
}

// TestStatusPageOfWorker: a running worker's /status shows the tags it
// served with their buffers, the ordered tag it owns and its snowflake
// worker ID.
func TestStatusPageOfWorker(t *testing.T) {
	w, url := statusWorker(t)
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	page := string(body)
	if resp.StatusCode != http.StatusOK || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/html") {
		t.Fatalf("GET /status: %s, %s", resp.Status, resp.Header.Get("Content-Type"))
	}
	sf, _ := w.sf.Stats().(snowflake.NodeStats)
	if sf.WorkerID < 0 {
		t.Fatalf("no snowflake worker ID: %+v", sf)
	}
	var orders segment.TagStats
	for _, st := range w.SegmentStats() {
		if st.Tag == "orders" {
			orders = st
		}
	}
	if orders.Current == nil {
		t.Fatalf("orders has no current buffer: %+v", orders)
	}
	for _, want := range []string{
		`<tr class="tag" data-tag="orders"><td class="name">orders</td>`,
		// Three IDs taken from the first segment, 1..1000.
		fmt.Sprintf("<td>%d</td><td>%d</td><td>%d</td>", orders.Current.Start, orders.Current.Cursor, orders.Current.End),
		`data-tag="invoices"`,
		"<li>invoices</li>",
		fmt.Sprintf(`id="snowflake-worker-id">%d<`, sf.WorkerID),
		"status-test",
		w.store.Name,
		"CONNECTED",
	} {
		if !strings.Contains(page, want) {
			t.Errorf("/status lacks %q", want)
		}
	}
	if orders.Current.Cursor-orders.Current.Start != 3 {
		t.Errorf("orders' current buffer %+v: want 3 IDs taken", orders.Current)
	}
	if t.Failed() {
		t.Logf("page:\n%s", page)
	}
}

// TestStatusPageInChromium: a real headless browser renders a running
// worker's /status: its DOM has the tag's row, and it takes a screenshot.
// Chromium is required (Debian package chromium; ./test.sh installs it).
func TestStatusPageInChromium(t *testing.T) {
	chromium, err := exec.LookPath("chromium")
	if err != nil {
		t.Fatalf("chromium not found (%v): install the Debian package chromium (apt-get install --no-install-recommends chromium; ./test.sh does)", err)
	}
	_, url := statusWorker(t)
	dir := t.TempDir()
	browse := func(args ...string) string {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		args = append([]string{"--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
			"--disable-background-networking", "--disable-component-update", "--disable-sync",
			"--user-data-dir=" + filepath.Join(dir, "profile")}, args...)
		cmd := exec.CommandContext(ctx, chromium, append(args, url)...)
		var stderr strings.Builder
		cmd.Stderr = &stderr
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("chromium %v: %v\n%s", args, err, stderr.String())
		}
		return string(out)
	}
	dom := browse("--dump-dom")
	for _, want := range []string{`<tr class="tag" data-tag="orders"><td class="name">orders</td>`, `id="snowflake-worker-id"`} {
		if !strings.Contains(dom, want) {
			t.Errorf("chromium's DOM of /status lacks %q:\n%s", want, dom)
		}
	}
	shot := filepath.Join(dir, "status.png")
	browse("--screenshot="+shot, "--window-size=1280,900")
	b, err := os.ReadFile(shot)
	if err != nil {
		t.Fatalf("no screenshot: %v", err)
	}
	if len(b) < 1000 || string(b[1:4]) != "PNG" {
		t.Fatalf("screenshot is %d bytes, not a PNG", len(b))
	}
}
