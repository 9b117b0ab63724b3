package client_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/dispenser-dev/dispenser/client"
	"github.com/dispenser-dev/dispenser/testenv"
)

// Replies are untrusted input: anything subscribed to the service's
// subjects can answer a request. These tests put a rogue responder (a plain
// NATS subscription) in place of the workers.

const maxID = math.MaxInt64 // 9223372036854775807, a valid snowflake ID

// echo answers m with data as a worker does (answer): the replies of the
// rogue responders below are checked for their bodies, past the token
// check.
func echo(m *nats.Msg, data []byte) error {
	return m.RespondMsg(answer(m, data, ""))
}

// rogue answers every request under prefix with reply (echoing its
// token) and counts the requests it saw.
func rogue(tb testing.TB, nc *nats.Conn, prefix, reply string) *atomic.Int64 {
	tb.Helper()
	var seen atomic.Int64
	sub, err := nc.Subscribe(prefix+".>", func(m *nats.Msg) {
		seen.Add(1)
		if err := echo(m, []byte(reply)); err != nil {
			tb.Errorf("rogue responder: %v", err)
		}
	})
	if err != nil {
		tb.Fatal(err)
	}
	if err := nc.Flush(); err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { _ = sub.Unsubscribe() })
	return &seen
}

// callTimeout bounds each call through the context, so that a client
// waiting for a reply it will not get fails with DeadlineExceeded;
// hangAfter catches a client that loops on a reply and never looks at its
// context again.
const (
	callTimeout = 10 * time.Second
	hangAfter   = 30 * time.Second
)

// within runs call and returns its result. A client that does not return
// at all (the old range expansion spun through 2^64 values, appending each)
// would exhaust the memory of the whole machine while the remaining tests
// run, so this stops the test binary with a panic instead of failing one
// test.
func within(tb testing.TB, name string, call func(ctx context.Context) ([]int64, error)) ([]int64, error) {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
	defer cancel()
	type result struct {
		ids []int64
		err error
	}
	done := make(chan result, 1)
	go func() {
		ids, err := call(ctx)
		done <- result{ids, err}
	}()
	select {
	case r := <-done:
		return r.ids, r.err
	case <-time.After(hangAfter):
		panic(fmt.Sprintf("%s: the client did not return within %v (context timeout %v): it loops on the reply", name, hangAfter, callTimeout))
	}
}

// calls of the Client: how many IDs each asks for and in which format.
type call struct {
	name string
	do   func(c *client.Client, ctx context.Context) ([]int64, error)
}

func one(id int64, err error) ([]int64, error) {
	if err != nil {
		return nil, err
	}
	return []int64{id}, nil
}

var (
	segmentOne   = call{"Segment", func(c *client.Client, ctx context.Context) ([]int64, error) { return one(c.Segment(ctx, "orders")) }}
	snowflakeOne = call{"Snowflake", func(c *client.Client, ctx context.Context) ([]int64, error) { return one(c.Snowflake(ctx)) }}
)

func segmentN(n int) call {
	return call{fmt.Sprintf("SegmentN(%d)", n), func(c *client.Client, ctx context.Context) ([]int64, error) { return c.SegmentN(ctx, "orders", n) }}
}

func snowflakeN(n int) call {
	return call{fmt.Sprintf("SnowflakeN(%d)", n), func(c *client.Client, ctx context.Context) ([]int64, error) { return c.SnowflakeN(ctx, n) }}
}

