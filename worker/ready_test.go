package worker

import (
	"context"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/dispenser-dev/dispenser/snowflake"
	"github.com/dispenser-dev/dispenser/testenv"
)

// TestReadyMetricMirrorsReadyz: dispenser_ready on /metrics says what
// /readyz says, 1 while the worker serves and 0 once its NATS server is
// gone (so that an alert on it fires for a worker that is up but cannot
// serve).
func TestReadyMetricMirrorsReadyz(t *testing.T) {
	ns := testenv.StartNATS(t, testenv.NATSOptions(t.TempDir()))
	t.Cleanup(ns.Shutdown)
	w := readyWorker(t, ns.ClientURL(), snowflake.NodeSettings{})
	base := "http://" + w.httpAddr
	check := func(wantReady bool) (ok bool, got string) {
		t.Helper()
		code, _ := testenv.HTTPGet(t, base+"/readyz")
		_, metrics := testenv.HTTPGet(t, base+"/metrics")
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
	_, body := testenv.HTTPGet(t, base+"/readyz")
	_, metrics := testenv.HTTPGet(t, base+"/metrics")
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

// TestReadyzSnowflakeLease: /readyz (and dispenser_ready) of a worker
// whose snowflake generator cannot issue says 503 naming the snowflake
// part, and 200 again once it can: its clock stepped an hour back (an
// injected wall clock, Config.Snowflake.Now), then forward again; its
// lease bucket deleted by an operator (nats kv rm), after which it stops
// issuing for good.
func TestReadyzSnowflakeLease(t *testing.T) {
	tests := []struct {
		name string
		// fail puts the worker in the state; recover, if not nil, ends it.
		fail, recover func(t *testing.T, js jetstream.JetStream, clock *offsetClock)
	}{
		{
			name:    "clock an hour behind",
			fail:    func(t *testing.T, _ jetstream.JetStream, c *offsetClock) { c.offset.Store(int64(-time.Hour)) },
			recover: func(t *testing.T, _ jetstream.JetStream, c *offsetClock) { c.offset.Store(0) },
		},
		{
			name: "lease bucket deleted",
			fail: func(t *testing.T, js jetstream.JetStream, _ *offsetClock) {
				if err := js.DeleteKeyValue(context.Background(), snowflake.DefaultBucket); err != nil {
					t.Fatal(err)
				}
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ns := testenv.StartNATS(t, testenv.NATSOptions(t.TempDir()))
			t.Cleanup(ns.Shutdown)
			clock := &offsetClock{}
			w := readyWorker(t, ns.ClientURL(), snowflake.NodeSettings{Settings: snowflake.Settings{Now: clock.Now}})
			nc, err := nats.Connect(ns.ClientURL())
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(nc.Close)
			js, err := jetstream.New(nc)
			if err != nil {
				t.Fatal(err)
			}
			base := "http://" + w.httpAddr
			waitReadyz(t, base, "", "a serving worker")
			tt.fail(t, js, clock)
			waitReadyz(t, base, "snowflake", tt.name)
			if tt.recover != nil {
				tt.recover(t, js, clock)
				waitReadyz(t, base, "", tt.name+", then ended")
			}
		})
	}
}

// offsetClock is a wall clock offset from time.Now by offset (ns).
type offsetClock struct{ offset atomic.Int64 }

func (c *offsetClock) Now() time.Time { return time.Now().Add(time.Duration(c.offset.Load())) }

// waitReadyz waits (at most 30 s) until /readyz under base answers 503
// naming part, or 200 for part "", and dispenser_ready on /metrics says
// the same; what describes the worker's state for the failure.
func waitReadyz(tb testing.TB, base, part, what string) {
	tb.Helper()
	wantCode, wantBody, wantMetric := http.StatusOK, "ready\n", "dispenser_ready 1\n"
	if part != "" {
		wantCode, wantBody, wantMetric = http.StatusServiceUnavailable, "not ready: "+part+"\n", "dispenser_ready 0\n"
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		code, body := testenv.HTTPGet(tb, base+"/readyz")
		_, metrics := testenv.HTTPGet(tb, base+"/metrics")
		if code == wantCode && strings.HasPrefix(body, wantBody) && strings.Contains(metrics, wantMetric) {
			return
		}
		if time.Now().After(deadline) {
			line := "no dispenser_ready line"
			for l := range strings.Lines(metrics) {
				if strings.HasPrefix(l, "dispenser_ready ") {
					line = strings.TrimSpace(l)
				}
			}
			tb.Fatalf("%s: after 30 s /readyz still %d %q and %s; want %d %q and %s",
				what, code, body, line, wantCode, wantBody, strings.TrimSpace(wantMetric))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// readyWorker starts a worker on url with its metrics server (/readyz)
// and the snowflake settings sf; its log is shown if the test fails.
func readyWorker(tb testing.TB, url string, sf snowflake.NodeSettings) *Worker {
	tb.Helper()
	logs := &testenv.LogBuffer{}
	w, err := New(context.Background(), Config{NATS: NATS{URL: url}, Logger: logs.Logger(), Snowflake: sf,
		MetricsAddr: "127.0.0.1:0", ShutdownTimeout: 2 * time.Second})
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		w.Close()
		if tb.Failed() {
			tb.Logf("worker's log:\n%s", logs)
		}
	})
	return w
}
