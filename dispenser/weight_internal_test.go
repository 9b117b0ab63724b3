package dispenser

import (
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"

	"github.com/dispenser-dev/dispenser/internal/tests/wait"
	"github.com/dispenser-dev/dispenser/testenv"
)

// weightSubsOn counts the server's queue subscriptions on the literal
// subject.
func weightSubsOn(tb testing.TB, ns *server.Server, subject string) int {
	tb.Helper()
	sz, err := ns.Subsz(&server.SubszOptions{Subscriptions: true, Test: subject, Limit: 100000})
	if err != nil {
		tb.Fatal(err)
	}
	n := 0
	for _, sub := range sz.Subs {
		if sub.Subject == subject && sub.Queue != "" {
			n++
		}
	}
	return n
}

// TestWeightLeavesWithTheEndpoint: a worker whose segment endpoint is out
// of its queue group holds no weight either (docs/reliability.md, "A
// worker that cannot serve is not asked"), and weights the tag again once
// back in the group and asked for it.
func TestWeightLeavesWithTheEndpoint(t *testing.T) {
	ns, svc := orderedService(t, fixedOwners{}, 100)
	nc := testenv.Connect(t, ns)
	if _, err := nc.Request("id.segment.seq", nil, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	wait.For(t, 15*time.Second, "the weight on the server", func() bool { return weightSubsOn(t, ns, "id.segment.seq") == weightSubs })

	seg := svc.bound.Load().seg
	seg.leave()
	wait.For(t, 15*time.Second, "the weight gone with the endpoint", func() bool { return weightSubsOn(t, ns, "id.segment.seq") == 0 })
	if got := svc.orderedTags().weights.weighted(); len(got) != 0 {
		t.Fatalf("weighted with the endpoint out of its group: %v", got)
	}

	if err := seg.join(); err != nil {
		t.Fatal(err)
	}
	if err := svc.conn().Flush(); err != nil { // the server knows the endpoint
		t.Fatal(err)
	}
	if _, err := nc.Request("id.segment.seq", nil, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	wait.For(t, 15*time.Second, "the weight back", func() bool { return weightSubsOn(t, ns, "id.segment.seq") == weightSubs })
}

// TestWeightedTagsBounded: a worker weights at most maxWeightedTags tags,
// the first asked for.
func TestWeightedTagsBounded(t *testing.T) {
	ns, svc := orderedService(t, fixedOwners{}, 100)
	w := &svc.orderedTags().weights
	for i := range maxWeightedTags + 5 {
		w.note(fmt.Sprintf("t%02d", i))
	}
	w.poke()
	wait.For(t, 15*time.Second, "the tags weighted", func() bool { return len(w.weighted()) == maxWeightedTags })
	w.pass(time.Now()) // a later pass adds nothing
	if got := w.weighted(); len(got) != maxWeightedTags || got[0] != "t00" || got[maxWeightedTags-1] != fmt.Sprintf("t%02d", maxWeightedTags-1) {
		t.Fatalf("weighted %v, want t00 to t%02d", got, maxWeightedTags-1)
	}
	if n := weightSubsOn(t, ns, fmt.Sprintf("id.segment.t%02d", maxWeightedTags)); n != 0 {
		t.Fatalf("%d subscriptions for a tag beyond the bound", n)
	}
}

// TestWeightLosesNoRequestWhenBehind: an owner whose weights' requests
// pile up (its handler held) answers every one of them once it goes on:
// nats.go would drop what does not fit in the weights' channel.
func TestWeightLosesNoRequestWhenBehind(t *testing.T) {
	ns, svc := orderedService(t, fixedOwners{}, 100)
	w := &svc.orderedTags().weights
	held := make(chan struct{})
	var once sync.Once
	release := func() { once.Do(func() { close(held) }) }
	t.Cleanup(release)
	w.mu.Lock()
	w.handle = func(seg *endpoint, msg *nats.Msg, sc *scratch) { <-held; serveOne(seg, msg, sc) }
	w.mu.Unlock()
	nc := testenv.Connect(t, ns)
	if _, err := nc.Request("id.segment.seq", nil, 5*time.Second); err != nil { // the endpoint's subscription: not held
		t.Fatal(err)
	}
	wait.For(t, 15*time.Second, "the weight on the server", func() bool { return weightSubsOn(t, ns, "id.segment.seq") == weightSubs })

	replies := testenv.Subscribe(t, nc, "_INBOX.held.*")
	const requests = 5000 // about 4850 for the weight
	for i := range requests {
		if err := nc.PublishRequest("id.segment.seq", fmt.Sprintf("_INBOX.held.%d", i), nil); err != nil {
			t.Fatal(err)
		}
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	if err := svc.conn().Flush(); err != nil { // the worker has read them all
		t.Fatal(err)
	}
	release()
	seen := map[string]bool{}
	for len(seen) < requests {
		msg, err := replies.NextMsg(5 * time.Second)
		if err != nil {
			t.Fatalf("%d of %d requests answered: %v", len(seen), requests, err)
		}
		if seen[msg.Subject] {
			t.Fatalf("%s answered twice", msg.Subject)
		}
		seen[msg.Subject] = true
	}
}
