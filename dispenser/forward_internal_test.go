package dispenser

import (
	"context"
	"fmt"
	"github.com/dispenser-dev/dispenser/protocol"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nats.go/micro"

	"github.com/dispenser-dev/dispenser/ownership"
	"github.com/dispenser-dev/dispenser/segment"
	"github.com/dispenser-dev/dispenser/segment/kv"
	"github.com/dispenser-dev/dispenser/testenv"
)

// fixedOwners is an Owners that owns every ordered tag for good.
type fixedOwners struct{}

func (fixedOwners) Owns(string) bool                      { return true }
func (fixedOwners) Cached(string) (ownership.Route, bool) { return ownership.Route{Self: true}, true }
func (fixedOwners) Route(context.Context, string) (ownership.Route, error) {
	return ownership.Route{Self: true}, nil
}
func (fixedOwners) Claim(context.Context, string) (ownership.Route, error) {
	return ownership.Route{Self: true}, nil
}
func (fixedOwners) Stats() ownership.Stats { return ownership.Stats{} }

// subscribe subscribes nc to subject and makes sure the server knows.
func subscribe(t testing.TB, nc *nats.Conn, subject string) *nats.Subscription {
	t.Helper()
	sub, err := nc.SubscribeSync(subject)
	if err != nil {
		t.Fatal(err)
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	return sub
}

// forward runs a forwarder of worker "w1" on a connection to ns over items
// and returns the messages on id.owner.> until they hold want lines.
func forward(t testing.TB, ns *server.Server, items []forwardItem, want int) []*nats.Msg {
	t.Helper()
	owner := testenv.Connect(t, ns)
	sub := subscribe(t, owner, "id.owner.>")
	s := &Service{cfg: Config{Conn: testenv.Connect(t, ns), Logger: slog.New(slog.DiscardHandler)}, id: "w1"}
	s.fwd.ch = make(chan forwardItem, len(items))
	s.fwd.stop = make(chan struct{})
	for _, it := range items {
		s.fwd.ch <- it
	}
	s.parked.Add(1)
	go s.runForwarder()
	s.fwd.leave()
	s.parked.Wait()

	var msgs []*nats.Msg
	for lines := 0; lines < want; {
		msg, err := sub.NextMsg(5 * time.Second)
		if err != nil {
			t.Fatalf("message %d: %v (got %d of %d requests)", len(msgs)+1, err, lines, want)
		}
		if got := msg.Header.Get(protocol.ForwardedHeader); got != "w1" {
			t.Errorf("%s: %q, want the forwarding worker's ID", protocol.ForwardedHeader, got)
		}
		msgs = append(msgs, msg)
		lines += strings.Count(string(msg.Data), "\n")
	}
	return msgs
}

// forwardedLines returns the lines of msgs by subject, in order.
func forwardedLines(msgs []*nats.Msg) map[string][]string {
	lines := map[string][]string{}
	for _, msg := range msgs {
		lines[msg.Subject] = append(lines[msg.Subject], strings.Split(strings.TrimSuffix(string(msg.Data), "\n"), "\n")...)
	}
	return lines
}

// TestForwarderBatches: the requests waiting for the forwarder go out
// together, at most maxForwardBatch per message, each as one line, in order.
func TestForwarderBatches(t *testing.T) {
	const requests = maxForwardBatch + 44
	var items []forwardItem
	for i := range requests {
		items = append(items, forwardItem{owner: "id.owner.x", tag: "seq", reply: fmt.Sprintf("_INBOX.t.%d", i), n: 1 + i%3, format: protocol.Format(i % 2), worker: i%5 == 0})
	}
	msgs := forward(t, testenv.NATS(t), items, requests)
	if len(msgs) != 2 { // a full batch and the rest
		t.Errorf("%d requests in %d messages, want 2", requests, len(msgs))
	}
	for i, line := range forwardedLines(msgs)["id.owner.x.seq"] {
		want := fmt.Sprintf("_INBOX.t.%d %d %s %d", i, 1+i%3, []string{"list", "range"}[i%2], map[bool]int{false: 0, true: 1}[i%5 == 0])
		if line != want {
			t.Fatalf("line %d: %q, want %q", i, line, want)
		}
	}
}

// TestForwarderDestinations: requests for several owners and tags,
// interleaved, go out as one message per owner and tag and batch, each
// with its own requests in order, also in a second batch that reuses the
// first one's buffers.
func TestForwarderDestinations(t *testing.T) {
	const requests = maxForwardBatch + 44 // two batches
	dests := []struct{ owner, tag string }{{"id.owner.x", "seq"}, {"id.owner.y", "seq"}, {"id.owner.x", "other"}}
	var items []forwardItem
	want := map[string][]string{}
	for i := range requests {
		d := dests[i%len(dests)]
		if i >= maxForwardBatch && i%len(dests) == 2 {
			d = dests[0] // the second batch has two destinations only
		}
		items = append(items, forwardItem{owner: d.owner, tag: d.tag, reply: fmt.Sprintf("_INBOX.t.%d", i), n: 1})
		subject := d.owner + "." + d.tag
		want[subject] = append(want[subject], fmt.Sprintf("_INBOX.t.%d 1 list 0", i))
	}
	msgs := forward(t, testenv.NATS(t), items, requests)
	if len(msgs) != 5 { // three in the first batch, two in the second
		t.Errorf("%d requests in %d messages, want 5", requests, len(msgs))
	}
	got := forwardedLines(msgs)
	for subject, lines := range want {
		g := got[subject]
		if i := firstDifference(g, lines); i >= 0 {
			t.Errorf("%s: %d lines, want %d; from line %d: %q, want %q", subject, len(g), len(lines), i, g[i:min(i+2, len(g))], lines[i:min(i+2, len(lines))])
		}
	}
}

// firstDifference returns the first index at which a and b differ, -1 if
// they are equal.
func firstDifference(a, b []string) int {
	for i := range max(len(a), len(b)) {
		if i >= len(a) || i >= len(b) || a[i] != b[i] {
			return i
		}
	}
	return -1
}

// TestForwarderSplitsAtMaxPayload: a batch whose lines do not fit in one
// message (long reply subjects) goes out in several, each within the
// server's max payload, none of its requests lost.
func TestForwarderSplitsAtMaxPayload(t *testing.T) {
	const requests = maxForwardBatch
	long := strings.Repeat("r", 4500) // 256 lines: more than the default 1 MB
	var items []forwardItem
	for i := range requests {
		items = append(items, forwardItem{owner: "id.owner.x", tag: "seq", reply: fmt.Sprintf("_INBOX.%s.%d", long, i), n: 1})
	}
	ns := testenv.NATS(t)
	msgs := forward(t, ns, items, requests)
	if len(msgs) < 2 {
		t.Errorf("%d requests of %d bytes in %d message, want more", requests, len(items[0].reply), len(msgs))
	}
	for i, line := range forwardedLines(msgs)["id.owner.x.seq"] {
		if want := fmt.Sprintf("_INBOX.%s.%d 1 list 0", long, i); line != want {
			t.Fatalf("line %d: %.40q..., want %.40q...", i, line, want)
		}
	}
}

// TestForwardFailureAnswered: a request whose line cannot be sent (longer
// than the server's max payload) gets a 503 on its reply subject; the
// requests before and after it in the batch still reach the owner.
func TestForwardFailureAnswered(t *testing.T) {
	opts := testenv.NATSOptions(t.TempDir())
	opts.MaxPayload = 1100
	ns := testenv.StartNATS(t, opts)
	t.Cleanup(ns.Shutdown)
	long := "_INBOX.t." + strings.Repeat("r", 1200) // a line above the max payload
	requester := testenv.Connect(t, ns)
	replies := subscribe(t, requester, "_INBOX.>")
	items := []forwardItem{
		{owner: "id.owner.x", tag: "seq", reply: "_INBOX.t.a", n: 1},
		{owner: "id.owner.x", tag: "seq", reply: long, n: 1},
		{owner: "id.owner.x", tag: "seq", reply: "_INBOX.t.c", n: 1},
	}
	got := forwardedLines(forward(t, ns, items, 2))["id.owner.x.seq"]
	if want := []string{"_INBOX.t.a 1 list 0", "_INBOX.t.c 1 list 0"}; !slices.Equal(got, want) {
		t.Errorf("the owner got %q, want %q", got, want)
	}
	msg, err := replies.NextMsg(5 * time.Second)
	if err != nil {
		t.Fatalf("no answer to the request that could not be forwarded: %v", err)
	}
	if msg.Subject != long || msg.Header.Get(micro.ErrorCodeHeader) != protocol.CodeUnavailable {
		t.Errorf("answer on %.20q... with code %q (%s), want a 503 on the long reply subject",
			msg.Subject, msg.Header.Get(micro.ErrorCodeHeader), msg.Header.Get(micro.ErrorHeader))
	}
	if msg, err := replies.NextMsg(200 * time.Millisecond); err == nil {
		t.Errorf("unexpected answer on %.20q...", msg.Subject)
	}
}

// TestForwardedRequestsAnswered: the owner answers every line of a
// forwarded message on its reply subject, with IDs or the error the
// request would get itself; a line without a reply subject is dropped.
func TestForwardedRequestsAnswered(t *testing.T) {
	ns := testenv.NATS(t)
	js, err := jetstream.New(testenv.Connect(t, ns))
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	store, err := kv.New(ctx, js, kv.Settings{})
	if err != nil {
		t.Fatal(err)
	}
	if err := store.CreateTag(ctx, segment.Tag{Name: "seq", Step: 1000, MaxID: 1, Ordered: true}); err != nil {
		t.Fatal(err)
	}
	alloc, err := segment.New(segment.Settings{Store: store, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	svc, err := New(Config{Conn: testenv.Connect(t, ns), Segments: alloc, Owners: fixedOwners{}, OwnerSubject: "id.owner.a",
		MaxBatch: 100, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = svc.Stop(ctx)
		_ = alloc.Close(ctx)
	})
	nc := testenv.Connect(t, ns)
	replies := subscribe(t, nc, "_INBOX.t.*")
	body := "_INBOX.t.list 2 list 0\n" +
		"_INBOX.t.zero 0 list 0\n" +
		"_INBOX.t.huge 101 list 0\n" +
		"_INBOX.t.format 1 csv 0\n" +
		"garbage\n" +
		"_INBOX.t.range 3 range 1\n"
	if err := nc.PublishMsg(&nats.Msg{Subject: "id.owner.a.seq", Data: []byte(body)}); err != nil {
		t.Fatal(err)
	}
	// Answers: an error code, or how many IDs (the two requests with IDs
	// run concurrently: which gets 1 is not fixed), and the worker header.
	type answer struct {
		code   string
		ids    int
		worker string
	}
	want := map[string]answer{
		"_INBOX.t.list":   {ids: 2},
		"_INBOX.t.zero":   {code: protocol.CodeBadRequest},
		"_INBOX.t.huge":   {code: protocol.CodeBadRequest},
		"_INBOX.t.format": {code: protocol.CodeBadRequest},
		"_INBOX.t.range":  {ids: 3, worker: svc.ID()},
	}
	got := map[string]answer{}
	seen := map[int64]bool{}
	for range want {
		msg, err := replies.NextMsg(5 * time.Second)
		if err != nil {
			t.Fatalf("after %d replies: %v", len(got), err)
		}
		a := answer{code: msg.Header.Get(micro.ErrorCodeHeader), worker: msg.Header.Get(protocol.WorkerHeader)}
		if a.code == "" {
			for _, line := range strings.Fields(string(msg.Data)) {
				first, last, isRange := strings.Cut(line, "-")
				if !isRange {
					last = first
				}
				f, err1 := strconv.ParseInt(first, 10, 64)
				l, err2 := strconv.ParseInt(last, 10, 64)
				if err1 != nil || err2 != nil || isRange != (msg.Subject == "_INBOX.t.range") {
					t.Fatalf("%s: reply %q", msg.Subject, msg.Data)
				}
				for id := f; id <= l; id++ {
					a.ids++
					seen[id] = true
				}
			}
		}
		got[msg.Subject] = a
	}
	for subject, w := range want {
		if g := got[subject]; g != w {
			t.Errorf("%s: got %+v, want %+v", subject, g, w)
		}
	}
	for id := int64(1); id <= 5; id++ {
		if !seen[id] {
			t.Errorf("IDs %v: want 1 to 5, each once", seen)
			break
		}
	}
	if msg, err := replies.NextMsg(200 * time.Millisecond); err == nil {
		t.Errorf("unexpected reply on %s: %q", msg.Subject, msg.Data)
	}
}

// losingOwners owns every ordered tag for its first limit calls of Owns,
// then another worker ("id.owner.b") does.
type losingOwners struct {
	calls atomic.Int32
	limit int32
}

func (o *losingOwners) Owns(string) bool { return o.calls.Add(1) <= o.limit }
func (o *losingOwners) Cached(tag string) (ownership.Route, bool) {
	if o.Owns(tag) {
		return ownership.Route{Self: true}, true
	}
	return ownership.Route{Owner: "b", Subject: "id.owner.b"}, true
}
func (o *losingOwners) Route(ctx context.Context, tag string) (ownership.Route, error) {
	r, _ := o.Cached(tag)
	return r, nil
}
func (o *losingOwners) Claim(ctx context.Context, tag string) (ownership.Route, error) {
	return o.Route(ctx, tag)
}
func (o *losingOwners) Stats() ownership.Stats { return ownership.Stats{} }

// TestOwnerLostWhileTaking: an owner that loses its tag between admitting a
// request and replying does not answer it from its buffers (their IDs may
// come from a segment fetched after the loss): the request goes to the new
// owner. Seen failing while takeOwned replied without looking again: the
// second request was answered here, not forwarded.
func TestOwnerLostWhileTaking(t *testing.T) {
	ns := testenv.NATS(t)
	js, err := jetstream.New(testenv.Connect(t, ns))
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	store, err := kv.New(ctx, js, kv.Settings{})
	if err != nil {
		t.Fatal(err)
	}
	if err := store.CreateTag(ctx, segment.Tag{Name: "seq", Step: 1000, MaxID: 1, Ordered: true}); err != nil {
		t.Fatal(err)
	}
	alloc, err := segment.New(segment.Settings{Store: store, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	// The first request: Cached (1) and the parked request's check (2);
	// the second: Cached (3), then the loss.
	owners := &losingOwners{limit: 3}
	svc, err := New(Config{Conn: testenv.Connect(t, ns), Segments: alloc, Owners: owners, OwnerSubject: "id.owner.a",
		Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = svc.Stop(ctx)
		_ = alloc.Close(ctx)
	})
	nc := testenv.Connect(t, ns)
	if resp, err := nc.Request("id.segment.seq", nil, 5*time.Second); err != nil || string(resp.Data) != "1" {
		t.Fatalf("first request, as the owner: %v %v, want ID 1", resp, err)
	}
	forwarded := subscribe(t, nc, "id.owner.b.seq")
	replies := subscribe(t, nc, "_INBOX.lost")
	if err := nc.PublishRequest("id.segment.seq", "_INBOX.lost", nil); err != nil {
		t.Fatal(err)
	}
	msg, err := forwarded.NextMsg(5 * time.Second)
	if err != nil {
		if r, rerr := replies.NextMsg(time.Second); rerr == nil {
			t.Fatalf("the request after the loss was answered here: %q", r.Data)
		}
		t.Fatalf("the request after the loss was not forwarded: %v", err)
	}
	if !strings.HasPrefix(string(msg.Data), "_INBOX.lost 1 list") {
		t.Fatalf("forwarded %q, want the request to _INBOX.lost", msg.Data)
	}
}
