package deploy

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"math"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/dispenser-dev/dispenser/internal/tests/testdb"
	"github.com/dispenser-dev/dispenser/segment"
	"github.com/dispenser-dev/dispenser/testenv"
	"github.com/dispenser-dev/dispenser/worker"
	"github.com/dispenser-dev/dispenser/worker/pgstore"
)

// dashboard is what the tests read of a Grafana dashboard.
type dashboard struct {
	UID, Title string
	Templating struct {
		List []struct{ Name, Type string }
	}
	Panels []panel
}

type panel struct {
	ID      int
	Type    string
	Title   string
	GridPos struct{ H, W, X, Y int }
	Targets []struct {
		RefID string
		Expr  string
	}
	Panels []panel // of a collapsed row
}

// readDashboard reads deploy/grafana/dispenser.json and returns it with
// its panels, rows' panels included, in order.
func readDashboard(tb testing.TB) (dashboard, []panel) {
	tb.Helper()
	data, err := os.ReadFile("grafana/dispenser.json")
	if err != nil {
		tb.Fatal(err)
	}
	var d dashboard
	if err := json.Unmarshal(data, &d); err != nil {
		tb.Fatalf("grafana/dispenser.json: %v", err)
	}
	var all []panel
	for _, p := range d.Panels {
		all = append(all, p)
		all = append(all, p.Panels...)
	}
	return d, all
}

// TestDashboardWellFormed: the dashboard has a UID and title, unique panel
// IDs, panels that do not overlap, and every query panel has targets with
// an expression and a refId; the variables the queries use exist.
func TestDashboardWellFormed(t *testing.T) {
	d, panels := readDashboard(t)
	if d.UID == "" || d.Title == "" {
		t.Errorf("uid %q, title %q: want both", d.UID, d.Title)
	}
	vars := map[string]bool{"__rate_interval": true}
	for _, v := range d.Templating.List {
		vars[v.Name] = true
	}
	ids := map[int]bool{}
	for i, p := range panels {
		if ids[p.ID] {
			t.Errorf("panel id %d twice", p.ID)
		}
		ids[p.ID] = true
		if p.Type == "row" {
			continue
		}
		if len(p.Targets) == 0 {
			t.Errorf("panel %q has no query", p.Title)
		}
		for _, tg := range p.Targets {
			if tg.Expr == "" || tg.RefID == "" {
				t.Errorf("panel %q: target %+v without expr or refId", p.Title, tg)
			}
			for _, m := range regexp.MustCompile(`\$\{?(\w+)`).FindAllStringSubmatch(tg.Expr, -1) {
				if !vars[m[1]] {
					t.Errorf("panel %q uses $%s, which the dashboard does not define", p.Title, m[1])
				}
			}
		}
		for _, q := range panels[:i] {
			a, b := p.GridPos, q.GridPos
			if q.Type != "row" && a.X < b.X+b.W && b.X < a.X+a.W && a.Y < b.Y+b.H && b.Y < a.Y+a.H {
				t.Errorf("panels %q and %q overlap", p.Title, q.Title)
			}
		}
	}
}

// TestDashboardQueries runs a real Prometheus that scrapes a real worker
// (PostgreSQL with the witness, snowflake, a plain and an ordered tag
// named in --metrics-tags) under load, with requests that fail too, and
// runs every query of the dashboard through Prometheus's HTTP API with
// the dashboard's variables filled in: each must parse and return at least
// one number. It waits, query by query, until the data is there; the
// deadline only bounds a hang.
func TestDashboardQueries(t *testing.T) {
	prom := tool(t, "prometheus", "prometheus")
	_, panels := readDashboard(t)

	ns := testenv.NATS(t)
	port, err := testenv.ServerPort()
	if err != nil {
		t.Fatal(err)
	}
	metrics := fmt.Sprintf("127.0.0.1:%d", port)
	db := testdb.New(t, map[string]int64{"orders": 10, "invoices": 10}, "invoices")
	w, err := worker.New(context.Background(), worker.Config{
		NATS:        worker.NATS{URL: ns.ClientURL()},
		Store:       pgstore.Postgres{URL: db.URL},
		Logger:      slog.New(slog.DiscardHandler),
		MetricsAddr: metrics,
		HTTPAddr:    "127.0.0.1:0", // Leaf's HTTP API, for the panels of transport="http"
		MetricsTags: []string{"orders", "invoices"},
		// Small segments, so that the load fetches all the time.
		Segment: segment.Settings{MaxStep: 20, MaxWait: 5 * time.Second},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { w.Close() })

	base := startPrometheus(t, prom, metrics)
	stop := load(t, testenv.Connect(t, ns), "http://"+w.LeafAddr())
	defer stop()

	vars := strings.NewReplacer("$__rate_interval", "5s", "${job}", "dispenser", "$job", "dispenser",
		"${instance}", ".*", "$instance", ".*")
	deadline := time.Now().Add(60 * time.Second)
	checked := 0
	for _, p := range panels {
		for _, tg := range p.Targets {
			expr := vars.Replace(tg.Expr)
			for {
				n, err := query(base, expr)
				if err != nil {
					t.Errorf("panel %q, %s: %v", p.Title, expr, err)
					break
				}
				if n > 0 {
					checked++
					break
				}
				if time.Now().After(deadline) {
					t.Errorf("panel %q, %s: no data within 60 s of load", p.Title, expr)
					break
				}
				time.Sleep(200 * time.Millisecond)
			}
		}
	}
	t.Logf("%d queries of %d panels returned data", checked, len(panels))
	if checked < 30 {
		t.Errorf("only %d queries checked", checked)
	}
}

// startPrometheus runs prometheus scraping target every second as job
// "dispenser", on storage in a temporary directory, and returns its base
// URL once it answers.
func startPrometheus(t *testing.T, prom, target string) string {
	t.Helper()
	dir := t.TempDir()
	cfg := fmt.Sprintf("global: {scrape_interval: 1s, evaluation_interval: 1s}\nscrape_configs:\n  - job_name: dispenser\n    static_configs: [{targets: [%q]}]\n", target)
	if err := os.WriteFile(filepath.Join(dir, "prometheus.yml"), []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	port, err := testenv.ServerPort()
	if err != nil {
		t.Fatal(err)
	}
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	logs := &testenv.LogBuffer{}
	cmd := exec.Command(prom, "--config.file="+filepath.Join(dir, "prometheus.yml"), "--storage.tsdb.path="+filepath.Join(dir, "data"),
		"--web.listen-address="+addr)
	cmd.Stdout, cmd.Stderr = logs, logs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Signal(os.Interrupt)
		cmd.Wait()
		if t.Failed() {
			t.Logf("prometheus's log:\n%s", logs)
		}
	})
	base := "http://" + addr
	for start := time.Now(); ; time.Sleep(100 * time.Millisecond) {
		resp, err := http.Get(base + "/-/ready")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return base
			}
		}
		if time.Since(start) > 30*time.Second {
			t.Fatalf("prometheus not ready within 30 s: %v", err)
		}
	}
}

