package dispenser_test

import (
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/dispenser-dev/dispenser/dispenser"
	"github.com/dispenser-dev/dispenser/internal/tests/wait"
	"github.com/dispenser-dev/dispenser/protocol"
	"github.com/dispenser-dev/dispenser/snowflake"
	"github.com/dispenser-dev/dispenser/tagmodel"
	"github.com/dispenser-dev/dispenser/testenv"
)

// tokenReply sends msg with token in protocol.TokenHeader and returns the
// reply; it fails the test unless the reply echoes exactly that token.
func tokenReply(tb testing.TB, nc *nats.Conn, msg *nats.Msg, token string) *nats.Msg {
	tb.Helper()
	resp, _ := tokenReplyAs(tb, nc, msg, token, false)
	return resp
}

// tokenReplyAs is tokenReply with the token in the body ("<count>
// <token>", the count 1 if msg has none) if inBody. A reply with IDs to a
// body token carries it as its body's first line, which is cut off (the
// direct subject it names is returned); an error reply carries it in
// protocol.TokenHeader.
func tokenReplyAs(tb testing.TB, nc *nats.Conn, msg *nats.Msg, token string, inBody bool) (*nats.Msg, string) {
	tb.Helper()
	if msg.Header == nil {
		msg.Header = nats.Header{}
	}
	if inBody {
		count := strings.TrimSpace(string(msg.Data))
		if count == "" {
			count = "1"
		}
		msg.Data = []byte(count + " " + token)
	} else {
		msg.Header[protocol.TokenHeader] = []string{token}
	}
	resp, err := nc.RequestMsg(msg, 10*time.Second)
	if err != nil {
		tb.Fatalf("%s: %v", msg.Subject, err)
	}
	if !inBody || resp.Header.Get(protocol.ErrorCodeHeader) != "" {
		if got := resp.Header.Values(protocol.TokenHeader); len(got) != 1 || got[0] != token {
			tb.Fatalf("%s: reply (code %q, body %q) carries %s %q, want exactly %q", msg.Subject,
				resp.Header.Get(protocol.ErrorCodeHeader), resp.Data, protocol.TokenHeader, got, token)
		}
		return resp, resp.Header.Get(protocol.DirectHeader)
	}
	if got := resp.Header.Values(protocol.TokenHeader); got != nil {
		tb.Fatalf("%s: reply with IDs to a body token carries %s %q", msg.Subject, protocol.TokenHeader, got)
	}
	tok, direct, rest, ok := protocol.CutTokenLine(resp.Data)
	if !ok || string(tok) != token {
		tb.Fatalf("%s: reply body %q, want the token line %q first", msg.Subject, resp.Data, token)
	}
	resp.Data = rest
	return resp, string(direct)
}

