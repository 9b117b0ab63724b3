package client_test

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"

	"github.com/dispenser-dev/dispenser/client"
	"github.com/dispenser-dev/dispenser/dispenser"
	"github.com/dispenser-dev/dispenser/internal/tests/testdb"
	"github.com/dispenser-dev/dispenser/protocol"
	"github.com/dispenser-dev/dispenser/segment"
	"github.com/dispenser-dev/dispenser/testenv"
)

// serve starts a dispenser worker on a fresh NATS server and database with
// the given tags, and returns a client connection.
func serve(tb testing.TB, tags map[string]int64) (*nats.Conn, *server.Server) {
	tb.Helper()
	store := testdb.New(tb, tags).Store
	ns := testenv.NATS(tb)
	quiet := slog.New(slog.DiscardHandler)
	// MaxWait far above the default 100ms: a request waits for the tag's
	// first segment, which on a busy machine takes longer (503 otherwise).
	alloc, err := segment.New(segment.Settings{Store: store, MaxWait: 10 * time.Second, Logger: quiet})
	if err != nil {
		tb.Fatal(err)
	}
	svc, err := dispenser.New(dispenser.Config{Conn: testenv.Connect(tb, ns), Segments: alloc, Logger: quiet})
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		svc.Stop(context.Background())
		alloc.Close(context.Background())
	})
	return testenv.Connect(tb, ns), ns
}

func newClient(tb testing.TB, nc *nats.Conn, opts ...client.Option) *client.Client {
	tb.Helper()
	c, err := client.New(nc, opts...)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(c.Close)
	return c
}

func TestSegment(t *testing.T) {
	nc, _ := serve(t, map[string]int64{"orders": 100})
	c := newClient(t, nc)
	ctx := context.Background()
	id, err := c.Segment(ctx, "orders")
	if err != nil || id != 1 {
		t.Fatalf("Segment = %d, %v; want 1", id, err)
	}
	ids, err := c.SegmentN(ctx, "orders", 250)
	if err != nil {
		t.Fatal(err)
	}
	if len(ids) != 250 || ids[0] != 2 || ids[249] != 251 {
		t.Fatalf("SegmentN: %d IDs from %d to %d, want 250 from 2 to 251", len(ids), ids[0], ids[len(ids)-1])
	}
}

func TestErrors(t *testing.T) {
	nc, _ := serve(t, map[string]int64{"orders": 100})
	c := newClient(t, nc)
	ctx := context.Background()
	tests := []struct {
		name string
		call func() error
		want error
		code string
	}{
		{"unknown tag", func() error { _, err := c.Segment(ctx, "nope"); return err }, client.ErrUnknownTag, "404"},
		{"invalid tag", func() error { _, err := c.Segment(ctx, "a$b"); return err }, client.ErrBadRequest, ""},
		{"tag with a space", func() error { _, err := c.SegmentN(ctx, "a b", 2); return err }, client.ErrBadRequest, ""},
		{"batch too big", func() error { _, err := c.SegmentN(ctx, "orders", 10001); return err }, client.ErrBadRequest, "400"},
		{"count below one", func() error { _, err := c.SegmentN(ctx, "orders", 0); return err }, client.ErrBadRequest, ""},
		{"no snowflake endpoint", func() error { _, err := c.Snowflake(ctx); return err }, nats.ErrNoResponders, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.call()
			if !errors.Is(err, tt.want) {
				t.Fatalf("err = %v, want %v", err, tt.want)
			}
			var e *client.Error
			if tt.code != "" && (!errors.As(err, &e) || e.Code != tt.code) {
				t.Fatalf("err = %v, want a *client.Error with code %s", err, tt.code)
			}
		})
	}
}