func TestRogueReplies(t *testing.T) {
	ns := testenv.NATS(t)
	responder := testenv.Connect(t, ns)
	nc := testenv.Connect(t, ns)
	top := fmt.Sprint(int64(maxID))
	tests := []struct {
		name  string
		call  call
		reply string
	}{
		// The wrap at 2^63-1: the old client looped forever on these.
		{"2^63-1 alone, two asked", snowflakeN(2), top},
		{"range ending at 2^63-1, more than asked", segmentN(3), "9223372036854775800-" + top},
		{"range ending at 2^63-1, fewer than asked", segmentN(10), "9223372036854775800-" + top},
		{"one-ID range at 2^63-1, two asked", segmentN(2), top + "-" + top},
		{"huge range", segmentN(10), "1-" + top},
		{"huge range from 0", snowflakeN(10), "0-" + top},
		{"huge range in the middle", segmentN(4), "1-1\n2-9223372036854775000\n9223372036854775001-9223372036854775002"},
		// Counts.
		{"more IDs than asked", segmentN(3), "1-4"},
		{"more IDs than asked, second run", segmentN(3), "1-2\n4-5"},
		{"more IDs than asked, list", segmentOne, "1\n2"},
		{"more IDs than asked, snowflake list", snowflakeOne, "7\n8"},
		{"fewer IDs than asked", segmentN(3), "1-2"},
		{"fewer IDs than asked, snowflake", snowflakeN(3), "5-6"},
		// Runs that overlap, repeat or go backwards.
		{"overlapping runs", segmentN(4), "1-2\n2-3"},
		{"repeated run", segmentN(4), "1-2\n1-2"},
		{"run inside a run", segmentN(5), "1-4\n2-2"},
		{"runs going down", segmentN(4), "5-6\n1-2"},
		{"reversed run", segmentN(2), "3-2"},
		{"reversed run at 2^63-1", segmentN(2), top + "-9223372036854775806"},
		// Numbers the protocol does not allow.
		{"negative ID", segmentOne, "-5"},
		{"negative snowflake ID", snowflakeOne, "-1"},
		{"negative range", segmentN(3), "-3--1"},
		{"range from negative", segmentN(3), "-1-1"},
		{"most negative", snowflakeOne, "-9223372036854775808"},
		{"segment ID 0", segmentOne, "0"},
		{"segment range from 0", segmentN(2), "0-1"},
		{"2^63", snowflakeOne, "9223372036854775808"},
		{"range to 2^63", segmentN(2), "9223372036854775807-9223372036854775808"},
		{"twenty digits", segmentOne, "99999999999999999999"},
		// Garbage and formats.
		{"garbage", segmentOne, "x"},
		{"garbage range", segmentN(2), "a-b"},
		{"trailing garbage", segmentOne, "1x"},
		{"plus sign", segmentOne, "+1"},
		{"leading zero", segmentOne, "01"},
		{"underscore", segmentOne, "1_0"},
		{"hexadecimal", segmentOne, "0x10"},
		{"exponent", segmentOne, "1e3"},
		{"leading space", segmentOne, " 1"},
		{"trailing space", segmentOne, "1 "},
		{"carriage return", segmentN(2), "1-2\r"},
		{"range in a list reply", segmentOne, "1-1"},
		{"single ID in a range reply", segmentN(2), "1"},
		{"a run for one ID asked as a list", segmentN(1), "1-1"},
		{"three parts", segmentN(2), "1-2-3"},
		{"range without a last", segmentN(2), "1-"},
		{"empty body", segmentOne, ""},
		{"empty body, range", segmentN(2), ""},
		{"empty line", segmentN(2), "1-1\n\n2-2"},
		{"trailing newline", segmentN(2), "1-2\n"},
		{"only a newline", segmentOne, "\n"},
		{"NUL byte", segmentOne, "1\x00"},
		{"long body", segmentN(2), "1-2\n" + strings.Repeat("3-3\n", 100_000)},
		{"long number", segmentOne, strings.Repeat("1", 100_000)},
		{"JSON", snowflakeOne, `{"id":1}`},
	}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			prefix := fmt.Sprintf("rogue%d", i)
			seen := rogue(t, responder, prefix, tt.reply)
			c := newClient(t, nc, client.WithPrefix(prefix))
			ids, err := within(t, tt.name, func(ctx context.Context) ([]int64, error) { return tt.call.do(c, ctx) })
			if !errors.Is(err, client.ErrBadReply) {
				t.Fatalf("%s with reply %.60q: IDs %v, err = %v; want ErrBadReply", tt.call.name, tt.reply, head(ids), err)
			}
			if ids != nil {
				t.Errorf("%s returned IDs %v with its error; want none", tt.call.name, head(ids))
			}
			if got := seen.Load(); got != 1 {
				t.Errorf("rogue saw %d requests, want 1", got)
			}
		})
	}
}

