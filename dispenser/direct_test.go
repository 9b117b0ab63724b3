package dispenser_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/dispenser-dev/dispenser/client"
	"github.com/dispenser-dev/dispenser/internal/tests/check"
	"github.com/dispenser-dev/dispenser/internal/tests/wait"
	"github.com/dispenser-dev/dispenser/protocol"
	"github.com/dispenser-dev/dispenser/tagmodel"
	"github.com/dispenser-dev/dispenser/testenv"
)

// directStats sums the requests the workers served on their direct
// subjects and refused there (421).
func directStats(tb testing.TB, workers []*orderedWorker) (served, misdirected float64) {
	tb.Helper()
	for _, w := range workers {
		families, err := w.reg.Gather()
		if err != nil {
			tb.Fatal(err)
		}
		s, ok1 := metricValue(families, "dispenser_ordered_direct_total", map[string]string{"outcome": "served"})
		m, ok2 := metricValue(families, "dispenser_ordered_direct_total", map[string]string{"outcome": "misdirected"})
		if !ok1 || !ok2 {
			tb.Fatal("dispenser_ordered_direct_total missing")
		}
		served, misdirected = served+s, misdirected+m
	}
	return served, misdirected
}

// ownerOf sends requests for tag, with and without protocol.DirectHeader,
// until one that asked for it is answered with it and returns that header and the worker that owns
// tag.
func ownerOf(tb testing.TB, nc *nats.Conn, workers []*orderedWorker, tag string) (string, *orderedWorker) {
	tb.Helper()
	var direct string
	wait.For(tb, 30*time.Second, "an owner's reply with "+protocol.DirectHeader, func() bool {
		// A request without the header gets none: plain clients' replies
		// are as they were.
		resp, err := nc.Request(protocol.SegmentSubject("id", tag), nil, 10*time.Second)
		if err != nil || resp.Header.Get(protocol.ErrorCodeHeader) != "" {
			return false
		}
		if got := resp.Header.Get(protocol.DirectHeader); got != "" {
			tb.Fatalf("a request without %s got it in its reply: %q", protocol.DirectHeader, got)
		}
		msg := &nats.Msg{Subject: protocol.SegmentSubject("id", tag), Header: nats.Header{protocol.DirectHeader: {"1"}}}
		if resp, err = nc.RequestMsg(msg, 10*time.Second); err != nil || resp.Header.Get(protocol.ErrorCodeHeader) != "" {
			return false
		}
		direct = resp.Header.Get(protocol.DirectHeader)
		return direct != ""
	})
	for _, w := range workers {
		if w.owners.Owns(tag) {
			if want := protocol.DirectSubject("id", tag, w.name); direct != want {
				tb.Fatalf("%s = %q, want the owner's direct subject %q", protocol.DirectHeader, direct, want)
			}
			return direct, w
		}
	}
	tb.Fatalf("nobody owns %s", tag)
	return "", nil
}

// clientLoad runs clients Go clients (which follow protocol.DirectHeader)
// and plain plain NATS clients (which ignore it) asking for tag until stop
// is closed, and returns what each answered request saw. Every request of
// a Go client must succeed: it retries what a move fails; a plain client's
// may fail with 503 during a move.
func clientLoad(tb testing.TB, st *stack, tag string, clients, plain int, stop <-chan struct{}) func() []check.Observation {
	tb.Helper()
	var mu sync.Mutex // protects obs and errs
	var obs []check.Observation
	var errs []error
	var wg sync.WaitGroup
	for i := range clients {
		c, err := client.New(testenv.Connect(tb, st.ns), client.WithTimeout(20*time.Second))
		if err != nil {
			tb.Fatal(err)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			for k := 0; ; k++ {
				select {
				case <-stop:
					return
				default:
				}
				n := 1 + (i+k)%3
				sent := time.Now()
				ids, err := c.SegmentN(context.Background(), tag, n)
				received := time.Now()
				mu.Lock()
				if err != nil {
					errs = append(errs, fmt.Errorf("client %d: %w", i, err))
				} else {
					obs = append(obs, check.Observation{Start: sent, End: received, IDs: ids})
				}
				mu.Unlock()
				if err != nil {
					return
				}
			}
		}()
	}
	for range plain {
		nc := testenv.Connect(tb, st.ns)
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				sent := time.Now()
				resp, err := nc.Request(protocol.SegmentSubject("id", tag), []byte("2"), 10*time.Second)
				received := time.Now()
				if err != nil || resp.Header.Get(protocol.ErrorCodeHeader) != "" {
					continue
				}
				ids, err := decodeIDs(string(resp.Data))
				mu.Lock()
				if err != nil || len(ids) != 2 {
					errs = append(errs, fmt.Errorf("plain client: reply %q (%v), want 2 IDs", resp.Data, err))
				} else {
					obs = append(obs, check.Observation{Start: sent, End: received, IDs: ids})
				}
				mu.Unlock()
			}
		}()
	}
	return func() []check.Observation {
		wg.Wait()
		mu.Lock()
		defer mu.Unlock()
		if err := errors.Join(errs...); err != nil {
			tb.Fatalf("requests failed across the moves: %v", err)
		}
		return obs
	}
}

