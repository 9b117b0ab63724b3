package main

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/dispenser-dev/dispenser/client"
	"github.com/dispenser-dev/dispenser/protocol"
	"github.com/dispenser-dev/dispenser/testenv"
)

// docBlock returns the first fenced block after marker in the README and
// docs/, so that a test runs exactly what the documentation says.
func docBlock(tb testing.TB, marker, must string) string {
	tb.Helper()
	_, rest, ok := strings.Cut(string(readDocs(tb)), marker)
	if !ok {
		tb.Fatalf("docs: no %q", marker)
	}
	_, rest, ok = strings.Cut(rest, "```\n")
	block, _, ok2 := strings.Cut(rest, "```")
	if !ok || !ok2 || !strings.Contains(block, must) {
		tb.Fatalf("docs: no configuration block with %q after %q", must, marker)
	}
	return block
}

// tenantDeployment is one documented isolation set-up.
type tenantDeployment struct {
	name, marker, must string
	// leaked: the attacker is also handed the victim's inbox name (its
	// connection's response prefix), as if it had leaked: the set-up
	// must hold even then.
	leaked bool
}

var tenantDeployments = []tenantDeployment{
	{name: "accounts", marker: "#### Isolation: one account per tenant", must: "accounts", leaked: true},
	{name: "single-account", marker: "A least-privilege permission set", must: "authorization"},
}

// TestHostileTenants runs each documented isolation set-up, its
// configuration block read from docs/operations.md, on a real nats-server
// with two workers and two tenants: payments-app, the victim, asks for its
// IDs with the Go client the whole time, while orders-app, the attacker,
// with nothing but its documented rights, tries to
//
//   - read: subscribes to every inbox, the workers' inboxes, mapped reply
//     subjects, $JS, $KV, id.> and >;
//   - inject: answers id.> (in the queue group and outside it) with forged
//     IDs, publishes forged forwarded requests, and purges, deletes and
//     writes the workers' buckets through $JS and $KV;
//   - reflect: sends its own, allowed requests for 10,000 IDs with reply
//     subjects in the victim's inbox (the names it read, guessed, or
//     leaked) and in the workers';
//   - impersonate: publishes replies into the victim's inbox with every
//     token it saw;
//   - and asks for the victim's tag.
//
// Afterwards the attacker read nothing that was not its own, the victim
// holds no ID twice, got every ID it asked for and not one reply it did
// not ask for, every bucket keeps its stream and keys, and both tenants
// are served as before.
func TestHostileTenants(t *testing.T) {
	t.Parallel() // one of the package's slow tests
	for _, d := range tenantDeployments {
		t.Run(d.name, func(t *testing.T) { testHostileTenants(t, d, docBlock(t, d.marker, d.must)) })
	}
}

