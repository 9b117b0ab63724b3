package worker

import (
	"context"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/dispenser-dev/dispenser/testenv"
)

// TestReadyMetricMirrorsReadyz: dispenser_ready on /metrics says what
// /readyz says, 1 while the worker serves and 0 once its NATS server is
// gone (so that an alert on it fires for a worker that is up but cannot
// serve).
func TestReadyMetricMirrorsReadyz(t *testing.T) {
	ns := testenv.StartNATS(t, testenv.NATSOptions(t.TempDir()))
	t.Cleanup(ns.Shutdown)
	logs := &testenv.LogBuffer{}
	w, err := New(context.Background(), Config{NATS: NATS{URL: ns.ClientURL()}, Logger: logs.Logger(),
		MetricsAddr: "127.0.0.1:0", ShutdownTimeout: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		w.Close()
		if t.Failed() {
			t.Logf("worker's log:\n%s", logs)
		}
	})
	base := "http://" + w.httpAddr
	check := func(wantReady bool) (ok bool, got string) {
		t.Helper()
		code, _ := get(t, base+"/readyz")
		_, metrics := get(t, base+"/metrics")
		want := "dispenser_ready 0\n"
		if wantReady {
			want = "dispenser_ready 1\n"
		}
		line := "no dispenser_ready line"
		for l := range strings.Lines(metrics) {
			if strings.HasPrefix(l, "dispenser_ready ") {
				line = strings.TrimSpace(l)
			}
		}
		return (code == http.StatusOK) == wantReady && strings.Contains(metrics, want), line
	}
	if ok, line := check(true); !ok {
		t.Fatalf("a serving worker: /readyz and %s, want 200 and dispenser_ready 1", line)
	}
	// Which endpoints it serves, on the page and in the metrics.
	_, body := get(t, base+"/readyz")
	_, metrics := get(t, base+"/metrics")
	if want := "serving: segment snowflake snowflake_decode\n"; !strings.Contains(body, want) {
		t.Errorf("/readyz of a serving worker:\n%s\nwant the line %q", body, want)
	}
	for _, want := range []string{`dispenser_endpoint_serving{endpoint="segment"} 1`, `dispenser_endpoint_serving{endpoint="snowflake"} 1`} {
		if !strings.Contains(metrics, want) {
			t.Errorf("metrics of a serving worker lack %s", want)
		}
	}
	ns.Shutdown()
	deadline := time.Now().Add(30 * time.Second)
	for {
		ok, line := check(false)
		if ok {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("30 s after its NATS server stopped: %s, want /readyz 503 and dispenser_ready 0", line)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// get returns the status code and body of a GET of url.
func get(tb testing.TB, url string) (int, string) {
	tb.Helper()
	resp, err := http.Get(url)
	if err != nil {
		tb.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		tb.Fatal(err)
	}
	return resp.StatusCode, string(body)
}
