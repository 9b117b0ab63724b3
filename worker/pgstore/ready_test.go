package pgstore_test

import (
	"context"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/dispenser-dev/dispenser/internal/tests/faultnet"
	"github.com/dispenser-dev/dispenser/internal/tests/testdb"
	"github.com/dispenser-dev/dispenser/testenv"
	"github.com/dispenser-dev/dispenser/worker"
	"github.com/dispenser-dev/dispenser/worker/pgstore"
)

// TestReadyzNamesNATS: /readyz of a worker that lost NATS while its store
// (PostgreSQL without the witness, so nothing of it is on NATS) answers
// says 503 naming the NATS part, and 200 again once NATS is back. Only
// the check of the NATS connections sees this: the store's ping succeeds,
// and the snowflake lease, whose heartbeats fail, is checked after NATS
// (and runs out only after its lease).
func TestReadyzNamesNATS(t *testing.T) {
	ns := testenv.NATS(t)
	link := faultnet.New(t).Link(t, "nats", ns.Addr().String())
	db := testdb.New(t, map[string]int64{"a": 100})
	port, err := testenv.ServerPort()
	if err != nil {
		t.Fatal(err)
	}
	addr := "127.0.0.1:" + strconv.Itoa(port)
	logs := &testenv.LogBuffer{}
	w, err := worker.New(context.Background(), worker.Config{
		NATS:            worker.NATS{URL: "nats://" + link.Addr()},
		Store:           pgstore.Postgres{URL: db.URL, NoWitness: true},
		Logger:          logs.Logger(),
		MetricsAddr:     addr,
		ShutdownTimeout: 2 * time.Second,
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		link.Heal()
		w.Close()
		if t.Failed() {
			t.Logf("worker's log:\n%s", logs)
		}
	})
	base := "http://" + addr
	waitReadyz(t, base, "", "a serving worker")
	// Bytes stop flowing between the worker and nats-server: its pings
	// go unanswered, and it drops both connections.
	link.BlackHole(faultnet.Both)
	waitReadyz(t, base, "nats", "NATS cut off, PostgreSQL answering")
	link.Heal()
	waitReadyz(t, base, "", "NATS back")
}

// waitReadyz waits (at most a minute) until /readyz under base answers
// 503 naming part, or 200 for part ""; what describes the worker's state
// for the failure.
func waitReadyz(tb testing.TB, base, part, what string) {
	tb.Helper()
	wantCode, wantBody := http.StatusOK, "ready\n"
	if part != "" {
		wantCode, wantBody = http.StatusServiceUnavailable, "not ready: "+part+"\n"
	}
	deadline := time.Now().Add(time.Minute)
	for {
		code, body := testenv.HTTPGet(tb, base+"/readyz")
		if code == wantCode && strings.HasPrefix(body, wantBody) {
			return
		}
		if time.Now().After(deadline) {
			tb.Fatalf("%s: after a minute /readyz still %d %q, want %d %q", what, code, body, wantCode, wantBody)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
