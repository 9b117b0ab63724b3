package main

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nats.go/micro"

	"github.com/dispenser-dev/dispenser/testenv"
)

// hostileHeader marks every message the hostile client sends, so that the
// monitor tells them from what a worker publishes.
const hostileHeader = "Hostile"

// TestHostileRequesters sends requests to every endpoint with reply
// subjects in the system namespaces and the service's own subjects, with
// malformed subjects, bodies and headers, and forged forwarded requests, on
// a NATS server without authorization: the worker's connections may
// publish anywhere, so the reply-subject rule alone must keep it from
// publishing where the requester points. Afterwards the worker published
// nothing to any of those subjects, every bucket still has its stream and
// its keys, the hostile requests took no ID, and the service answers as
// before, every ID once.
func TestHostileRequesters(t *testing.T) {
	for _, store := range []string{"kv", "postgres"} {
		t.Run(store, func(t *testing.T) { testHostileRequesters(t, store) })
	}
}

func testHostileRequesters(t *testing.T, store string) {
	ns := testenv.NATS(t)
	url := ns.ClientURL()
	storeFlags := []string{"--nats-url", url}
	if store == "postgres" {
		pg := testenv.Postgres(t)
		mustRun(t, "migrate", "--postgres-url", pg)
		storeFlags = []string{"--postgres-url", pg}
	}
	mustRun(t, append([]string{"tags", "create", "orders", "--step", "100", "--ordered"}, storeFlags...)...)
	mustRun(t, append([]string{"tags", "create", "plain", "--step", "100"}, storeFlags...)...)
	serveFlags := []string{"--nats-url", url}
	if store == "postgres" {
		serveFlags = append(serveFlags, storeFlags...)
	}
	logs := startServe(t, append(serveFlags, "--auto-create-tags")...)

	app := testenv.Connect(t, ns)
	var idsMu sync.Mutex
	ids := map[string]map[int64]bool{} // every ID received, by subject
	take := func(subject string) int64 {
		t.Helper()
		got := waitForID(t, app, subject, logs)
		id, err := strconv.ParseInt(got, 10, 64)
		if err != nil {
			t.Fatalf("%s: %q is not an ID", subject, got)
		}
		idsMu.Lock()
		defer idsMu.Unlock()
		if ids[subject] == nil {
			ids[subject] = map[int64]bool{}
		}
		if ids[subject][id] {
			t.Fatalf("%s: ID %d handed out twice", subject, id)
		}
		ids[subject][id] = true
		return id
	}
	// Every bucket holds its records before the attack.
	firstPlain, firstOrders := take("id.segment.plain"), take("id.segment.orders")
	take("id.snowflake")

	js, err := jetstream.New(app)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	before := bucketState(t, ctx, js)
	if len(before) < 3 {
		t.Fatalf("buckets before the attack: %v, want the store's, the leases' and the owners'", before)
	}
	owners, err := js.KeyValue(ctx, "dispenser_owners")
	if err != nil {
		t.Fatal(err)
	}
	e, err := owners.Get(ctx, "orders")
	if err != nil {
		t.Fatalf("owner of orders: %v", err)
	}
	var owner struct{ Subject string }
	if err := json.Unmarshal(e.Value(), &owner); err != nil || owner.Subject == "" {
		t.Fatalf("owner record %q: %v", e.Value(), err)
	}

	targets := []string{
		"$JS.API.STREAM.PURGE.KV_dispenser_segments", "$JS.API.STREAM.PURGE.KV_dispenser_witness",
		"$JS.API.STREAM.PURGE.KV_dispenser_workers", "$JS.API.STREAM.PURGE.KV_dispenser_owners",
		"$JS.API.STREAM.DELETE.KV_dispenser_owners", "$JS.API.STREAM.DELETE.KV_dispenser_segments",
		"$KV.dispenser_owners.orders", "$KV.dispenser_witness.plain", "$KV.dispenser_segments.plain",
		"$KV.dispenser_workers.worker.0000", "$KV.dispenser_workers.config",
		"$SYS.REQ.SERVER.PING", "$SRV.PING", "$SRV.INFO.dispenser", "$O.bucket.chunk", "$G", "$MQTT.sub",
		owner.Subject + ".orders", "id.owner.x.orders", "id.segment.plain", "id.segment.orders", "id.snowflake", "id",
		"x." + strings.Repeat("a", 600), "a..b",
	}
	monitor := testenv.Connect(t, ns)
	var monMu sync.Mutex
	var published []string
	watch := map[string]bool{}
	for _, subject := range targets {
		if strings.ContainsAny(subject, " \t") || strings.Contains(subject, "..") {
			continue // not a subject one can subscribe to (nor publish to)
		}
		watch[subject] = true
	}
	for _, subject := range []string{">", "$JS.>", "$KV.>", "$SYS.>", "$SRV.>", "$O.>", "$G", "$MQTT.>"} {
		_, err := monitor.Subscribe(subject, func(m *nats.Msg) {
			// A worker's reply has no reply subject of its own.
			if watch[m.Subject] && m.Reply == "" && m.Header.Get(hostileHeader) == "" {
				monMu.Lock()
				published = append(published, fmt.Sprintf("%s: %q %v", m.Subject, m.Data, m.Header))
				monMu.Unlock()
			}
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	if err := monitor.Flush(); err != nil {
		t.Fatal(err)
	}

	hostile := testenv.Connect(t, ns)
	// id.segment.new would be created on first use (--auto-create-tags).
	endpoints := []string{"id.segment.plain", "id.segment.orders", "id.segment.new",
		"id.segment.bad.tag", "id.snowflake", "id.snowflake.decode"}
	bodies := []string{"", "x", "3", "0", "-1", strings.Repeat("9", 64<<10)}
	headers := []nats.Header{
		nil,
		{"Id-Format": []string{"range"}},
		{"Id-Format": []string{"json"}},
		{"Id-Worker": []string{"1"}},
		{"Id-Forwarded": []string{"forged"}},
		{"Id-Format": []string{strings.Repeat("r", 8<<10)}},
	}
	sent := 0
	send := func(subject, reply string, body string, h nats.Header) {
		msg := nats.NewMsg(subject)
		msg.Reply = reply
		msg.Data = []byte(body)
		for k, v := range h {
			msg.Header[k] = v
		}
		msg.Header.Set(hostileHeader, "1")
		if err := hostile.PublishMsg(msg); err != nil {
			t.Fatalf("publish %s reply %q: %v", subject, reply, err)
		}
		sent++
	}
	for _, ep := range endpoints {
		for i, target := range targets {
			send(ep, target, bodies[i%len(bodies)], headers[i%len(headers)])
		}
		for _, body := range bodies {
			send(ep, "", body, nil) // no reply subject: nobody could get the IDs
		}
	}
	// Forged forwarded requests, straight to the owner's subject (which a
	// requester with the documented permissions may not publish to).
	var batch strings.Builder
	for _, target := range targets {
		if !strings.ContainsAny(target, " \t") {
			fmt.Fprintf(&batch, "%s 1 list 0\n", target)
		}
	}
	send(owner.Subject+".orders", "", batch.String(), nil)
	send(owner.Subject+".orders", "_INBOX.x", "$JS.API.STREAM.PURGE.KV_dispenser_segments 5 range 1", nil)
	if err := hostile.Flush(); err != nil {
		t.Fatal(err)
	}
	// Each endpoint handles its messages in order: once a request sent
	// after the hostile ones is answered, the hostile ones were handled.
	// What a worker published before its answer is queued for the monitor
	// before the monitor's flush completes.
	if got := take("id.segment.plain"); got != firstPlain+1 {
		t.Errorf("plain after the attack: got %d, want %d: hostile requests took IDs", got, firstPlain+1)
	}
	if got := take("id.segment.orders"); got != firstOrders+1 {
		t.Errorf("orders after the attack: got %d, want %d: hostile requests took IDs", got, firstOrders+1)
	}
	take("id.snowflake")
	if resp, err := app.Request("id.snowflake.decode", []byte("1"), 5*time.Second); err != nil || resp.Header.Get(micro.ErrorCodeHeader) != "" {
		t.Errorf("decode after the attack: %v %v", err, resp)
	}
	if err := monitor.Flush(); err != nil {
		t.Fatal(err)
	}
	monMu.Lock()
	if len(published) > 0 {
		t.Errorf("the worker published %d messages where hostile requests pointed, e.g.\n%s", len(published), strings.Join(published[:min(len(published), 5)], "\n"))
	}
	monMu.Unlock()
	after := bucketState(t, ctx, js)
	for bucket, b := range before {
		a, ok := after[bucket]
		switch {
		case !ok:
			t.Errorf("bucket %s is gone", bucket)
		case !a.created.Equal(b.created):
			t.Errorf("bucket %s was recreated: %v, before %v", bucket, a.created, b.created)
		default:
			for _, k := range b.keys {
				if !slices.Contains(a.keys, k) {
					t.Errorf("bucket %s lost key %s (keys before %v, after %v)", bucket, k, b.keys, a.keys)
				}
			}
		}
	}
	// A few more IDs of each kind, all new.
	for range 20 {
		take("id.segment.plain")
		take("id.segment.orders")
		take("id.snowflake")
	}
	list := mustRun(t, append([]string{"tags", "list"}, storeFlags...)...)
	if strings.Contains(list, "new") {
		t.Errorf("a hostile request created tag new:\n%s", list)
	}
	if !strings.Contains(logs.String(), "refused for its reply subject") {
		t.Errorf("no log line about the refused requests; logs:\n%s", logs.String())
	}
	t.Logf("%d hostile messages sent", sent)
}

type bucketSnapshot struct {
	created time.Time
	keys    []string
}

// bucketState returns every dispenser bucket's stream creation time and
// keys.
func bucketState(t *testing.T, ctx context.Context, js jetstream.JetStream) map[string]bucketSnapshot {
	t.Helper()
	out := map[string]bucketSnapshot{}
	names := js.KeyValueStoreNames(ctx)
	for name := range names.Name() {
		kv, err := js.KeyValue(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		st, err := kv.Status(ctx)
		if err != nil {
			t.Fatal(err)
		}
		s := bucketSnapshot{created: st.(*jetstream.KeyValueBucketStatus).StreamInfo().Created}
		keys, err := kv.ListKeys(ctx)
		if err != nil {
			t.Fatal(err)
		}
		for k := range keys.Keys() {
			s.keys = append(s.keys, k)
		}
		out[name] = s
	}
	if err := names.Error(); err != nil {
		t.Fatal(err)
	}
	return out
}
