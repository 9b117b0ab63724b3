package client_test

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/dispenser-dev/dispenser/client"
	"github.com/dispenser-dev/dispenser/internal/tests/wait"
	"github.com/dispenser-dev/dispenser/protocol"
	"github.com/dispenser-dev/dispenser/testenv"
)

// TestRepliesWithoutTheToken: a reply that does not carry the request's
// token (protocol.TokenHeader) is not a reply to it, whatever it holds:
// every call fails with ErrBadReply, uses none of its IDs and does not
// retry it (an error reply included), prefetch refills too.
func TestRepliesWithoutTheToken(t *testing.T) {
	ns := testenv.NATS(t)
	responder := testenv.Connect(t, ns)
	nc := testenv.Connect(t, ns)
	formatted := call{"Formatted", func(c *client.Client, ctx context.Context) ([]int64, error) {
		s, err := c.Formatted(ctx, "orders", 1)
		if s != nil {
			return []int64{-1}, err
		}
		return nil, err
	}}
	prefetched := call{"Segment with prefetch", func(c *client.Client, ctx context.Context) ([]int64, error) {
		return one(c.Segment(ctx, "orders"))
	}}
	none := func(string) []string { return nil }
	tests := []struct {
		name  string
		call  call
		token func(sent string) []string // the reply's TokenHeader values
		line  func(sent string) string   // the reply's first line, if not nil
		body  string
		code  string // the reply's error code
		sends int    // requests the call sends (0: 1)
	}{
		{"no token", segmentOne, none, nil, "1", "", 0},
		{"no token, batch", segmentN(3), none, nil, "1-3", "", 0},
		{"no token, snowflake", snowflakeOne, none, nil, "7", "", 0},
		{"no token, formatted", formatted, none, nil, "ORD-1", "", 0},
		{"no token, prefetch refill", prefetched, none, nil, "1-10", "", 0},
		{"no token, 503", segmentOne, none, nil, "", protocol.CodeUnavailable, 0},
		// A 400 without the token is what a worker older than body
		// tokens answers: the request goes again with the token in its
		// header, whose reply must echo it there.
		{"no token, 400", segmentOne, none, nil, "", protocol.CodeBadRequest, 2},
		{"empty token", segmentOne, func(string) []string { return []string{""} }, nil, "1", "", 0},
		{"another token", segmentOne, func(string) []string { return []string{"AAAAAAAAAAAAAAAAAAAAAA"} }, nil, "1", "", 0},
		{"another token, prefetch refill", prefetched, func(string) []string { return []string{"AAAAAAAAAAAAAAAAAAAAAA"} }, nil, "1-10", "", 0},
		{"the token and another", segmentOne, func(s string) []string { return []string{s, "x"} }, nil, "1", "", 0},
		{"the token twice", segmentOne, func(s string) []string { return []string{s, s} }, nil, "1", "", 0},
		{"the token's prefix", segmentOne, func(s string) []string { return []string{s[:len(s)-1]} }, nil, "1", "", 0},
		{"another token line", segmentOne, none, func(string) string { return "AAAAAAAAAAAAAAAAAAAAAA" }, "1", "", 0},
		{"another token line, snowflake", snowflakeOne, none, func(string) string { return "AAAAAAAAAAAAAAAAAAAAAA" }, "7", "", 0},
		{"another token line, formatted", formatted, none, func(string) string { return "AAAAAAAAAAAAAAAAAAAAAA" }, "ORD-1", "", 0},
		{"another token line, prefetch refill", prefetched, none, func(string) string { return "AAAAAAAAAAAAAAAAAAAAAA" }, "1-10", "", 0},
		{"the token's prefix line", segmentOne, none, func(s string) string { return s[:len(s)-1] }, "1", "", 0},
		{"the token with more", segmentOne, none, func(s string) string { return s + "x" }, "1", "", 0},
		{"the token after a space", segmentOne, none, func(s string) string { return " " + s }, "1", "", 0},
		{"the token on the second line", segmentOne, none, func(s string) string { return "\n" + s }, "1", "", 0},
		{"the token line, another header token", segmentOne, func(string) []string { return []string{"AAAAAAAAAAAAAAAAAAAAAA"} }, func(s string) string { return s }, "1", "", 0},
		{"an empty line", segmentOne, none, func(string) string { return "" }, "1", "", 0},
	}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			prefix := fmt.Sprintf("forged%d", i)
			var seen atomic.Int64
			sub, err := responder.Subscribe(prefix+".>", func(m *nats.Msg) {
				seen.Add(1)
				sent, _ := protocol.RequestToken(m.Header, m.Data)
				resp := &nats.Msg{Subject: m.Reply, Data: []byte(tt.body), Header: nats.Header{}}
				if tt.line != nil {
					resp.Data = []byte(tt.line(sent) + "\n" + tt.body)
				}
				if v := tt.token(sent); v != nil {
					resp.Header[protocol.TokenHeader] = v
				}
				if tt.code != "" {
					resp.Header.Set(protocol.ErrorCodeHeader, tt.code)
				}
				_ = m.RespondMsg(resp)
			})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = sub.Unsubscribe() })
			if err := responder.Flush(); err != nil {
				t.Fatal(err)
			}
			opts := []client.Option{client.WithPrefix(prefix)}
			if tt.call.name == prefetched.name {
				opts = append(opts, client.WithPrefetch(10))
			}
			c := newClient(t, nc, opts...)
			ids, err := within(t, tt.name, func(ctx context.Context) ([]int64, error) { return tt.call.do(c, ctx) })
			if !errors.Is(err, client.ErrBadReply) || ids != nil {
				t.Fatalf("%s: IDs %v, err %v; want ErrBadReply and no IDs", tt.call.name, ids, err)
			}
			if got, want := seen.Load(), int64(max(tt.sends, 1)); got != want {
				t.Errorf("%d requests sent, want %d: a reply without the token is not retried", got, want)
			}
		})
	}
}

