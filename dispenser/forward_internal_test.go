package dispenser

import (
	"context"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"testing"
	"time"

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

// forwardAll runs a forwarder of worker "w1" over items, all for owner
// "id.owner.x" and tag "seq", and returns the messages the owner got and
// the server's max payload.
func forwardAll(t testing.TB, items []forwardItem) ([]*nats.Msg, int64) {
	t.Helper()
	ns := testenv.NATS(t)
	owner := testenv.Connect(t, ns)
	sub, err := owner.SubscribeSync("id.owner.x.seq")
	if err != nil {
		t.Fatal(err)
	}
	if err := owner.Flush(); err != nil {
		t.Fatal(err)
	}
	s := &Service{cfg: Config{Conn: testenv.Connect(t, ns), Logger: slog.New(slog.DiscardHandler)}, id: "w1"}
	s.fwd.ch = make(chan forwardItem, len(items))
	s.fwd.stop = make(chan struct{})
	for _, it := range items {
		it.owner, it.tag = "id.owner.x", "seq"
		s.fwd.ch <- it
	}
	s.parked.Add(1)
	go s.runForwarder()
	s.fwd.leave()
	s.parked.Wait()

	var msgs []*nats.Msg
	for lines := 0; lines < len(items); {
		msg, err := sub.NextMsg(5 * time.Second)
		if err != nil {
			t.Fatalf("message %d: %v (got %d of %d requests)", len(msgs)+1, err, lines, len(items))
		}
		if got := msg.Header.Get(ForwardedHeader); got != "w1" {
			t.Errorf("%s: %q, want the forwarding worker's ID", ForwardedHeader, got)
		}
		msgs = append(msgs, msg)
		lines += strings.Count(string(msg.Data), "\n")
	}
	return msgs, owner.MaxPayload()
}

// forwardedLines returns the lines of msgs, in order.
func forwardedLines(msgs []*nats.Msg) []string {
	var lines []string
	for _, msg := range msgs {
		lines = append(lines, strings.Split(strings.TrimSuffix(string(msg.Data), "\n"), "\n")...)
	}
	return lines
}

// TestForwarderBatches: the requests waiting for the forwarder go out
// together, at most maxForwardBatch per message, each as one line, in order.
func TestForwarderBatches(t *testing.T) {
	const requests = maxForwardBatch + 44
	var items []forwardItem
	for i := range requests {
		items = append(items, forwardItem{reply: fmt.Sprintf("_INBOX.t.%d", i), n: 1 + i%3, format: Format(i % 2), worker: i%5 == 0})
	}
	msgs, _ := forwardAll(t, items)
	if len(msgs) != 2 { // a full batch and the rest
		t.Errorf("%d requests in %d messages, want 2", requests, len(msgs))
	}
	for i, line := range forwardedLines(msgs) {
		want := fmt.Sprintf("_INBOX.t.%d %d %s %d", i, 1+i%3, []string{"list", "range"}[i%2], map[bool]int{false: 0, true: 1}[i%5 == 0])
		if line != want {
			t.Fatalf("line %d: %q, want %q", i, line, want)
		}
	}
}

// TestForwarderSplitsAtMaxPayload: a batch whose lines do not fit in one
// message (long reply subjects) goes out in several, each within the
// server's max payload, none of its requests lost.
func TestForwarderSplitsAtMaxPayload(t *testing.T) {
	const requests = maxForwardBatch
	long := strings.Repeat("r", 4500) // 256 lines: more than the default 1 MB
	var items []forwardItem
	for i := range requests {
		items = append(items, forwardItem{reply: fmt.Sprintf("_INBOX.%s.%d", long, i), n: 1})
	}
	msgs, maxPayload := forwardAll(t, items)
	if len(msgs) < 2 {
		t.Errorf("%d requests of %d bytes in %d message, want more", requests, len(items[0].reply), len(msgs))
	}
	for i, msg := range msgs {
		if int64(len(msg.Data)) > maxPayload {
			t.Errorf("message %d: %d bytes, more than the max payload %d", i, len(msg.Data), maxPayload)
		}
	}
	for i, line := range forwardedLines(msgs) {
		if want := fmt.Sprintf("_INBOX.%s.%d 1 list 0", long, i); line != want {
			t.Fatalf("line %d: %.40q..., want %.40q...", i, line, want)
		}
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
	replies, err := nc.SubscribeSync("_INBOX.t.*")
	if err != nil {
		t.Fatal(err)
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
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
		"_INBOX.t.zero":   {code: CodeBadRequest},
		"_INBOX.t.huge":   {code: CodeBadRequest},
		"_INBOX.t.format": {code: CodeBadRequest},
		"_INBOX.t.range":  {ids: 3, worker: svc.ID()},
	}
	got := map[string]answer{}
	seen := map[int64]bool{}
	for range want {
		msg, err := replies.NextMsg(5 * time.Second)
		if err != nil {
			t.Fatalf("after %d replies: %v", len(got), err)
		}
		a := answer{code: msg.Header.Get(micro.ErrorCodeHeader), worker: msg.Header.Get(WorkerHeader)}
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
