package dispenser

import (
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"

	"github.com/dispenser-dev/dispenser/internal/tests/wait"
	"github.com/dispenser-dev/dispenser/testenv"
)

// TestForgedForwardedBatchRefused: a message on the owner's subject is
// input too (anyone who may publish there can forge one): each line's
// reply subject passes the reply rule before anything is taken for it. A
// line whose reply subject is a system namespace, the service's own
// subjects or a wildcard is counted refused (admitReply, before anything
// is taken) and not answered; a good line in the same message is answered.
func TestForgedForwardedBatchRefused(t *testing.T) {
	ns, svc := orderedService(t, fixedOwners{}, 100)
	nc := testenv.Connect(t, ns)
	const purge, own = "$JS.API.STREAM.PURGE.KV_dispenser_owners", "id.owner.a.forged"
	watch := []*nats.Subscription{testenv.Subscribe(t, nc, purge), testenv.Subscribe(t, nc, own)}
	good := testenv.Subscribe(t, nc, "_INBOX.t.ok")
	body := purge + " 1 list 0\n" + own + " 1 list 0\n" + "_INBOX.* 1 list 0\n" + "_INBOX.t.ok 1 list 0\n"
	if err := nc.PublishMsg(&nats.Msg{Subject: "id.owner.a.seq", Data: []byte(body)}); err != nil {
		t.Fatal(err)
	}
	msg, err := good.NextMsg(10 * time.Second)
	if err != nil {
		t.Fatalf("the good line's answer: %v", err)
	}
	if code := msg.Header.Get(micro.ErrorCodeHeader); code != "" {
		t.Fatalf("the good line: code %s, want IDs", code)
	}
	wait.For(t, 10*time.Second, "the three forged lines counted as refused", func() bool { return svc.badReply.Load() == 3 })
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	for _, sub := range watch {
		if n, _, err := sub.Pending(); err != nil || n != 0 {
			t.Fatalf("%d messages on %s (%v), want none", n, sub.Subject, err)
		}
	}
}