// TestDirectThroughOwnershipMoves: Go clients learn the owner's direct
// subject from its replies and send there (plain NATS clients keep to the
// queue group alongside); the owner releases the tag
// while it keeps running (its direct subject answers 421 then, and the
// clients go back to the queue group), and the next owner stops
// gracefully (its direct subject goes away). No request fails, no ID is
// handed out twice, and every request sent after another was answered
// gets larger IDs. Seen failing (violations, and IDs twice) with the
// direct path serving without ownership checks (handleDirect calling
// Allocator.TakeOwned and replying, no Owns before or after).
func TestDirectThroughOwnershipMoves(t *testing.T) {
	st := newStack(t, nil)
	if err := st.store.CreateTag(context.Background(), tagmodel.Tag{Name: "seq", Step: 10, MaxID: 1, Ordered: true}); err != nil {
		t.Fatal(err)
	}
	workers := []*orderedWorker{st.orderedWorker(t, "w0"), st.orderedWorker(t, "w1"), st.orderedWorker(t, "w2")}
	nc := testenv.Connect(t, st.ns)
	_, first := ownerOf(t, nc, workers, "seq")

	stop := make(chan struct{})
	collect := clientLoad(t, st, "seq", 6, 2, stop)
	wait.For(t, 30*time.Second, "the clients use the owner's direct subject", func() bool {
		served, _ := directStats(t, workers)
		return served >= 50
	})
	first.owners.Release("seq") // first keeps running: its direct subject answers 421
	_, second := ownerOf(t, nc, workers, "seq")
	before, _ := directStats(t, workers)
	wait.For(t, 30*time.Second, "the clients use the next owner's direct subject", func() bool {
		served, _ := directStats(t, workers)
		return served >= before+50
	})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	second.owners.Close() // a graceful stop: hand over, then drain
	if err := second.svc.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	live := slices.DeleteFunc(slices.Clone(workers), func(w *orderedWorker) bool { return w == second })
	ownerOf(t, nc, live, "seq")
	before, _ = directStats(t, live)
	wait.For(t, 30*time.Second, "the clients use the third owner's direct subject", func() bool {
		served, _ := directStats(t, live)
		return served >= before+50
	})
	close(stop)
	obs := collect()
	checkUnique(t, obs)
	if n, ex := check.Linearizable(obs); n != 0 {
		t.Fatalf("%d of %d requests broke linearizable increase across the moves: %s", n, len(obs), example(ex))
	}
	served, misdirected := directStats(t, workers)
	t.Logf("%d requests; %v served on direct subjects, %v misdirected", len(obs), served, misdirected)
}

