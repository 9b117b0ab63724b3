package worker_test

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/dispenser-dev/dispenser/client"
	"github.com/dispenser-dev/dispenser/internal/tests/faultnet"
	"github.com/dispenser-dev/dispenser/testenv"
	"github.com/dispenser-dev/dispenser/worker"
)

// TestReconnectsWhenServerStopsAnswering: a worker reaches its server over
// two links; the one it uses is black-holed (no reset, no close: bytes stop
// flowing, as in a partition). The worker must notice by its own pings and
// reconnect over the other link, and serve again. With nats.go's default
// ping interval (2 min) it noticed nothing within the minute this test
// waits.
func TestReconnectsWhenServerStopsAnswering(t *testing.T) {
	ns := testenv.NATS(t)
	fn := faultnet.New(t)
	upstream := ns.Addr().String()
	links := map[string]*faultnet.Link{}
	var urls []string
	for _, name := range []string{"a", "b"} {
		l := fn.Link(t, name, upstream)
		url := "nats://" + l.Addr()
		links[url] = l
		urls = append(urls, url)
	}
	w, err := worker.New(context.Background(), worker.Config{
		NATS:   worker.NATS{URL: urls[0] + "," + urls[1]},
		Logger: slog.New(slog.DiscardHandler),
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { w.Close() })
	cut := w.URL()
	links[cut].BlackHole(faultnet.Both)
	deadline := time.Now().Add(time.Minute)
	for w.URL() == cut || w.URL() == "" {
		if time.Now().After(deadline) {
			t.Fatalf("worker still on %s a minute after that link went silent, want it reconnected over the other link", cut)
		}
		time.Sleep(10 * time.Millisecond)
	}
	cl, err := client.New(testenv.Connect(t, ns), client.WithTimeout(time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cl.Close)
	if _, err := cl.Snowflake(context.Background()); err != nil {
		t.Fatalf("snowflake after the reconnect: %v", err)
	}
}