// TestEdgeReplies checks that the checks refuse nothing the service may
// send, 2^63-1 and snowflake ID 0 included.
func TestEdgeReplies(t *testing.T) {
	ns := testenv.NATS(t)
	responder := testenv.Connect(t, ns)
	nc := testenv.Connect(t, ns)
	tests := []struct {
		name  string
		call  call
		reply string
		want  []int64
	}{
		{"2^63-1 alone", snowflakeOne, "9223372036854775807", []int64{maxID}},
		{"2^63-1 as a segment ID", segmentOne, "9223372036854775807", []int64{maxID}},
		{"range ending at 2^63-1", snowflakeN(3), "9223372036854775805-9223372036854775807", []int64{maxID - 2, maxID - 1, maxID}},
		{"two runs ending at 2^63-1", segmentN(3), "9223372036854775800-9223372036854775801\n9223372036854775807-9223372036854775807", []int64{maxID - 7, maxID - 6, maxID}},
		{"one ID of a batch at 2^63-1 (asked as a list)", segmentN(1), "9223372036854775807", []int64{maxID}},
		{"snowflake ID 0", snowflakeOne, "0", []int64{0}},
		{"snowflake range from 0", snowflakeN(2), "0-1", []int64{0, 1}},
		{"segment ID 1", segmentOne, "1", []int64{1}},
		{"adjacent runs", segmentN(4), "1-2\n3-4", []int64{1, 2, 3, 4}},
		{"segment boundary", segmentN(4), "8-9\n21-22", []int64{8, 9, 21, 22}},
	}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			prefix := fmt.Sprintf("edge%d", i)
			rogue(t, responder, prefix, tt.reply)
			c := newClient(t, nc, client.WithPrefix(prefix))
			ids, err := within(t, tt.name, func(ctx context.Context) ([]int64, error) { return tt.call.do(c, ctx) })
			if err != nil || !slices.Equal(ids, tt.want) {
				t.Fatalf("%s with reply %q = %v, %v; want %v", tt.call.name, tt.reply, ids, err, tt.want)
			}
		})
	}
}

// TestPrefetchRogueReplies checks the refills of WithPrefetch, which ask
// for the prefetch batch with Id-Format: range: a bad refill is an error
// of the Segment call waiting for it, and none of its IDs are handed out.
func TestPrefetchRogueReplies(t *testing.T) {
	ns := testenv.NATS(t)
	responder := testenv.Connect(t, ns)
	nc := testenv.Connect(t, ns)
	const batch = 10
	tests := []struct {
		name  string
		reply string
	}{
		{"2^63-1 alone", "9223372036854775807"},
		{"one-ID range at 2^63-1", "9223372036854775807-9223372036854775807"},
		{"range ending at 2^63-1, more than asked", "9223372036854775790-9223372036854775807"},
		{"huge range", "1-9223372036854775807"},
		{"huge range from 0", "0-9223372036854775807"},
		{"more IDs than asked", "1-11"},
		{"fewer IDs than asked", "1-9"},
		{"overlapping runs", "1-6\n6-10"},
		{"repeated run", "1-5\n1-5"},
		{"runs going down", "6-10\n1-5"},
		{"negative", "-10--1"},
		{"from 0", "0-9"},
		{"list instead of ranges", "1\n2\n3\n4\n5\n6\n7\n8\n9\n10"},
		{"garbage", "x"},
		{"empty body", ""},
	}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			prefix := fmt.Sprintf("prefetch%d", i)
			rogue(t, responder, prefix, tt.reply)
			c := newClient(t, nc, client.WithPrefix(prefix), client.WithPrefetch(batch))
			// The first call waits for the first refill; so does every
			// later one, as no refill succeeds.
			for call := range 3 {
				ids, err := within(t, tt.name, func(ctx context.Context) ([]int64, error) { return one(c.Segment(ctx, "orders")) })
				if !errors.Is(err, client.ErrBadReply) {
					t.Fatalf("call %d: Segment with refill reply %.60q = %v, %v; want ErrBadReply", call, tt.reply, ids, err)
				}
			}
		})
	}
}

