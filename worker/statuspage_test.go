package worker

import (
	"context"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dispenser-dev/dispenser/testenv"
)

// TestStatusSnapshot: many concurrent viewers of /status share a snapshot
// computed at most once a second, and bad paging parameters are 400.
func TestStatusSnapshot(t *testing.T) {
	var computed atomic.Int64
	testStatusComputed = func() { computed.Add(1) }
	t.Cleanup(func() { testStatusComputed = nil })
	ns := testenv.StartNATS(t, testenv.NATSOptions(t.TempDir()))
	t.Cleanup(ns.Shutdown)
	w, err := New(context.Background(), Config{NATS: NATS{URL: ns.ClientURL()}, Logger: (&testenv.LogBuffer{}).Logger(),
		NoSnowflake: true, MetricsAddr: "127.0.0.1:0", ShutdownTimeout: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { w.Close() })
	base := "http://" + w.httpAddr
	start := time.Now()
	var wg sync.WaitGroup
	for range 200 {
		wg.Go(func() {
			if code, body := get(t, base+"/status"); code != http.StatusOK {
				t.Errorf("/status: %d %s", code, body)
			}
		})
	}
	wg.Wait()
	allowed := int64(time.Since(start)/time.Second) + 1
	if got := computed.Load(); got < 1 || got > allowed {
		t.Errorf("200 concurrent /status in %v: computed %d times, want 1..%d", time.Since(start), got, allowed)
	}
	for _, q := range []string{"limit=0", "limit=x", "limit=10001", "after=a&after=b"} {
		if code, _ := get(t, base+"/status?"+q); code != http.StatusBadRequest {
			t.Errorf("/status?%s: %d, want 400", q, code)
		}
	}
}
