package dispenser

import (
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"

	"github.com/dispenser-dev/dispenser/protocol"
	"github.com/dispenser-dev/dispenser/testenv"
)

// forward runs a forwarder of worker "w1" on a connection to ns over items
// and returns the messages on id.owner.> until they hold want lines.
func forward(t testing.TB, ns *server.Server, items []forwardItem, want int) []*nats.Msg {
	t.Helper()
	owner := testenv.Connect(t, ns)
	sub := testenv.Subscribe(t, owner, "id.owner.>")
	conn := testenv.Connect(t, ns)
	// A service of its own for the answers to requests that could not be
	// forwarded, bound to conn.
	svc := &Service{cfg: Config{Logger: slog.New(slog.DiscardHandler)}}
	svc.bound.Store(&binding{conn: conn})
	s := &orderedTags{s: svc, conn: conn, id: "w1"}
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
		items = append(items, forwardItem{owner: "id.owner.x", tag: "seq", Forward: protocol.Forward{Reply: fmt.Sprintf("_INBOX.t.%d", i), N: 1 + i%3, Format: protocol.Format(i % 2), Worker: i%5 == 0}})
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
		items = append(items, forwardItem{owner: d.owner, tag: d.tag, Forward: protocol.Forward{Reply: fmt.Sprintf("_INBOX.t.%d", i), N: 1}})
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
		items = append(items, forwardItem{owner: "id.owner.x", tag: "seq", Forward: protocol.Forward{Reply: fmt.Sprintf("_INBOX.%s.%d", long, i), N: 1}})
	}
	ns := testenv.NATS(t)
	msgs := forward(t, ns, items, requests)
	if len(msgs) < 2 {
		t.Errorf("%d requests of %d bytes in %d message, want more", requests, len(items[0].Reply), len(msgs))
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
	replies := testenv.Subscribe(t, requester, "_INBOX.>")
	items := []forwardItem{
		{owner: "id.owner.x", tag: "seq", Forward: protocol.Forward{Reply: "_INBOX.t.a", N: 1}},
		{owner: "id.owner.x", tag: "seq", Forward: protocol.Forward{Reply: long, N: 1}},
		{owner: "id.owner.x", tag: "seq", Forward: protocol.Forward{Reply: "_INBOX.t.c", N: 1}},
	}
	got := forwardedLines(forward(t, ns, items, 2))["id.owner.x.seq"]
	if want := []string{"_INBOX.t.a 1 list 0", "_INBOX.t.c 1 list 0"}; !slices.Equal(got, want) {
		t.Errorf("the owner got %q, want %q", got, want)
	}
	msg, err := replies.NextMsg(5 * time.Second)
	if err != nil {
		t.Fatalf("no answer to the request that could not be forwarded: %v", err)
	}
	if msg.Subject != long || msg.Header.Get(protocol.ErrorCodeHeader) != protocol.CodeUnavailable {
		t.Errorf("answer on %.20q... with code %q (%s), want a 503 on the long reply subject",
			msg.Subject, msg.Header.Get(protocol.ErrorCodeHeader), msg.Header.Get(protocol.ErrorHeader))
	}
	if msg, err := replies.NextMsg(200 * time.Millisecond); err == nil {
		t.Errorf("unexpected answer on %.20q...", msg.Subject)
	}
}