// TestRepliesEchoToken: every reply to a request with protocol.TokenHeader
// carries it back, with IDs or with an error, whichever path answers it:
// inline, an ordered tag's owner for a request another worker forwarded,
// the owner's direct subject, an error published by the owner. A request
// without it gets replies without it; one with an unreadable token is
// refused with 400 and nothing taken.
func TestRepliesEchoToken(t *testing.T) {
	st := newStack(t, map[string]int64{"plain": 10})
	if err := st.store.CreateTag(context.Background(), tagmodel.Tag{Name: "seq", Step: 10, MaxID: 1, Ordered: true}); err != nil {
		t.Fatal(err)
	}
	workers := []*orderedWorker{st.orderedWorker(t, "w0"), st.orderedWorker(t, "w1")}
	nc := testenv.Connect(t, st.ns)
	direct, owner := ownerOf(t, nc, workers, "seq")
	nonOwner := workers[0]
	if nonOwner == owner {
		nonOwner = workers[1]
	}

	tests := []struct {
		name     string
		subject  string
		body     string
		hdr      nats.Header
		wantCode string
	}{
		{name: "plain tag", subject: "id.segment.plain"},
		{name: "plain tag, range, naming the worker", subject: "id.segment.plain", body: "5",
			hdr: nats.Header{protocol.FormatHeader: {"range"}, protocol.WorkerHeader: {"1"}}},
		{name: "unknown tag", subject: "id.segment.nope", wantCode: protocol.CodeNotFound},
		{name: "bad count", subject: "id.segment.plain", body: "0", wantCode: protocol.CodeBadRequest},
		{name: "bad count, naming the worker", subject: "id.segment.plain", body: "0", hdr: nats.Header{protocol.WorkerHeader: {"1"}},
			wantCode: protocol.CodeBadRequest},
		{name: "bad subject", subject: "id.segment.a.b", wantCode: protocol.CodeBadRequest},
		{name: "ordered tag asking for the direct subject", subject: "id.segment.seq", hdr: nats.Header{protocol.DirectHeader: {"1"}}},
		{name: "ordered tag on the direct subject", subject: direct},
		{name: "direct subject, bad count", subject: direct, body: "x", wantCode: protocol.CodeBadRequest},
		{name: "direct subject of a tag not owned", subject: protocol.DirectSubject("id", "plain", owner.name), wantCode: protocol.CodeMisdirected},
	}
	for _, inBody := range []bool{false, true} {
		for i, tt := range tests {
			name := tt.name
			if inBody {
				name = "body token, " + name
			}
			t.Run(name, func(t *testing.T) {
				token := "tok" + string(rune('A'+i)) + "-x_9"
				hdr := nats.Header{}
				for k, v := range tt.hdr {
					hdr[k] = v
				}
				resp, gotDirect := tokenReplyAs(t, nc, &nats.Msg{Subject: tt.subject, Data: []byte(tt.body), Header: hdr}, token, inBody)
				if got := resp.Header.Get(protocol.ErrorCodeHeader); got != tt.wantCode {
					t.Fatalf("code %q (%s), want %q", got, resp.Header.Get(protocol.ErrorHeader), tt.wantCode)
				}
				if tt.wantCode != "" {
					return
				}
				if _, err := protocol.ParseIDs(resp.Data, max(1, atoi(tt.body)), formatOf(tt.hdr), 1); err != nil {
					t.Errorf("IDs: %v", err)
				}
				// The owner names its direct subject to a request on the
				// segment subject that asked for it: by DirectHeader, or
				// by a body token.
				wantDirect := ""
				if tt.subject == "id.segment.seq" && (inBody || tt.hdr[protocol.DirectHeader] != nil) {
					wantDirect = direct
				}
				if gotDirect != wantDirect {
					t.Errorf("direct subject %q, want %q", gotDirect, wantDirect)
				}
			})
		}
	}
	t.Run("body token, ordered tag, each worker", func(t *testing.T) {
		// Whichever worker the queue group picks, the owner answers (a
		// forwarded request too) and names its direct subject in the
		// token line.
		for i := range 20 {
			_, got := tokenReplyAs(t, nc, &nats.Msg{Subject: "id.segment.seq"}, "each"+string(rune('a'+i)), true)
			if got != direct {
				t.Fatalf("request %d: direct subject %q, want %q", i, got, direct)
			}
		}
	})

	t.Run("forwarded to the owner", func(t *testing.T) {
		// Requests on the queue group reach both workers; the non-owner
		// forwards its share. Every reply echoes, until one was forwarded.
		i := 0
		wait.For(t, 30*time.Second, "a request forwarded by "+nonOwner.name, func() bool {
			i++
			tokenReply(t, nc, &nats.Msg{Subject: "id.segment.seq"}, "fwd"+string(rune('a'+i%26)))
			families, err := nonOwner.reg.Gather()
			if err != nil {
				t.Fatal(err)
			}
			f, _ := metricValue(families, "dispenser_ordered_forwarded_total", map[string]string{})
			return f > 0
		})
	})

	t.Run("forwarded lines", func(t *testing.T) {
		// What the owner does with a forwarded line's token, IDs or
		// error, published after its handler returned.
		for _, tt := range []struct {
			name, line, token, code string
		}{
			{"IDs", "2 range 0:fwdIDs", "fwdIDs", ""},
			{"error", "0 list 1:fwdErr", "fwdErr", protocol.CodeBadRequest},
			{"IDs, body token", "2 range 4:fwdBodyIDs", "fwdBodyIDs", ""},
			{"error, body token", "0 list 5:fwdBodyErr", "fwdBodyErr", protocol.CodeBadRequest},
		} {
			inbox := nats.NewInbox()
			sub, err := nc.SubscribeSync(inbox)
			if err != nil {
				t.Fatal(err)
			}
			if err := nc.Publish("id.owner."+owner.name+".seq", []byte(inbox+" "+tt.line+"\n")); err != nil {
				t.Fatal(err)
			}
			resp, err := sub.NextMsg(10 * time.Second)
			if err != nil {
				t.Fatalf("%s: %v", tt.name, err)
			}
			got, code := resp.Header.Get(protocol.TokenHeader), resp.Header.Get(protocol.ErrorCodeHeader)
			if strings.Contains(tt.line, " 4:") { // a body token: in the body's first line with IDs
				tok, _, rest, ok := protocol.CutTokenLine(resp.Data)
				if !ok || string(tok) != tt.token || got != "" {
					t.Errorf("%s: body %q, %s %q; want the token line %q and no header", tt.name, resp.Data, protocol.TokenHeader, got, tt.token)
				}
				if _, err := protocol.ParseIDs(rest, 2, protocol.FormatRange, 1); err != nil {
					t.Errorf("%s: %v", tt.name, err)
				}
				continue
			}
			if got != tt.token || code != tt.code {
				t.Errorf("%s: token %q, code %q; want %q, %q", tt.name, got, code, tt.token, tt.code)
			}
		}
	})

	t.Run("no token, no echo", func(t *testing.T) {
		for _, subject := range []string{"id.segment.plain", "id.segment.seq", "id.segment.nope"} {
			resp, err := nc.Request(subject, nil, 10*time.Second)
			if err != nil {
				t.Fatal(err)
			}
			if v := resp.Header.Values(protocol.TokenHeader); v != nil {
				t.Errorf("%s: a request without %s got %q", subject, protocol.TokenHeader, v)
			}
		}
	})

	t.Run("unreadable token", func(t *testing.T) {
		// The last ID each worker handed out before, and the first after:
		// consecutive on both, or a refused request took IDs.
		// firstByWorker asks until each worker answered once, and
		// returns each one's first ID.
		firstByWorker := func() map[string]int64 {
			seen := map[string]int64{}
			for len(seen) < len(workers) {
				resp, err := nc.RequestMsg(&nats.Msg{Subject: "id.segment.plain", Header: nats.Header{protocol.WorkerHeader: {"1"}}}, 10*time.Second)
				if err != nil {
					t.Fatal(err)
				}
				w := resp.Header.Get(protocol.WorkerHeader)
				if _, ok := seen[w]; !ok {
					seen[w] = parseIDs(t, string(resp.Data))[0]
				}
			}
			return seen
		}
		// Before: keep asking until each worker answered, keeping its last.
		before := map[string]int64{}
		for len(before) < len(workers) {
			resp, err := nc.RequestMsg(&nats.Msg{Subject: "id.segment.plain", Header: nats.Header{protocol.WorkerHeader: {"1"}}}, 10*time.Second)
			if err != nil {
				t.Fatal(err)
			}
			before[resp.Header.Get(protocol.WorkerHeader)] = parseIDs(t, string(resp.Data))[0]
		}
		var refused []*nats.Msg
		for _, v := range [][]string{{""}, {"a.b"}, {"a", "b"}, {string(make([]byte, protocol.MaxTokenLen+1))}} {
			refused = append(refused, &nats.Msg{Subject: "id.segment.plain", Header: nats.Header{protocol.TokenHeader: v}})
		}
		for _, body := range []string{"1 a.b", "1 a b", "1 " + strings.Repeat("a", protocol.MaxTokenLen+1), "1 tok\x00"} {
			refused = append(refused, &nats.Msg{Subject: "id.segment.plain", Data: []byte(body)})
		}
		// A token in both places is refused: which would the reply echo?
		refused = append(refused, &nats.Msg{Subject: "id.segment.plain", Data: []byte("1 tokA"), Header: nats.Header{protocol.TokenHeader: {"tokB"}}})
		for _, msg := range refused {
			resp, err := nc.RequestMsg(msg, 10*time.Second)
			if err != nil {
				t.Fatal(err)
			}
			if code := resp.Header.Get(protocol.ErrorCodeHeader); code != protocol.CodeBadRequest || resp.Header.Get(protocol.TokenHeader) != "" {
				t.Errorf("header %q, body %q: code %q, token %q; want 400 without a token", msg.Header, msg.Data, code, resp.Header.Get(protocol.TokenHeader))
			}
		}
		// After: the first ID each worker hands out. Between the two, no
		// ID of the worker's own segments: the next one, or the first of
		// a segment it fetched since (the step is 10, so the refused
		// requests may end a segment even when they take nothing).
		after := firstByWorker()
		for w, id := range after {
			var rec *recorder
			for _, ow := range workers {
				if ow.svc.ID() == w {
					rec = ow.rec
				}
			}
			if rec == nil {
				t.Fatalf("no worker %s", w)
			}
			for skipped := before[w] + 1; skipped < id; skipped++ {
				if rec.owns("plain", skipped) {
					t.Errorf("worker %s: IDs %d then %d, and %d was its own: the refused requests took IDs", w, before[w], id, skipped)
					break
				}
			}
			if id <= before[w] {
				t.Errorf("worker %s: IDs %d then %d", w, before[w], id)
			}
		}
	})
}