// TestPrefetchEdgeReply checks that a refill ending at 2^63-1 is handed out
// to its end and no further.
func TestPrefetchEdgeReply(t *testing.T) {
	ns := testenv.NATS(t)
	responder := testenv.Connect(t, ns)
	nc := testenv.Connect(t, ns)
	const batch = 4
	// Two runs, the second ending at 2^63-1; the refill started when half
	// is used gets a reply without IDs, so the pool ends at 2^63-1.
	var n atomic.Int64
	sub, err := responder.Subscribe("edge.>", func(m *nats.Msg) {
		reply := "x"
		if n.Add(1) == 1 {
			reply = "9223372036854775803-9223372036854775804\n9223372036854775806-9223372036854775807"
		}
		_ = echo(m, []byte(reply))
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	if err := responder.Flush(); err != nil {
		t.Fatal(err)
	}
	c := newClient(t, nc, client.WithPrefix("edge"), client.WithPrefetch(batch))
	var got []int64
	for range batch {
		ids, err := within(t, "prefetch edge", func(ctx context.Context) ([]int64, error) { return one(c.Segment(ctx, "orders")) })
		if err != nil {
			t.Fatalf("after %v: %v", got, err)
		}
		got = append(got, ids...)
	}
	if want := []int64{maxID - 4, maxID - 3, maxID - 1, maxID}; !slices.Equal(got, want) {
		t.Fatalf("got %v, want %v", got, want)
	}
	_, err = within(t, "prefetch edge, past the end", func(ctx context.Context) ([]int64, error) { return one(c.Segment(ctx, "orders")) })
	if !errors.Is(err, client.ErrBadReply) {
		t.Fatalf("Segment past the end: err = %v, want ErrBadReply", err)
	}
}

func head(ids []int64) []int64 {
	if len(ids) > 5 {
		return ids[:5]
	}
	return ids
}

// TestCountAboveProtocol checks that a count the service cannot read (more
// than nine digits) is refused before anything is sent, so that no reply
// can make the client build a slice that large.
func TestCountAboveProtocol(t *testing.T) {
	ns := testenv.NATS(t)
	responder := testenv.Connect(t, ns)
	nc := testenv.Connect(t, ns)
	seen := rogue(t, responder, "big", "x")
	c := newClient(t, nc, client.WithPrefix("big"))
	for _, call := range []call{segmentN(1_000_000_000), snowflakeN(1_000_000_000), segmentN(math.MaxInt)} {
		t.Run(call.name, func(t *testing.T) {
			_, err := within(t, call.name, func(ctx context.Context) ([]int64, error) { return call.do(c, ctx) })
			var e *client.Error
			if !errors.Is(err, client.ErrBadRequest) || errors.As(err, &e) {
				t.Fatalf("err = %v, want a local ErrBadRequest", err)
			}
		})
	}
	if got := seen.Load(); got != 0 {
		t.Fatalf("%d requests sent, want 0", got)
	}
	if _, err := client.New(nc, client.WithPrefetch(1_000_000_000)); err == nil {
		t.Fatal("New accepted a prefetch batch of ten digits")
	}
}
