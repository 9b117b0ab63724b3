package upgrade

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/dispenser-dev/dispenser/client"
	"github.com/dispenser-dev/dispenser/internal/tests/check"
	"github.com/dispenser-dev/dispenser/internal/tests/faultnet"
	"github.com/dispenser-dev/dispenser/protocol"
	"github.com/dispenser-dev/dispenser/testenv"
)

// beforeBodyTokens is the last commit whose workers read a request's
// token only in protocol.TokenHeader: they answer a token in the body
// ("1 <token>") with 400, a bad count, and echo a forwarded request's
// token in the header.
const beforeBodyTokens = "08832e7e2c5fe4b46d7638d5d60a9715c666dce9"

// TestClientBeforeBodyTokens: the current Go client, which sends its token
// in the body, against workers older than that (built from the git
// history), alone and beside a current worker: every call succeeds. Alone,
// the older worker answers the first request 400 without the token, and the
// client sends it again with the token in the header (and keeps to the
// header for a while); beside a current worker, a request with the token
// in its body that the current worker forwards to the older owner of an
// ordered tag is answered with the token in the header, which the client
// accepts. No ID twice; the ordered tag's IDs increase.
func TestClientBeforeBodyTokens(t *testing.T) {
	t.Parallel()
	old := previousBinary(t, beforeBodyTokens)
	cur := currentBinary(t)
	c := faultnet.NewCluster(t, 3, faultnet.ClusterOptions{}) // the workers ask for R3 buckets
	pgURL := testenv.Postgres(t)
	run(t, old, "migrate", "--postgres-url", pgURL)
	run(t, old, "tags", "create", "plain", "--step", "100", "--postgres-url", pgURL)
	run(t, old, "tags", "create", "orders", "--step", "100", "--ordered", "--postgres-url", pgURL)
	f := newFleet(t, c, pgURL)
	f.start(old, "previous", 0)

	var segment, snowflake, ordered []check.Observation
	// calls makes n rounds of calls, each with a new client of nc: one
	// that sends its first request with the token in the body.
	calls := func(t *testing.T, nc *nats.Conn, n int) {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		for range n {
			cl, err := client.New(nc)
			if err != nil {
				t.Fatal(err)
			}
			start := time.Now()
			id, err := cl.Segment(ctx, "orders")
			if err != nil {
				t.Fatalf("ordered: %v", err)
			}
			ordered = append(ordered, check.Observation{IDs: []int64{id}, Start: start, End: time.Now()})
			if id, err = cl.Segment(ctx, "plain"); err != nil {
				t.Fatalf("plain: %v", err)
			}
			segment = append(segment, check.Observation{IDs: []int64{id}})
			ids, err := cl.SegmentN(ctx, "plain", 3)
			if err != nil {
				t.Fatalf("plain, 3: %v", err)
			}
			segment = append(segment, check.Observation{IDs: ids})
			if id, err = cl.Snowflake(ctx); err != nil {
				t.Fatalf("snowflake: %v", err)
			}
			snowflake = append(snowflake, check.Observation{IDs: []int64{id}})
		}
	}

	// The premise: the older worker refuses a body token, without
	// echoing it.
	nc0 := testenv.Connect(t, c.Servers[0])
	resp, err := nc0.Request("id.segment.plain", []byte("1 premise"), 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if code := resp.Header.Get(protocol.ErrorCodeHeader); code != protocol.CodeBadRequest || resp.Header.Get(protocol.TokenHeader) != "" {
		t.Fatalf("the older worker answered a body token with code %q, token %q: not the 400 without a token this test is about",
			code, resp.Header.Get(protocol.TokenHeader))
	}
	t.Run("older workers alone", func(t *testing.T) { calls(t, nc0, 50) })

	// A current worker on the other server: a client there is served by
	// it (a queue group prefers the members on the requester's server),
	// and its requests for the ordered tag, which the older worker owns
	// (it served them above), are forwarded to that owner.
	f.start(cur, "current", 1)
	nc1 := testenv.Connect(t, c.Servers[1])
	t.Run("forwarded to an older owner", func(t *testing.T) {
		forwarded := 0
		for i := range 200 {
			tok := "fwd" + string(rune('a'+i%26)) + string(rune('a'+i/26))
			resp, err := nc1.RequestMsg(&nats.Msg{Subject: "id.segment.orders", Data: []byte("1 " + tok), Header: nats.Header{protocol.WorkerHeader: {"1"}}}, 10*time.Second)
			if err != nil {
				t.Fatal(err)
			}
			if code := resp.Header.Get(protocol.ErrorCodeHeader); code != "" {
				continue // the older worker's 400, or a 503 while the owner settles
			}
			if got := resp.Header.Get(protocol.TokenHeader); got != tok {
				t.Fatalf("reply with IDs (body %q) carries %s %q, want %q", resp.Data, protocol.TokenHeader, got, tok)
			}
			forwarded++
		}
		if forwarded == 0 {
			t.Fatal("no request reached the older owner through the current worker")
		}
		// Each round's first request reaches either worker: the older
		// one answers 400 (the client goes to the header), the current
		// one forwards it with the token in the body to the older owner,
		// which echoes it in the header.
		calls(t, nc1, 50)
	})

	for name, obs := range map[string][]check.Observation{"segment": segment, "snowflake": snowflake, "ordered": ordered} {
		if u := check.Unique(obs); len(u.Duplicates) > 0 || u.IDs != len(obs) && name != "segment" {
			t.Errorf("%s IDs: %d received, %d duplicated, e.g. %+v", name, u.IDs, len(u.Duplicates), u.Duplicates[:min(len(u.Duplicates), 3)])
		}
	}
	if n, examples := check.Linearizable(ordered); n > 0 {
		t.Errorf("ordered IDs: %d requests got an ID not above one that ended before they started, e.g. %+v", n, examples)
	}
}