func TestPrefetchUniqueUnderConcurrency(t *testing.T) {
	nc, _ := serve(t, map[string]int64{"orders": 1000})
	c := newClient(t, nc, client.WithPrefetch(500))
	plain := newClient(t, nc)
	const goroutines, per = 8, 3000
	var mu sync.Mutex
	seen := map[int64]bool{}
	var wg sync.WaitGroup
	for g := range goroutines {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx := context.Background()
			for i := range per {
				var id int64
				var err error
				if g == 0 && i%10 == 0 {
					id, err = plain.Segment(ctx, "orders") // a client without prefetch alongside
				} else {
					id, err = c.Segment(ctx, "orders")
				}
				if err != nil {
					t.Error(err)
					return
				}
				mu.Lock()
				if seen[id] {
					t.Errorf("duplicate ID %d", id)
				}
				seen[id] = true
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	if len(seen) != goroutines*per {
		t.Fatalf("%d distinct IDs, want %d", len(seen), goroutines*per)
	}
}

func TestPrefetchUnknownTagFails(t *testing.T) {
	nc, _ := serve(t, map[string]int64{"orders": 100})
	c := newClient(t, nc, client.WithPrefetch(100))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := c.Segment(ctx, "nope"); !errors.Is(err, client.ErrUnknownTag) {
		t.Fatalf("err = %v, want ErrUnknownTag", err)
	}
}

func TestNewRejectsBadOptions(t *testing.T) {
	nc, _ := serve(t, nil)
	tests := []struct {
		name string
		opt  client.Option
	}{
		{"empty prefix", client.WithPrefix("")},
		{"zero timeout", client.WithTimeout(0)},
		{"prefetch of one", client.WithPrefetch(1)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if _, err := client.New(nc, tt.opt); err == nil {
				t.Fatal("New accepted a bad option")
			}
		})
	}
	if _, err := client.New(nil); err == nil {
		t.Fatal("New accepted a nil connection")
	}
}

func BenchmarkSegmentPrefetch(b *testing.B) {
	nc, _ := serve(b, map[string]int64{"orders": 1_000_000})
	c := newClient(b, nc, client.WithPrefetch(10000))
	ctx := context.Background()
	if _, err := c.Segment(ctx, "orders"); err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		if _, err := c.Segment(ctx, "orders"); err != nil {
			b.Fatal(err)
		}
	}
}

func TestErrorCodes(t *testing.T) {
	tests := []struct {
		code string
		want error
	}{
		{"400", client.ErrBadRequest},
		{"404", client.ErrUnknownTag},
		{"410", client.ErrExhausted},
		{"503", client.ErrUnavailable},
		{"500", client.ErrInternal},
		{"599", client.ErrInternal},
	}
	all := []error{client.ErrBadRequest, client.ErrUnknownTag, client.ErrExhausted, client.ErrUnavailable, client.ErrInternal}
	for _, tt := range tests {
		t.Run(tt.code, func(t *testing.T) {
			err := error(&client.Error{Code: tt.code})
			for _, sentinel := range all {
				if got, want := errors.Is(err, sentinel), sentinel == tt.want; got != want {
					t.Errorf("errors.Is(%s, %v) = %v, want %v", tt.code, sentinel, got, want)
				}
			}
		})
	}
}

// BenchmarkSegment compares a Client's Segment call, which sends a token
// and checks its echo, with a raw NATS request for the same tag (no token,
// no checks), and with a token only, against the same worker in the same
// run: the token's cost is the ratio of the first two.
func BenchmarkSegment(b *testing.B) {
	nc, _ := serve(b, map[string]int64{"orders": 1_000_000})
	c := newClient(b, nc)
	ctx := context.Background()
	b.Run("raw-request", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, err := nc.Request("id.segment.orders", nil, 5*time.Second); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("raw-request-with-token", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			tok := client.NewTokenForTest()
			resp, err := nc.Request("id.segment.orders", []byte("1 "+tok), 5*time.Second)
			if err != nil {
				b.Fatal(err)
			}
			if got, _, _, _ := protocol.CutTokenLine(resp.Data); string(got) != tok {
				b.Fatal(resp, err)
			}
		}
	})
	b.Run("client", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, err := c.Segment(ctx, "orders"); err != nil {
				b.Fatal(err)
			}
		}
	})
}
