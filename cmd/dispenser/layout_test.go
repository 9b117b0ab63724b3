package main

import (
	"context"
	"encoding/json"
	"errors"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/micro"

	"github.com/dispenser-dev/dispenser/snowflake"
	"github.com/dispenser-dev/dispenser/testenv"
)

// TestServeJSLayout: serve --snowflake-layout js issues IDs below 2^53,
// its decode endpoint and `dispenser decode --snowflake-layout js` decode
// them alike, the default layout does not, and a worker of the default
// layout is refused on the js bucket before it serves.
func TestServeJSLayout(t *testing.T) {
	ns := testenv.NATS(t)
	url := ns.ClientURL()
	logs := startServe(t, "serve", "--nats-url", url, "--snowflake-layout", "js", "--instance", "js-1")
	nc := testenv.Connect(t, ns)
	waitForID(t, nc, "id.snowflake", logs)

	resp, err := nc.Request("id.snowflake", []byte("5000"), 5*time.Second)
	if err != nil || resp.Header.Get(micro.ErrorCodeHeader) != "" {
		t.Fatalf("batch of 5000: %v %v", err, resp.Header)
	}
	fields := strings.Fields(string(resp.Data))
	if len(fields) != 5000 {
		t.Fatalf("batch of 5000: got %d IDs", len(fields))
	}
	for _, f := range fields {
		if id, err := strconv.ParseInt(f, 10, 64); err != nil || id >= 1<<53 {
			t.Fatalf("ID %q is not below 2^53", f)
		}
	}
	id := fields[len(fields)-1]

	resp, err = nc.Request("id.snowflake.decode", []byte(id), 5*time.Second)
	if err != nil || resp.Header.Get(micro.ErrorCodeHeader) != "" {
		t.Fatalf("decode endpoint: %v %v", err, resp.Header)
	}
	var endpoint snowflake.Parts
	if err := json.Unmarshal(resp.Data, &endpoint); err != nil {
		t.Fatal(err)
	}
	if since := time.Since(endpoint.Time); since < -time.Minute || since > time.Minute || endpoint.Worker > int64(snowflake.JSLayout.MaxWorkerID()) {
		t.Fatalf("decode endpoint: %s, want a time about now and a worker ID of the js layout", resp.Data)
	}

	for _, tt := range []struct {
		name    string
		args    []string
		want    string // the endpoint's JSON; "" : anything else
		wantErr bool
	}{
		{name: "js", args: []string{"decode", "--snowflake-layout", "js", id}, want: string(resp.Data)},
		{name: "js from the environment", args: []string{"decode", id}, want: string(resp.Data)},
		{name: "default decodes wrongly", args: []string{"decode", "--snowflake-layout", "default", id}},
		{name: "js refuses 2^53", args: []string{"decode", "--snowflake-layout", "js", "9007199254740992"}, wantErr: true},
		{name: "unknown layout", args: []string{"decode", "--snowflake-layout", "js53", id}, wantErr: true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			if tt.name == "js from the environment" {
				t.Setenv("DISPENSER_SNOWFLAKE_LAYOUT", "js")
			}
			out, err := runCmd(t, tt.args...)
			if (err != nil) != tt.wantErr {
				t.Fatalf("%v: got %q, error %v; want error %v", tt.args, out, err, tt.wantErr)
			}
			if tt.wantErr {
				return
			}
			if got := strings.TrimSpace(out); (got == tt.want) != (tt.want != "") {
				t.Errorf("%v: got %s, endpoint %s", tt.args, got, resp.Data)
			}
		})
	}

	// The endpoint refuses an ID beyond the js layout.
	resp, err = nc.Request("id.snowflake.decode", []byte("9007199254740992"), 5*time.Second)
	if err != nil || resp.Header.Get(micro.ErrorCodeHeader) != "400" {
		t.Errorf("decode endpoint, 2^53: %v, code %q, want 400", err, resp.Header.Get(micro.ErrorCodeHeader))
	}
	// A batch above the js layout's largest (8,192) is 400 though
	// --max-batch (10,000) allows it.
	resp, err = nc.Request("id.snowflake", []byte("8193"), 5*time.Second)
	if err != nil || resp.Header.Get(micro.ErrorCodeHeader) != "400" {
		t.Errorf("batch of 8193: %v, code %q, want 400", err, resp.Header.Get(micro.ErrorCodeHeader))
	}

	// A default-layout worker on the js bucket refuses to start, loudly.
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	out, err := runCmdCtx(ctx, "serve", "--nats-url", url, "--instance", "default-1")
	if !errors.Is(err, snowflake.ErrLayoutMismatch) {
		t.Fatalf("serve of the default layout on the js bucket: got %v (%s), want ErrLayoutMismatch", err, out)
	}
}

// runCmdCtx runs the dispenser command line under ctx.
func runCmdCtx(ctx context.Context, args ...string) (string, error) {
	var out syncBuffer
	err := run(ctx, args, &out, &out)
	return out.String(), err
}
