package dispenser

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"

	"github.com/dispenser-dev/dispenser/internal/tests/wait"
	"github.com/dispenser-dev/dispenser/snowflake"
	"github.com/dispenser-dev/dispenser/testenv"
)

// gatedSnowflake issues IDs from a counter; while gate is not closed,
// AppendIDs waits for it, after saying so on entered (once).
type gatedSnowflake struct {
	gate    chan struct{}
	entered chan struct{}
	next    int64 // only the endpoint's handler goroutine touches it
}

func (g *gatedSnowflake) AppendIDs(dst []int64, n int) ([]int64, error) {
	select {
	case <-g.gate:
	default:
		close(g.entered)
		<-g.gate
	}
	for range n {
		g.next++
		dst = append(dst, g.next)
	}
	return dst, nil
}
func (*gatedSnowflake) Unavailable(error) bool   { return false }
func (*gatedSnowflake) Epoch() time.Time         { return snowflake.DefaultEpoch }
func (*gatedSnowflake) Layout() snowflake.Layout { return snowflake.DefaultLayout }
func (*gatedSnowflake) Stats() any               { return nil }

// TestFloodBounded: a requester that sends requests faster than a worker
// answers them (here: while its handler waits) fills the endpoint's queue
// in the worker's NATS client only up to pendingBytes; the rest are
// dropped there (no reply, nothing taken: the requester's attempt times
// out), instead of held in memory without bound until the worker is
// killed, and answered long after their requesters gave up. Each request
// is a valid request for one ID padded with white space to 1 MB, so that
// a few dozen pass the bound.
func TestFloodBounded(t *testing.T) {
	ns := testenv.NATS(t)
	var slow atomic.Bool // the worker's connection reported dropped requests
	wc := testenv.Connect(t, ns, nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) {
		if errors.Is(err, nats.ErrSlowConsumer) {
			slow.Store(true)
		}
	}))
	sf := &gatedSnowflake{gate: make(chan struct{}), entered: make(chan struct{})}
	svc, err := New(Config{Conn: wc, Snowflake: sf, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		select {
		case <-sf.gate:
		default:
			close(sf.gate)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = svc.Stop(ctx)
	})
	nc := testenv.Connect(t, ns)
	replies := testenv.Subscribe(t, nc, "_INBOX.flood.*")
	if err := replies.SetPendingLimits(-1, -1); err != nil {
		t.Fatal(err)
	}
	before := wc.Stats().InMsgs
	// The first request holds the handler.
	if err := nc.PublishRequest("id.snowflake", "_INBOX.flood.first", nil); err != nil {
		t.Fatal(err)
	}
	select {
	case <-sf.entered:
	case <-time.After(10 * time.Second):
		t.Fatal("the first request did not reach AppendIDs")
	}
	const size = 1_000_000
	flood := pendingBytes/size + 8
	body := append(bytes.Repeat([]byte(" "), size-1), '1')
	for i := range flood {
		if err := nc.PublishRequest("id.snowflake", "_INBOX.flood.r"+strconv.Itoa(i), body); err != nil {
			t.Fatal(err)
		}
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	wait.For(t, 30*time.Second, "the worker's connection received the flood", func() bool {
		return wc.Stats().InMsgs >= before+1+uint64(flood)
	})
	close(sf.gate)
	// The handler answers in order: once a request sent after the flood
	// is answered, every queued request of the flood was.
	last, err := nc.Request("id.snowflake", nil, 30*time.Second)
	if err != nil {
		t.Fatalf("a request after the flood: %v", err)
	}
	if code := last.Header.Get(micro.ErrorCodeHeader); code != "" {
		t.Fatalf("a request after the flood: %s", code)
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	answered, _, err := replies.Pending()
	if err != nil {
		t.Fatal(err)
	}
	if most := pendingBytes/size + 2; answered > most {
		t.Errorf("%d of the %d requests of %d bytes queued behind a busy handler were answered: the worker held %d MB of requests; want at most %d (the endpoint's queue bounded at %d bytes)",
			answered, flood+1, size, answered*size>>20, most, pendingBytes)
	}
	wait.For(t, 10*time.Second, "the worker's connection reported the dropped requests (nats.ErrSlowConsumer): not silently", slow.Load)
	if answered < 1 {
		t.Errorf("no request answered, want the first one at least")
	}
}