func testHostileTenants(t *testing.T, d tenantDeployment, block string) {
	opts := serverOptions(t, block)
	opts.Host, opts.Port, opts.NoLog, opts.NoSigs = "127.0.0.1", server.RANDOM_PORT, true, true
	opts.JetStream, opts.StoreDir = true, t.TempDir()
	ns := testenv.StartNATS(t, opts)
	t.Cleanup(ns.Shutdown)
	addr := ns.Addr().String()
	users := opts.Users
	inbox := func(user string) string { return inboxPrefix(t, docUser(t, users, user)) }
	connect := func(user string, extra ...nats.Option) *nats.Conn {
		t.Helper()
		o := append([]nats.Option{nats.UserInfo(user, user+"-secret"), nats.Name(user)}, extra...)
		if p := inbox(user); p != "" {
			o = append(o, nats.CustomInboxPrefix(p))
		}
		nc, err := nats.Connect("nats://"+addr, o...)
		if err != nil {
			t.Fatalf("%s: %v", user, err)
		}
		t.Cleanup(nc.Close)
		return nc
	}
	workerURL := "nats://dispenser:dispenser-secret@" + addr
	jsURL := "nats://dispenser-js:dispenser-js-secret@" + addr
	admin := []string{"--nats-url", jsURL, "--nats-inbox-prefix", inbox("dispenser-js")}
	// orders, the attacker's, is plain with a large step, so that its
	// 10,000-ID requests are answered from memory, in order; payments,
	// the victim's, is ordered, so that its requests are forwarded to
	// the owner and answered from there.
	mustRun(t, append([]string{"tags", "create", "orders", "--step", "1000000"}, admin...)...)
	mustRun(t, append([]string{"tags", "create", "payments", "--step", "100", "--ordered"}, admin...)...)
	for _, w := range []string{"w1", "w2"} {
		startServe(t, "--nats-url", workerURL, "--nats-js-url", jsURL, "--instance", w,
			"--nats-inbox-prefix", inbox("dispenser"), "--nats-js-inbox-prefix", inbox("dispenser-js"))
	}
	ctx := context.Background()
	js, err := jetstream.New(connect("dispenser-js"))
	if err != nil {
		t.Fatal(err)
	}

	// Both workers serve both tenants (each answered a request naming
	// itself), and orders' segments are in memory on both.
	attacker := connect("orders-app", nats.ErrorHandler(func(*nats.Conn, *nats.Subscription, error) {}))
	victimNC := connect("payments-app")
	bothWorkers(t, attacker, "id.segment.orders")
	bothWorkers(t, victimNC, "id.snowflake")
	before := bucketState(t, ctx, js)

	// The victim asks for its IDs, one at a time, until told to stop.
	victim, err := client.New(victimNC)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(victim.Close)
	var held []int64
	var victimErrs []error
	stopVictim := make(chan struct{})
	victimDone := make(chan struct{})
	var calls atomic.Int64
	go func() {
		defer close(victimDone)
		for {
			select {
			case <-stopVictim:
				return
			default:
			}
			id, err := victim.Segment(ctx, "payments")
			calls.Add(1)
			if err != nil {
				victimErrs = append(victimErrs, err)
				continue
			}
			held = append(held, id)
		}
	}()
	waitCalls := func(n int64) {
		t.Helper()
		deadline := time.Now().Add(30 * time.Second)
		for calls.Load() < n {
			if time.Now().After(deadline) {
				t.Fatalf("the victim made %d calls, want %d", calls.Load(), n)
			}
			time.Sleep(time.Millisecond)
		}
	}
	waitCalls(50)

	// Read: a second connection of the attacker's, which sends nothing,
	// subscribes wherever it can (a refused subscription is only a
	// permissions violation) and keeps what it gets.
	var spyMu sync.Mutex // protects spied
	var spied []*nats.Msg
	spy := connect("orders-app", nats.ErrorHandler(func(*nats.Conn, *nats.Subscription, error) {}))
	victimResp := respPrefix(victimNC) // the victim's inbox: <prefix>.<random>
	victimPrefix := victimResp[:strings.LastIndexByte(victimResp, '.')]
	for _, subject := range []string{">", "_INBOX.>", victimPrefix + ".>", victimResp + ".*", "_R_.>", "$JS.>", "$KV.>", "id.>",
		inbox("dispenser") + ".>", inbox("dispenser-js") + ".>", "_INBOX_dispenser.>", "_INBOX_dispenser-js.>"} {
		if strings.HasPrefix(subject, ".") {
			continue // a default prefix, covered by _INBOX.>
		}
		if _, err := spy.Subscribe(subject, func(m *nats.Msg) {
			spyMu.Lock()
			spied = append(spied, m)
			spyMu.Unlock()
		}); err != nil {
			t.Fatal(err)
		}
	}
	if err := spy.Flush(); err != nil {
		t.Fatal(err)
	}
	waitCalls(calls.Load() + 50) // the victim's replies went out meanwhile

	// What the attacker learnt: every token in what it read, and the
	// inboxes of replies that were not its own.
	learnt := func() (tokens, inboxes []string) {
		spyMu.Lock()
		defer spyMu.Unlock()
		for _, m := range spied {
			tok := tokenOf(m)
			if tok != "" && !strings.HasPrefix(tok, "atk") {
				tokens = append(tokens, tok)
				inboxes = append(inboxes, m.Subject[:strings.LastIndexByte(m.Subject, '.')])
			}
		}
		slices.Sort(inboxes)
		return tokens, slices.Compact(inboxes)
	}
	tokens, learntInboxes := learnt()
	targets := append(learntInboxes, victimPrefix+".guessed", "_INBOX.guessed", "_INBOX_payments-app.guessed")
	if d.leaked {
		targets = append(targets, victimResp)
	}
	for _, p := range []string{inbox("dispenser"), inbox("dispenser-js"), "_INBOX_dispenser", "_INBOX_dispenser-js"} {
		if p != "" {
			targets = append(targets, p+".guessed")
		}
	}

	// Another tenant's tag: refused by the server, never a worker's IDs.
	if resp, err := attacker.Request("id.segment.payments", nil, 2*time.Second); err == nil && resp.Header.Get(protocol.ErrorCodeHeader) == "" {
		t.Errorf("orders-app got payments IDs %q", resp.Data)
	}

	// Inject: answer the service's subjects with forged IDs.
	forge := func(m *nats.Msg) {
		resp := &nats.Msg{Subject: m.Reply, Data: []byte("1"), Header: nats.Header{}}
		// It sees the request: the token too, and echoes it as a worker.
		switch tok, inBody := protocol.RequestToken(m.Header, m.Data); {
		case inBody:
			resp.Data = append(protocol.AppendTokenLine(nil, tok, ""), '1')
		case tok != "":
			resp.Header[protocol.TokenHeader] = []string{tok}
		}
		_ = attacker.PublishMsg(resp)
	}
	for _, subject := range []string{"id.>", "id.segment.payments", "id.direct.payments.*"} {
		if _, err := attacker.QueueSubscribe(subject, "dispenser", forge); err != nil {
			t.Fatal(err)
		}
		if _, err := attacker.Subscribe(subject, forge); err != nil {
			t.Fatal(err)
		}
	}
	hostile := []*nats.Msg{
		{Subject: "$JS.API.STREAM.PURGE.KV_dispenser_segments"},
		{Subject: "$JS.API.STREAM.DELETE.KV_dispenser_owners"},
		{Subject: "$KV.dispenser_segments.payments", Data: []byte(`{"max_id":1,"step":100}`)},
		{Subject: "$KV.dispenser_owners.payments", Data: []byte("orders-app")},
		{Subject: "id.owner.w1.payments", Data: []byte("_INBOX.x 1 list 0\n")},
	}
	// Reflect and impersonate, into every target.
	for i, target := range targets {
		for _, subject := range []string{"id.segment.orders", "id.snowflake"} {
			hostile = append(hostile, &nats.Msg{Subject: subject, Reply: fmt.Sprintf("%s.r%d", target, i), Data: []byte("10000"),
				Header: nats.Header{protocol.TokenHeader: {fmt.Sprintf("atk%d", i)}}})
		}
		for j, tok := range append(tokens, "atk-no-token-known") {
			hostile = append(hostile, &nats.Msg{Subject: fmt.Sprintf("%s.%d", target, j), Data: []byte("1"),
				Header: nats.Header{protocol.TokenHeader: {tok}}})
		}
	}
	for _, m := range hostile {
		if m.Header == nil {
			m.Header = nats.Header{}
		}
		m.Header.Set(hostileHeader, "1")
		if err := attacker.PublishMsg(m); err != nil {
			t.Fatal(err)
		}
	}
	if err := attacker.Flush(); err != nil {
		t.Fatal(err)
	}

	// Every worker handled the attacker's requests before it answers one
	// sent after them; the victim's request sent after that comes after
	// whatever that worker published to the victim's inbox.
	bothWorkers(t, attacker, "id.segment.orders")
	waitCalls(calls.Load() + 50)
	close(stopVictim)
	<-victimDone
	bothWorkers(t, victimNC, "id.snowflake")

	// The service answers both tenants as before.
	if _, err := victim.Segment(ctx, "payments"); err != nil {
		t.Errorf("the victim after the attack: %v", err)
	}
	if resp, err := attacker.Request("id.segment.orders", nil, 10*time.Second); err != nil || resp.Header.Get(protocol.ErrorCodeHeader) != "" {
		t.Errorf("the attacker's own tag after the attack: %v, %v", resp, err)
	}

	// Read: nothing that was not the attacker's own.
	spyMu.Lock()
	leaks := 0
	attackerResp := respPrefix(attacker)
	for _, m := range spied {
		tok := tokenOf(m)
		own := m.Header.Get(hostileHeader) != "" || // its own hostile messages
			tok != "" && strings.HasPrefix(tok, "atk") || // replies to them
			strings.HasPrefix(m.Subject, "$JS.EVENT.ADVISORY.API") && strings.Contains(string(m.Data), `"user":"orders-app"`) || // its own API calls' audit
			strings.HasPrefix(m.Subject, attackerResp+".") || // replies to its own requests
			strings.HasPrefix(m.Subject, "id.") && (tok == "" || strings.HasPrefix(tok, "atk")) && m.Header.Get("Nats-Request-Info") == "" // its own requests
		if !own {
			if leaks < 5 {
				t.Errorf("the attacker read %s (token %q, %d bytes): not its own: %.300s", m.Subject, tok, len(m.Data), m.Data)
			}
			leaks++
		}
	}
	spyMu.Unlock()
	if leaks > 0 {
		t.Errorf("the attacker read %d messages that were not its own", leaks)
	}

	// The victim: every call answered, no ID twice, no reply it did not
	// ask for.
	if len(victimErrs) > 0 {
		t.Errorf("%d of the victim's %d calls failed, first: %v", len(victimErrs), calls.Load(), victimErrs[0])
	}
	seen := map[int64]bool{}
	for _, id := range held {
		if seen[id] {
			t.Errorf("the victim holds payments ID %d twice", id)
		}
		seen[id] = true
	}
	st := victimNC.Stats()
	if st.InMsgs != st.OutMsgs {
		t.Errorf("the victim's connection received %d messages (%d bytes) for %d requests: replies it did not ask for", st.InMsgs, st.InBytes, st.OutMsgs)
	}

	// JetStream untouched.
	after := bucketState(t, ctx, js)
	for bucket, b := range before {
		if a, ok := after[bucket]; !ok || !a.created.Equal(b.created) || len(a.keys) < len(b.keys) {
			t.Errorf("bucket %s changed by the attack: before %v, after %v (%v)", bucket, b, a, ok)
		}
	}
	spyMu.Lock()
	read := len(spied)
	spyMu.Unlock()
	t.Logf("%s: the victim made %d calls; the attacker sent %d hostile messages to %d targets and read %d messages", d.name, calls.Load(), len(hostile), len(targets), read)
}