// TestDirectRefusals: requests on a direct subject that a worker must not
// serve there: a hostile reply subject gets no answer at all, a malformed
// one 400, a tag the worker does not own (another tag's token, or any
// tag on a worker that owns nothing) 421; none takes an ID (the owner's
// next ID follows the last one it handed out). Seen failing with the
// ownership check removed from the direct path (the other tag's request
// got IDs; with Step 10 the next ID no longer followed) and with Admit
// removed (the purge subject got a reply).
func TestDirectRefusals(t *testing.T) {
	st := newStack(t, map[string]int64{"plain": 10})
	for _, tag := range []string{"seq", "other"} {
		if err := st.store.CreateTag(context.Background(), tagmodel.Tag{Name: tag, Step: 10, MaxID: 1, Ordered: true}); err != nil {
			t.Fatal(err)
		}
	}
	workers := []*orderedWorker{st.orderedWorker(t, "w0"), st.orderedWorker(t, "w1")}
	nc := testenv.Connect(t, st.ns)
	direct, owner := ownerOf(t, nc, workers, "seq")
	nonOwner := workers[0]
	if nonOwner == owner {
		nonOwner = workers[1]
	}
	if rt, err := nonOwner.owners.Claim(context.Background(), "other"); err != nil || !rt.Self {
		t.Fatalf("claiming other: %+v, %v", rt, err)
	}
	// Replies the worker must never publish to: watched here.
	const purge, forged = "$JS.API.STREAM.PURGE.KV_dispenser_owners", "id.owner.forged.seq"
	watch := []*nats.Subscription{testenv.Subscribe(t, nc, purge), testenv.Subscribe(t, nc, forged)}

	next := func() int64 {
		t.Helper()
		body, code := request(t, nc, direct, "", nil)
		if code != "" {
			t.Fatalf("a good direct request: %s %s", code, body)
		}
		return parseIDs(t, body)[0]
	}
	last := next()
	tests := []struct {
		name     string
		subject  string
		reply    string
		body     string
		hdr      nats.Header
		wantCode string // "" with noReply: no answer at all
		noReply  bool
	}{
		{name: "malformed count", subject: direct, body: "ten", wantCode: protocol.CodeBadRequest},
		{name: "zero count", subject: direct, body: "0", wantCode: protocol.CodeBadRequest},
		{name: "count above the batch limit", subject: direct, body: "10001", wantCode: protocol.CodeBadRequest},
		{name: "long body", subject: direct, body: strings.Repeat("9", 4096), wantCode: protocol.CodeBadRequest},
		{name: "bad format", subject: direct, hdr: nats.Header{protocol.FormatHeader: {"json"}}, wantCode: protocol.CodeBadRequest},
		{name: "bad tag token", subject: protocol.DirectSubject("id", "s%q", owner.name), wantCode: protocol.CodeBadRequest},
		{name: "a plain tag", subject: protocol.DirectSubject("id", "plain", owner.name), wantCode: protocol.CodeMisdirected},
		{name: "an unknown tag", subject: protocol.DirectSubject("id", "nope", owner.name), wantCode: protocol.CodeMisdirected},
		{name: "another tag's owner", subject: protocol.DirectSubject("id", "seq", nonOwner.name), wantCode: protocol.CodeMisdirected},
		{name: "reply into JetStream", subject: direct, reply: purge, noReply: true},
		{name: "reply to the owners' subjects", subject: direct, reply: forged, noReply: true},
		{name: "reply with a wildcard", subject: direct, reply: "_INBOX.*", noReply: true},
		{name: "no reply", subject: direct, noReply: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			msg := &nats.Msg{Subject: tt.subject, Data: []byte(tt.body), Header: tt.hdr}
			if tt.noReply {
				msg.Reply = tt.reply
				if err := nc.PublishMsg(msg); err != nil {
					t.Fatal(err)
				}
			} else {
				resp, err := nc.RequestMsg(msg, 10*time.Second)
				if err != nil {
					t.Fatal(err)
				}
				if got := resp.Header.Get(protocol.ErrorCodeHeader); got != tt.wantCode {
					t.Fatalf("code %q (%s), body %q; want %s", got, resp.Header.Get(protocol.ErrorHeader), resp.Data, tt.wantCode)
				}
				if len(resp.Data) != 0 {
					t.Fatalf("body %q, want none", resp.Data)
				}
			}
			// The owner's direct subscription handles its messages in
			// order: once the next good request is answered, this one was
			// handled.
			if got := next(); got != last+1 {
				t.Fatalf("the next ID is %d, want %d: the refused request took IDs", got, last+1)
			}
			last++
		})
	}
	// Anything published there came before the last good reply, on the
	// same connections: it would be pending now.
	for _, sub := range watch {
		if n, _, err := sub.Pending(); err != nil || n != 0 {
			t.Fatalf("%d messages on %s (%v), want none", n, sub.Subject, err)
		}
	}
	if _, misdirected := directStats(t, workers); misdirected != 3 {
		t.Errorf("misdirected requests counted: %v, want 3", misdirected)
	}
}
