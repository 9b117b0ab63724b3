package dispensertest_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/dispenser-dev/dispenser/client"
	"github.com/dispenser-dev/dispenser/dispensertest"
)

// newClient returns a client of s, closed when the test ends.
func newClient(tb testing.TB, s *dispensertest.Server, opts ...client.Option) *client.Client {
	tb.Helper()
	c, err := client.New(s.Conn(), opts...)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(c.Close)
	return c
}

// TestUniqueIDs takes segment and snowflake IDs from many goroutines at
// once, over two connections, and checks that none repeats and that a tag
// given up front starts where it was told.
func TestUniqueIDs(t *testing.T) {
	s := dispensertest.New(t, dispensertest.Options{
		Tags: []dispensertest.Tag{{Name: "orders", Step: 10, Start: 500}, {Name: "ledger", Ordered: true}},
	})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	nc2, err := nats.Connect(s.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer nc2.Close()
	c2, err := client.New(nc2)
	if err != nil {
		t.Fatal(err)
	}
	defer c2.Close()
	clients := []*client.Client{newClient(t, s), c2}

	const goroutines, perGoroutine = 8, 24 // requests of each of the four kinds in turn
	// mu protects seen and errs.
	var mu sync.Mutex
	seen := map[string]map[int64]bool{}
	var errs []error
	var wg sync.WaitGroup
	for g := range goroutines {
		wg.Go(func() {
			c := clients[g%len(clients)]
			for i := range perGoroutine {
				var ids []int64
				var kind string
				var err error
				switch i % 4 {
				case 0:
					kind = "orders"
					ids, err = c.SegmentN(ctx, "orders", 3)
				case 1:
					kind = "ledger"
					ids, err = c.SegmentN(ctx, "ledger", 2)
				case 2:
					kind = "auto"
					var id int64
					id, err = c.Segment(ctx, "auto")
					ids = []int64{id}
				default:
					kind = "snowflake"
					ids, err = c.SnowflakeN(ctx, 5)
				}
				mu.Lock()
				if err != nil {
					errs = append(errs, fmt.Errorf("%s: %w", kind, err))
				}
				if seen[kind] == nil {
					seen[kind] = map[int64]bool{}
				}
				for _, id := range ids {
					if seen[kind][id] {
						errs = append(errs, fmt.Errorf("%s: ID %d handed out twice", kind, id))
					}
					seen[kind][id] = true
				}
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	for _, err := range errs {
		t.Error(err)
	}
	for kind, want := range map[string]int{"orders": 3, "ledger": 2, "auto": 1, "snowflake": 5} {
		if got, wantN := len(seen[kind]), want*goroutines*perGoroutine/4; got != wantN {
			t.Errorf("%s: %d distinct IDs, want %d", kind, got, wantN)
		}
	}
	if !seen["orders"][500] || seen["orders"][499] {
		t.Errorf("orders: want its IDs to start at 500")
	}
	if !seen["auto"][1] {
		t.Errorf("a tag created on first use: want its IDs to start at 1")
	}
}

// TestNoAutoCreate: with NoAutoCreate an unknown tag is ErrUnknownTag, a
// tag given up front is served.
func TestNoAutoCreate(t *testing.T) {
	s := dispensertest.New(t, dispensertest.Options{NoAutoCreate: true, Prefix: "ids",
		Tags: []dispensertest.Tag{{Name: "orders"}}})
	c := newClient(t, s, client.WithPrefix(s.Prefix))
	ctx := context.Background()
	if _, err := c.Segment(ctx, "nope"); !errors.Is(err, client.ErrUnknownTag) {
		t.Errorf("unknown tag: err = %v, want %v", err, client.ErrUnknownTag)
	}
	if id, err := c.Segment(ctx, "orders"); err != nil || id != 1 {
		t.Errorf("orders: got %d, %v, want 1", id, err)
	}
}

// TestClose: after Close nothing answers, and a second Close is harmless.
func TestClose(t *testing.T) {
	s := dispensertest.New(t, dispensertest.Options{})
	nc, err := nats.Connect(s.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	c, err := client.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.Snowflake(context.Background()); err != nil {
		t.Fatalf("before Close: %v", err)
	}
	s.Close()
	s.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	if _, err := c.Snowflake(ctx); err == nil {
		t.Fatal("after Close: got an ID, want an error")
	}
}

// TestBadOptions: options that cannot work fail with ErrOptions before
// anything starts.
func TestBadOptions(t *testing.T) {
	for _, tt := range []struct {
		name string
		o    dispensertest.Options
	}{
		{"bad tag name", dispensertest.Options{Tags: []dispensertest.Tag{{Name: "a.b"}}}},
		{"negative step", dispensertest.Options{Tags: []dispensertest.Tag{{Name: "a", Step: -1}}}},
		{"negative start", dispensertest.Options{Tags: []dispensertest.Tag{{Name: "a", Start: -5}}}},
		{"negative max wait", dispensertest.Options{MaxWait: -time.Second}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			s, err := dispensertest.Start(tt.o)
			if err == nil {
				s.Close()
			}
			if !errors.Is(err, dispensertest.ErrOptions) {
				t.Fatalf("err = %v, want %v", err, dispensertest.ErrOptions)
			}
		})
	}
}
