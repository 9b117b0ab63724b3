package dispenser_test

import (
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/dispenser-dev/dispenser/dispenser"
	"github.com/dispenser-dev/dispenser/internal/tests/wait"
	"github.com/dispenser-dev/dispenser/segment"
	"github.com/dispenser-dev/dispenser/testenv"
)

// TestSegmentRefusesReplySubjects: a segment request whose reply subject
// the service must not publish to (a system namespace, a wildcard, its own
// subjects, none) gets no answer and takes no ID: the segment handler
// checks the reply subject before anything else (package doc,
// "Invariants"). TestDirectRefusals checks the direct subject's handler,
// TestDiscoveryKeepsTheReplyRule the discovery's.
func TestSegmentRefusesReplySubjects(t *testing.T) {
	st := newStack(t, map[string]int64{"plain": 1000})
	st.worker(t, segment.Settings{})
	nc := testenv.Connect(t, st.ns)
	const purge, own = "$JS.API.STREAM.PURGE.KV_dispenser_owners", "id.segment.forged"
	watch := []*nats.Subscription{testenv.Subscribe(t, nc, purge), testenv.Subscribe(t, nc, own)}
	next := func() int64 {
		t.Helper()
		body, code := request(t, nc, "id.segment.plain", "", nil)
		if code != "" {
			t.Fatalf("a good request: %s %s", code, body)
		}
		return parseIDs(t, body)[0]
	}
	refused := func() (noReply, badReply uint64) {
		t.Helper()
		var data struct {
			Refused struct {
				NoReply  uint64 `json:"no_reply"`
				BadReply uint64 `json:"reply_subject"`
			} `json:"refused"`
		}
		endpointData(t, nc, "$SRV.STATS."+dispenser.Name, "segment", &data)
		return data.Refused.NoReply, data.Refused.BadReply
	}
	first := next()
	for _, reply := range []string{purge, own, "_INBOX.*", "_INBOX.>", ""} {
		if err := nc.PublishMsg(&nats.Msg{Subject: "id.segment.plain", Reply: reply}); err != nil {
			t.Fatal(err)
		}
	}
	// Wait for the refusals themselves: counted once handled.
	wait.For(t, 10*time.Second, "the five requests counted as refused", func() bool {
		noReply, badReply := refused()
		return noReply == 1 && badReply == 4
	})
	if got := next(); got != first+1 {
		t.Fatalf("the next ID is %d, want %d: the refused requests took IDs", got, first+1)
	}
	for _, sub := range watch {
		if n, _, err := sub.Pending(); err != nil || n != 0 {
			t.Fatalf("%d messages on %s (%v), want none", n, sub.Subject, err)
		}
	}
}

// TestSnowflakeRefusesReplySubjects: the snowflake and decode endpoints
// keep the reply rule too. Each endpoint's subscription handles its
// messages in order, and the worker publishes on one connection: once a
// good request's answer came, every refused request before it was handled,
// and anything it published would be pending on the watched subjects.
func TestSnowflakeRefusesReplySubjects(t *testing.T) {
	ns := testenv.NATS(t)
	startSnowflake(t, ns, "w1")
	nc := testenv.Connect(t, ns)
	const purge, own = "$JS.API.STREAM.PURGE.KV_dispenser_snowflake", "id.snowflake.forged"
	watch := []*nats.Subscription{testenv.Subscribe(t, nc, purge), testenv.Subscribe(t, nc, own)}
	for _, tt := range []struct{ name, subject, body string }{
		{"snowflake", "id.snowflake", ""},
		{"decode", "id.snowflake.decode", "1"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			for _, reply := range []string{purge, own} {
				if err := nc.PublishMsg(&nats.Msg{Subject: tt.subject, Reply: reply, Data: []byte(tt.body)}); err != nil {
					t.Fatal(err)
				}
			}
			if body, code := request(t, nc, tt.subject, tt.body, nil); code != "" {
				t.Fatalf("a good request: %s %s", code, body)
			}
			for _, sub := range watch {
				if n, _, err := sub.Pending(); err != nil || n != 0 {
					t.Fatalf("%d messages on %s (%v), want none: a refused request was answered", n, sub.Subject, err)
				}
			}
		})
	}
}