// TestSnowflakeRepliesEchoToken: the snowflake endpoints echo the token
// too.
func TestSnowflakeRepliesEchoToken(t *testing.T) {
	ns := testenv.NATS(t)
	js, err := jetstream.New(testenv.Connect(t, ns))
	if err != nil {
		t.Fatal(err)
	}
	w, err := snowflake.Start(context.Background(), js, snowflake.NodeSettings{Instance: "w1", Settings: snowflake.Settings{Logger: quiet}})
	if err != nil {
		t.Fatal(err)
	}
	svc, err := dispenser.New(dispenser.Config{Conn: testenv.Connect(t, ns), Snowflake: w, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { svc.Stop(context.Background()) })
	nc := testenv.Connect(t, ns)
	for _, tt := range []struct{ name, subject, body, code string }{
		{"IDs", "id.snowflake", "3", ""},
		{"bad count", "id.snowflake", "0", protocol.CodeBadRequest},
		{"decode", "id.snowflake.decode", "123", ""},
		{"decode garbage", "id.snowflake.decode", "abc", protocol.CodeBadRequest},
	} {
		resp := tokenReply(t, nc, &nats.Msg{Subject: tt.subject, Data: []byte(tt.body)}, "sf"+tt.code)
		if code := resp.Header.Get(protocol.ErrorCodeHeader); code != tt.code {
			t.Errorf("%s: code %q, want %q", tt.name, code, tt.code)
		}
		if tt.subject == "id.snowflake.decode" {
			continue // its body is an ID: a token goes in the header only
		}
		resp, _ = tokenReplyAs(t, nc, &nats.Msg{Subject: tt.subject, Data: []byte(tt.body)}, "sfBody"+tt.code, true)
		if code := resp.Header.Get(protocol.ErrorCodeHeader); code != tt.code {
			t.Errorf("%s, body token: code %q, want %q", tt.name, code, tt.code)
		}
		if tt.code == "" {
			if _, err := protocol.ParseIDs(resp.Data, atoi(tt.body), protocol.FormatList, 0); err != nil {
				t.Errorf("%s, body token: %v", tt.name, err)
			}
		}
	}
}

// atoi is s as a count: 0 if it is none.
func atoi(s string) int {
	n, _ := strconv.Atoi(strings.TrimSpace(s))
	return n
}

// formatOf is the reply format a request with headers h asks for.
func formatOf(h nats.Header) protocol.Format {
	f, _ := protocol.ParseFormat(h.Values(protocol.FormatHeader))
	return f
}
