package dispenser_test

import (
	"context"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/dispenser-dev/dispenser/client"
	"github.com/dispenser-dev/dispenser/protocol"
	"github.com/dispenser-dev/dispenser/segment"
	"github.com/dispenser-dev/dispenser/segment/kv"
	"github.com/dispenser-dev/dispenser/tagmodel"
	"github.com/dispenser-dev/dispenser/testenv"
)

// settableClock is a worker's clock that the test sets.
type settableClock struct {
	mu  sync.Mutex // protects now
	now time.Time
}

func (c *settableClock) Now() time.Time    { c.mu.Lock(); defer c.mu.Unlock(); return c.now }
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
	orders := tagmodel.Tag{Name: "orders", Step: 10, MaxID: 1, Reset: tagmodel.ResetDay, TimeZone: "Asia/Shanghai",
		Format: "ORD-{date:20060102}-{seq:6}"}
	plain := tagmodel.Tag{Name: "plain", Step: 10, MaxID: 1}
	stores := []struct {
		name string
		open func(t *testing.T, st *stack) tagmodel.Store
	}{
		{"postgres", func(t *testing.T, st *stack) tagmodel.Store { return st.store }},
		{"kv", func(t *testing.T, st *stack) tagmodel.Store {
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
			for _, tag := range []tagmodel.Tag{orders, plain} {
				if err := st.other.(tagmodel.Admin).CreateTag(context.Background(), tag); err != nil {
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

// TestSkewedWorkersAcrossMidnightOverNATS: three workers in one queue
// group, on PostgreSQL and on the KV store, whose clocks are up to 300 ms
// apart (well within the bound: the retention, days), answer formatted
// numbers of a daily tag while the time crosses midnight: no formatted
// number twice among all replies, and both days are served.
func TestSkewedWorkersAcrossMidnightOverNATS(t *testing.T) {
	tag := tagmodel.Tag{Name: "orders", Step: 5, MaxID: 1, Reset: tagmodel.ResetDay, Format: "{date:20060102}{seq:6}"}
	for _, sto := range []string{"postgres", "kv"} {
		t.Run(sto, func(t *testing.T) {
			st := newStack(t, nil)
			if sto == "kv" {
				js, err := jetstream.New(testenv.Connect(t, st.ns))
				if err != nil {
					t.Fatal(err)
				}
				if st.other, err = kv.New(context.Background(), js, kv.Settings{}); err != nil {
					t.Fatal(err)
				}
			} else {
				st.other = st.store
			}
			if err := st.other.(tagmodel.Admin).CreateTag(context.Background(), tag); err != nil {
				t.Fatal(err)
			}
			midnight := time.Date(2026, 11, 25, 0, 0, 0, 0, time.UTC)
			var base atomic.Int64 // the true time, advanced by every request
			base.Store(midnight.Add(-300 * time.Millisecond).UnixNano())
			for _, skew := range []time.Duration{-300 * time.Millisecond, 0, 200 * time.Millisecond} {
				now := func() time.Time { return time.Unix(0, base.Load()).Add(skew) }
				st.worker(t, segment.Settings{Now: now, MaxWait: 10 * time.Second, MaxStep: 5})
			}
			formatted := nats.Header{protocol.FormatHeader: []string{"formatted"}}
			var mu sync.Mutex
			seen := map[string]bool{}
			var wg sync.WaitGroup
			for range 6 {
				nc := testenv.Connect(t, st.ns)
				wg.Go(func() {
					for i := range 100 {
						base.Add(int64(time.Millisecond))
						msg := &nats.Msg{Subject: "id.segment.orders", Data: []byte(strconv.Itoa(1 + i%3)), Header: formatted}
						resp, err := nc.RequestMsg(msg, 10*time.Second)
						if err != nil || resp.Header.Get("Nats-Service-Error-Code") != "" {
							t.Errorf("request: %v %v", err, resp.Header)
							return
						}
						mu.Lock()
						for _, s := range strings.Split(string(resp.Data), "\n") {
							if seen[s] {
								t.Errorf("%s twice", s)
							}
							seen[s] = true
						}
						mu.Unlock()
					}
				})
			}
			wg.Wait()
			days := map[string]int{}
			for s := range seen {
				days[s[:8]]++
			}
			if days["20261124"] == 0 || days["20261125"] == 0 {
				t.Errorf("numbers per day %v: want both days served", days)
			}
			t.Logf("%d formatted numbers: %v", len(seen), days)
		})
	}
}