// respPrefix returns nc's response inbox prefix: <inbox prefix>.<random>,
// under which every reply to its requests arrives.
func respPrefix(nc *nats.Conn) string {
	r := nc.NewRespInbox()
	return r[:strings.LastIndexByte(r, '.')]
}

// bothWorkers sends requests on subject, naming the worker that answers
// (protocol.WorkerHeader), until each of two workers has answered one.
func bothWorkers(t *testing.T, nc *nats.Conn, subject string) {
	t.Helper()
	workers := map[string]bool{}
	deadline := time.Now().Add(30 * time.Second)
	for len(workers) < 2 {
		resp, err := nc.RequestMsg(&nats.Msg{Subject: subject, Header: nats.Header{protocol.WorkerHeader: {"1"}}}, 10*time.Second)
		switch {
		case err == nil && resp.Header.Get(protocol.ErrorCodeHeader) == "":
			workers[resp.Header.Get(protocol.WorkerHeader)] = true
		case time.Now().After(deadline):
			t.Fatalf("%s: answered by %v (last: %v, %v), want two workers", subject, workers, resp, err)
		case err != nil && !errors.Is(err, nats.ErrNoResponders) && !errors.Is(err, nats.ErrTimeout):
			t.Fatalf("%s: %v", subject, err)
		default:
			time.Sleep(10 * time.Millisecond)
		}
	}
}

// tokenOf is the token a message the attacker read carries, wherever a
// requester or a worker puts it: protocol.TokenHeader, a request's body
// ("<count> <token>") or a reply's first line; "" if none.
func tokenOf(m *nats.Msg) string {
	if tok := m.Header.Get(protocol.TokenHeader); tok != "" {
		return tok
	}
	if tok, inBody := protocol.RequestToken(nil, m.Data); inBody && protocol.ValidToken(tok) {
		return tok
	}
	if tok, _, _, ok := protocol.CutTokenLine(m.Data); ok && protocol.ValidToken(string(tok)) {
		return string(tok)
	}
	return ""
}