// load sends requests until the returned stop is called: segment IDs
// (single and batches), an ordered tag, snowflake IDs and decodes, and
// requests that fail (400, 404), so that every endpoint and code has
// series; over NATS, and (the last of the goroutines) over Leaf's HTTP API
// at leaf.
func load(t *testing.T, nc *nats.Conn, leaf string) (stop func()) {
	t.Helper()
	done := make(chan struct{})
	var wg sync.WaitGroup
	reqs := []struct{ subject, body string }{
		{"id.segment.orders", ""}, {"id.segment.orders", "7"}, {"id.segment.invoices", ""}, {"id.segment.invoices", "3"},
		{"id.snowflake", ""}, {"id.snowflake", "5"}, {"id.snowflake.decode", "123456789"},
		{"id.segment.orders", "zero"}, {"id.segment.unknown", ""},
	}
	paths := []string{"/api/segment/get/orders", "/api/segment/get/orders?count=7", "/api/segment/get/invoices",
		"/api/snowflake/get/x?count=5", "/decodeSnowflakeId?snowflakeId=123456789", "/api/segment/get/unknown"}
	wg.Go(func() {
		for n := 0; ; n++ {
			select {
			case <-done:
				return
			default:
			}
			resp, err := http.Get(leaf + paths[n%len(paths)])
			if err != nil {
				t.Errorf("GET %s: %v", paths[n%len(paths)], err)
				return
			}
			resp.Body.Close()
		}
	})
	for i := range 4 {
		wg.Go(func() {
			for n := i; ; n++ {
				select {
				case <-done:
					return
				default:
				}
				r := reqs[n%len(reqs)]
				if _, err := nc.Request(r.subject, []byte(r.body), 5*time.Second); err != nil {
					select {
					case <-done:
					default:
						t.Errorf("%s %q: %v", r.subject, r.body, err)
						return
					}
				}
			}
		})
	}
	var once sync.Once
	return func() { once.Do(func() { close(done); wg.Wait() }) }
}

// query runs expr as an instant query and returns how many of its
// results hold a number (not NaN): an error for an expression Prometheus
// refuses.
func query(base, expr string) (int, error) {
	resp, err := http.Get(base + "/api/v1/query?query=" + url.QueryEscape(expr))
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	var r struct {
		Status, Error, ErrorType string
		Data                     struct {
			ResultType string
			Result     json.RawMessage
		}
	}
	if err := json.NewDecoder(resp.Body).Decode(&r); err != nil {
		return 0, fmt.Errorf("%s: %w", resp.Status, err)
	}
	if r.Status != "success" {
		return 0, fmt.Errorf("%s: %s: %s", resp.Status, r.ErrorType, r.Error)
	}
	var values [][2]any
	switch r.Data.ResultType {
	case "vector":
		var vec []struct{ Value [2]any }
		if err := json.Unmarshal(r.Data.Result, &vec); err != nil {
			return 0, err
		}
		for _, v := range vec {
			values = append(values, v.Value)
		}
	case "scalar":
		var v [2]any
		if err := json.Unmarshal(r.Data.Result, &v); err != nil {
			return 0, err
		}
		values = append(values, v)
	default:
		return 0, fmt.Errorf("result type %s, want a vector", r.Data.ResultType)
	}
	return len(slices.DeleteFunc(values, func(v [2]any) bool {
		s, _ := v[1].(string)
		f, err := strconv.ParseFloat(s, 64)
		return err != nil || math.IsNaN(f)
	})), nil
}
