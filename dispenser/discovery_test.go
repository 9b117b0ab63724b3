package dispenser_test

import (
	"encoding/json"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"

	"github.com/dispenser-dev/dispenser/dispenser"
	"github.com/dispenser-dev/dispenser/testenv"
)

// keys returns the JSON object keys of data, nested objects' keys as
// "outer.inner" and array elements' keys as "outer[].inner", but not those
// inside metadata and stats data (each service's own).
func keys(tb testing.TB, data []byte) []string {
	tb.Helper()
	var v any
	if err := json.Unmarshal(data, &v); err != nil {
		tb.Fatalf("%s: %v", data, err)
	}
	var out []string
	var walk func(path string, v any)
	walk = func(path string, v any) {
		switch v := v.(type) {
		case map[string]any:
			for k, e := range v {
				out = append(out, path+k)
				if k != "metadata" && k != "data" {
					walk(path+k+".", e)
				}
			}
		case []any:
			for _, e := range v {
				walk(strings.TrimSuffix(path, ".")+"[].", e)
			}
		}
	}
	walk("", v)
	slices.Sort(out)
	return slices.Compact(out)
}

// TestDiscoveryAsMicro: the service answers $SRV.PING, $SRV.INFO and
// $SRV.STATS (for all services, its name and its ID) with the fields micro
// itself answers with, so that nats micro ls/info/stats and every micro
// client see it as a micro service.
func TestDiscoveryAsMicro(t *testing.T) {
	ns := testenv.NATS(t)
	svc := startSnowflakeService(t, ns, newDownSnowflake(t, 1))
	refConn := testenv.Connect(t, ns)
	ref, err := micro.AddService(refConn, micro.Config{Name: "reference", Version: "1.0.0",
		Metadata: map[string]string{"k": "v"}, StatsHandler: func(*micro.Endpoint) any { return map[string]int{"x": 1} }})
	if err != nil {
		t.Fatal(err)
	}
	defer ref.Stop()
	if err := ref.AddEndpoint("e", micro.HandlerFunc(func(r micro.Request) { r.Respond(nil) }), micro.WithEndpointSubject("ref.e"),
		micro.WithEndpointMetadata(map[string]string{"description": "d"})); err != nil {
		t.Fatal(err)
	}
	if err := refConn.Flush(); err != nil { // the server knows the endpoint
		t.Fatal(err)
	}
	nc := testenv.Connect(t, ns)
	// A request to the reference endpoint, so that its stats have a last
	// error field and counts like ours.
	if _, err := nc.Request("ref.e", nil, 10*time.Second); err != nil {
		t.Fatal(err)
	}
	ask := func(subject string) []byte {
		t.Helper()
		resp, err := nc.Request(subject, nil, 10*time.Second)
		if err != nil {
			t.Fatalf("%s: %v", subject, err)
		}
		return resp.Data
	}
	for _, verb := range []string{"PING", "INFO", "STATS"} {
		want := keys(t, ask("$SRV."+verb+".reference"))
		for _, subject := range []string{"$SRV." + verb + "." + dispenser.Name, "$SRV." + verb + "." + dispenser.Name + "." + svc.ID()} {
			got := keys(t, ask(subject))
			if !slices.Equal(got, want) {
				t.Errorf("%s: fields %v, micro's %v", subject, got, want)
			}
		}
	}
	// $SRV.PING without a name reaches both.
	inbox := nc.NewRespInbox()
	sub, err := nc.SubscribeSync(inbox)
	if err != nil {
		t.Fatal(err)
	}
	if err := nc.PublishRequest("$SRV.PING", inbox, nil); err != nil {
		t.Fatal(err)
	}
	names := map[string]bool{}
	for len(names) < 2 {
		msg, err := sub.NextMsg(10 * time.Second)
		if err != nil {
			t.Fatalf("$SRV.PING: answers from %v: %v", names, err)
		}
		var p micro.Ping
		if err := json.Unmarshal(msg.Data, &p); err != nil || p.Type != micro.PingResponseType {
			t.Fatalf("$SRV.PING answer %s: %v", msg.Data, err)
		}
		names[p.Name] = true
	}
}

// TestDiscoveryKeepsTheReplyRule: a discovery request whose reply subject
// the service refuses for ID requests (here its own prefix) gets no answer
// either: $SRV requests must not make a worker publish where a requester
// may not.
func TestDiscoveryKeepsTheReplyRule(t *testing.T) {
	ns := testenv.NATS(t)
	startSnowflakeService(t, ns, newDownSnowflake(t, 1))
	nc := testenv.Connect(t, ns)
	trap, err := nc.SubscribeSync("id.trap")
	if err != nil {
		t.Fatal(err)
	}
	inbox := nc.NewRespInbox()
	good, err := nc.SubscribeSync(inbox)
	if err != nil {
		t.Fatal(err)
	}
	// Both on one subject (one subscription of the worker, handled in
	// order) and answered on one connection: once the good one's answer
	// is here, an answer to the bad one would be too.
	subject := "$SRV.INFO." + dispenser.Name
	if err := nc.PublishRequest(subject, "id.trap", nil); err != nil {
		t.Fatal(err)
	}
	if err := nc.PublishRequest(subject, inbox, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := good.NextMsg(10 * time.Second); err != nil {
		t.Fatalf("the good request: %v", err)
	}
	if msg, err := trap.NextMsg(time.Millisecond); err != nats.ErrTimeout {
		t.Fatalf("a discovery request with reply subject id.trap was answered there: %v %v", msg, err)
	}
}
