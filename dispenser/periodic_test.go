package dispenser_test

import (
	"context"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/dispenser-dev/dispenser/client"
	"github.com/dispenser-dev/dispenser/protocol"
	"github.com/dispenser-dev/dispenser/segment"
	"github.com/dispenser-dev/dispenser/segment/kv"
	"github.com/dispenser-dev/dispenser/testenv"
)

// settableClock is a worker's clock that the test sets.
type settableClock struct {
	mu  sync.Mutex // protects now
	now time.Time
}

func (c *settableClock) Now() time.Time     { c.mu.Lock(); defer c.mu.Unlock(); return c.now }
func (c *settableClock) set(now time.Time) { c.mu.Lock(); c.now = now; c.mu.Unlock() }

// TestFormattedOverNATS: a daily tag with a format, on PostgreSQL and on
// the KV store, asked over NATS as `nats req -H Id-Format:formatted
// id.segment.orders 3` asks: three formatted numbers of the day (the
// worker's clock, in the tag's zone), the next day from the tag's start
// again; the plain reply is the day's number; bad uses of the header are
// 400s that take nothing.
func TestFormattedOverNATS(t *testing.T) {
	sh, err := time.LoadLocation("Asia/Shanghai")
	if err != nil {
		t.Fatal(err)
	}
	orders := segment.Tag{Name: "orders", Step: 10, MaxID: 1, Reset: segment.ResetDay, TimeZone: "Asia/Shanghai",
		Format: "ORD-{date:20060102}-{seq:6}"}
	plain := segment.Tag{Name: "plain", Step: 10, MaxID: 1}
	stores := []struct {
		name string
		open func(t *testing.T, st *stack) segment.Store
	}{
		{"postgres", func(t *testing.T, st *stack) segment.Store { return st.store }},
		{"kv", func(t *testing.T, st *stack) segment.Store {
			js, err := jetstream.New(testenv.Connect(t, st.ns))
			if err != nil {
				t.Fatal(err)
			}
			s, err := kv.New(context.Background(), js, kv.Settings{})
			if err != nil {
				t.Fatal(err)
			}
			return s
		}},
	}
	for _, sto := range stores {
		t.Run(sto.name, func(t *testing.T) {
			st := newStack(t, nil)
			st.other = sto.open(t, st)
			for _, tag := range []segment.Tag{orders, plain} {
				if err := st.other.(segment.Admin).CreateTag(context.Background(), tag); err != nil {
					t.Fatal(err)
				}
			}
			clock := &settableClock{now: time.Date(2026, 11, 24, 23, 59, 59, 0, sh)}
			st.worker(t, segment.Settings{Now: clock.Now, MaxWait: 10 * time.Second})
			nc := testenv.Connect(t, st.ns)
			formatted := nats.Header{protocol.FormatHeader: []string{"formatted"}}

			ask := func(subject, body string, hdr nats.Header, want, wantCode string) {
				t.Helper()
				got, code := request(t, nc, subject, body, hdr)
				if code != wantCode || (wantCode == "" && got != want) {
					t.Fatalf("%s %q: %q (code %q), want %q (code %q)", subject, body, got, code, want, wantCode)
				}
			}
			ask("id.segment.orders", "3", formatted, "ORD-20261124-000001\nORD-20261124-000002\nORD-20261124-000003", "")
			ask("id.segment.orders", "", nil, "4", "")
			ask("id.segment.plain", "", formatted, "", protocol.CodeBadRequest)
			ask("id.snowflake", "", formatted, "", protocol.CodeBadRequest)
			ask("id.segment.plain", "", nil, "1", "") // the refusal took nothing
			clock.set(time.Date(2026, 11, 25, 0, 0, 0, 0, sh))
			ask("id.segment.orders", "2", formatted, "ORD-20261125-000001\nORD-20261125-000002", "")
			ask("id.segment.orders", "", formatted, "ORD-20261125-000003", "")
			// The Go client asks the same way.
			c, err := client.New(nc)
			if err != nil {
				t.Fatal(err)
			}
			if got, err := c.Formatted(context.Background(), "orders", 2); err != nil || !slices.Equal(got, []string{"ORD-20261125-000004", "ORD-20261125-000005"}) {
				t.Fatalf("client: %q, %v", got, err)
			}
			if tag, err := st.other.Tag(context.Background(), "orders"); err != nil || tag.MaxID != 1 {
				t.Fatalf("the tag's own row: max_id %d, %v; want 1, the start of every day", tag.MaxID, err)
			}
		})
	}
}