// TestForgedReplyWithObservedToken: a tenant that reads the victim's
// inbox (today's documented `subscribe: ["_INBOX.>"]`) sees every earlier
// reply and its token, and (from nats.go's clock-seeded request tokens)
// can know the reply subject of the next request. A reply it publishes
// there first, with any token it has seen, is refused: the victim's call
// fails with ErrBadReply and holds none of the forged IDs; the tokens of
// a thousand requests are all different.
func TestForgedReplyWithObservedToken(t *testing.T) {
	ns := testenv.NATS(t)
	victim := testenv.Connect(t, ns)
	attacker := testenv.Connect(t, ns)
	worker := testenv.Connect(t, ns)

	// The attacker reads every inbox and remembers every token it sees.
	var mu sync.Mutex // protects tokens
	tokens := map[string]bool{}
	spy, err := attacker.Subscribe("_INBOX.>", func(m *nats.Msg) {
		if tok, _, _, ok := protocol.CutTokenLine(m.Data); ok {
			mu.Lock()
			tokens[string(tok)] = true
			mu.Unlock()
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = spy.Unsubscribe() })
	if err := attacker.Flush(); err != nil { // the server knows the spy before the first request
		t.Fatal(err)
	}
	// The worker answers with IDs counting up, echoing the token; with
	// forge set the attacker answers instead, at the request's reply
	// subject (which it predicts; handed over here), with a token it saw.
	var next atomic.Int64
	var forge atomic.Bool
	sub, err := worker.Subscribe("id.segment.>", func(m *nats.Msg) {
		if forge.Load() {
			mu.Lock()
			seen := make([]string, 0, len(tokens))
			for tok := range tokens {
				seen = append(seen, tok)
			}
			mu.Unlock()
			forged := &nats.Msg{Subject: m.Reply, Data: []byte(seen[0] + "\n1")}
			if err := attacker.PublishMsg(forged); err != nil {
				t.Error(err)
			}
			return
		}
		_ = echo(m, fmt.Appendf(nil, "%d", next.Add(1)))
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	if err := worker.Flush(); err != nil {
		t.Fatal(err)
	}
	c := newClient(t, victim)
	ctx := context.Background()
	const honest = 1000
	for i := range honest {
		id, err := c.Segment(ctx, "payments")
		if err != nil || id != int64(i+1) {
			t.Fatalf("request %d: %d, %v; want %d", i, id, err, i+1)
		}
	}
	wait.For(t, 30*time.Second, "the attacker saw every token", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(tokens) == honest
	})
	forge.Store(true)
	for range 20 {
		if id, err := c.Segment(ctx, "payments"); !errors.Is(err, client.ErrBadReply) {
			t.Fatalf("a forged reply with an observed token: %d, %v; want ErrBadReply (the victim already holds ID 1)", id, err)
		}
	}
}

// BenchmarkNewToken: what a request's token costs the client (compare
// with BenchmarkRequest*: a request round trip is tens of microseconds).
// crypto/rand.Text is the baseline: 128 bits straight from crypto/rand.
func BenchmarkNewToken(b *testing.B) {
	for _, bb := range []struct {
		name string
		f    func() string
	}{{"chacha8", client.NewTokenForTest}, {"crypto-rand-text", rand.Text}} {
		b.Run(bb.name, func(b *testing.B) {
			b.ReportAllocs()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					bb.f()
				}
			})
		})
	}
}
