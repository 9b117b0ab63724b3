package deploy

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/micro"

	"github.com/dispenser-dev/dispenser/internal/tests/testdb"
	"github.com/dispenser-dev/dispenser/segment"
	"github.com/dispenser-dev/dispenser/testenv"
	"github.com/dispenser-dev/dispenser/worker"
	"github.com/dispenser-dev/dispenser/worker/pgstore"
)

// TestAlertRules: promtool accepts the rules, and alerts_test.yaml (input
// series that fire each alert, and series that must not) passes.
func TestAlertRules(t *testing.T) {
	promtool := tool(t, "promtool", "prometheus")
	run(t, "prometheus", promtool, "check", "rules", "alerts.yaml")
	run(t, "prometheus", promtool, "test", "rules", "alerts_test.yaml")
}

// TestAlertMetricsExist: every dispenser_* metric named in alerts.yaml is
// served by a real worker's /metrics (PostgreSQL with the witness,
// snowflake, an ordered tag), so that no rule waits on a series that never
// comes.
func TestAlertMetricsExist(t *testing.T) {
	rules, err := os.ReadFile("prometheus/alerts.yaml")
	if err != nil {
		t.Fatal(err)
	}
	used := regexp.MustCompile(`\bdispenser_[a-z_]+[a-z]`).FindAllString(string(rules), -1)
	slices.Sort(used)
	used = slices.Compact(used)
	if len(used) < 8 {
		t.Fatalf("alerts.yaml names only %v", used)
	}

	ns := testenv.NATS(t)
	db := testdb.New(t, map[string]int64{"orders": 1, "invoices": 1}, "invoices")
	port, err := testenv.ServerPort()
	if err != nil {
		t.Fatal(err)
	}
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	w, err := worker.New(context.Background(), worker.Config{
		NATS:        worker.NATS{URL: ns.ClientURL()},
		Store:       pgstore.Postgres{URL: db.URL},
		Logger:      slog.New(slog.DiscardHandler),
		MetricsAddr: addr,
		// The test is about names, not latency: a busy machine's first
		// fetch (an ordered tag's, through the witness) may take longer
		// than the default 100 ms (seen once: 503 for invoices).
		Segment: segment.Settings{MaxWait: 5 * time.Second},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { w.Close() })
	nc := testenv.Connect(t, ns)
	// A request per endpoint, so that the labelled series exist: a served
	// segment (fetch histogram), an ordered tag (ownership) and snowflake.
	for _, subject := range []string{"id.segment.orders", "id.segment.invoices", "id.snowflake"} {
		resp, err := nc.Request(subject, nil, 30*time.Second)
		if err != nil || resp.Header.Get(micro.ErrorCodeHeader) != "" {
			t.Fatalf("%s: %v %v", subject, err, resp)
		}
	}
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	served := map[string]bool{}
	for line := range strings.Lines(string(body)) {
		if f := strings.Fields(line); len(f) >= 3 && f[0] == "#" && f[1] == "TYPE" {
			served[f[2]] = true
			if f[3] == "histogram" {
				for _, s := range []string{"_bucket", "_count", "_sum"} {
					served[f[2]+s] = true
				}
			}
		}
	}
	for _, name := range used {
		if !served[name] {
			t.Errorf("alerts.yaml uses %s, which a worker does not serve", name)
		}
	}
	for _, series := range []string{`dispenser_requests_total{code="200"`, `dispenser_segment_fetch_duration_seconds_count{result="ok"}`} {
		if !strings.Contains(string(body), series) {
			t.Errorf("/metrics lacks %s…", series)
		}
	}
}
