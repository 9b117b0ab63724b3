package main

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"maps"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"

	"github.com/dispenser-dev/dispenser/testenv"
	"github.com/dispenser-dev/dispenser/worker"
)

func TestMain(m *testing.M) { os.Exit(testMain(m)) }

// runCmd runs the command line and returns its output.
func runCmd(t *testing.T, args ...string) (string, error) {
	t.Helper()
	var out bytes.Buffer
	err := run(context.Background(), args, &out, &out)
	return out.String(), err
}

func TestAdminCommands(t *testing.T) {
	t.Setenv("DISPENSER_POSTGRES_URL", testenv.Postgres(t))
	steps := []struct {
		name    string
		args    []string
		wantErr bool
		want    string
	}{
		{"migrate", []string{"migrate"}, false, "applied 001"},
		{"migrate again changes nothing", []string{"migrate"}, false, "up to date"},
		{"create", []string{"tags", "create", "orders", "--step", "1000", "--description", "order numbers"}, false, "created tag orders"},
		{"create with flags first", []string{"tags", "create", "--step", "10", "--start", "500", "payments"}, false, "first ID 500"},
		{"create existing fails", []string{"tags", "create", "orders", "--step", "5"}, true, "already exists"},
		{"create needs a step", []string{"tags", "create", "users"}, true, "--step is required"},
		{"create rejects a bad tag", []string{"tags", "create", "a.b", "--step", "5"}, true, "invalid tag"},
		{"create rejects a bad step", []string{"tags", "create", "users", "--step", "0"}, true, "step"},
		{"update", []string{"tags", "update", "payments", "--step", "20"}, false, "updated tag payments"},
		{"update unknown fails", []string{"tags", "update", "nope", "--step", "20"}, true, "unknown tag"},
		{"update needs a change", []string{"tags", "update", "payments"}, true, "nothing to change"},
		{"list", []string{"tags", "list"}, false, "orders"},
		{"unknown subcommand", []string{"tags", "delete", "orders"}, true, "unknown subcommand"},
	}
	for _, s := range steps {
		out, err := runCmd(t, s.args...)
		if (err != nil) != s.wantErr {
			t.Fatalf("%s: err = %v, want error %v; output %q", s.name, err, s.wantErr, out)
		}
		text := out
		if err != nil {
			text += err.Error()
		}
		if !strings.Contains(text, s.want) {
			t.Fatalf("%s: output %q, want it to contain %q", s.name, text, s.want)
		}
	}
	out, _ := runCmd(t, "tags", "list")
	for _, want := range []string{"order numbers", "1000", "payments  500", "20"} {
		if !strings.Contains(out, want) {
			t.Errorf("list %q lacks %q", out, want)
		}
	}
	if strings.Contains(out, "users") {
		t.Errorf("list %q shows a tag whose creation failed", out)
	}
}

// listTable runs tags list with storeArgs and returns, per tag, its cells
// by column name, cut at the header's column offsets (so that empty cells
// stay in place), and the raw output.
func listTable(t *testing.T, storeArgs []string) (map[string]map[string]string, string) {
	t.Helper()
	out, err := runCmd(t, append([]string{"tags", "list"}, storeArgs...)...)
	if err != nil {
		t.Fatalf("tags list: %v\n%s", err, out)
	}
	lines := strings.Split(strings.TrimRight(out, "\n"), "\n")
	header := lines[0]
	var names []string
	var starts []int
	for i := 0; i < len(header); {
		j := strings.Index(header[i:], "  ")
		if j < 0 {
			j = len(header) - i
		}
		names, starts = append(names, header[i:i+j]), append(starts, i)
		i += j
		for i < len(header) && header[i] == ' ' {
			i++
		}
	}
	rows := map[string]map[string]string{}
	for _, line := range lines[1:] {
		row := map[string]string{}
		for k, name := range names {
			end := len(line)
			if k+1 < len(starts) {
				end = min(starts[k+1], len(line))
			}
			if starts[k] < end {
				row[name] = strings.TrimSpace(line[starts[k]:end])
			}
		}
		rows[row["TAG"]] = row
	}
	return rows, out
}

// tagStep runs `dispenser tags ARGS STORE-ARGS` with env set: a step
// that wants an error must fail with one containing wantErr and leave
// tags list as it was; any other must print want, after which the column
// of tags list that column reads from each row must be wantState.
func tagStep(t *testing.T, storeArgs []string, name string, args []string, env map[string]string, wantErr, want string,
	wantState map[string]string, column func(row map[string]string) string) {
	t.Helper()
	_, before := listTable(t, storeArgs)
	for k, v := range env {
		t.Setenv(k, v)
	}
	out, err := runCmd(t, append(append([]string{"tags"}, args...), storeArgs...)...)
	for k := range env {
		os.Unsetenv(k)
	}
	if wantErr != "" {
		if err == nil || !strings.Contains(err.Error(), wantErr) {
			t.Fatalf("%s: got error %v, want one containing %q; output %q", name, err, wantErr, out)
		}
		if _, after := listTable(t, storeArgs); after != before {
			t.Fatalf("%s: a failed command changed the tags:\nbefore:\n%s\nafter:\n%s", name, before, after)
		}
		return
	}
	if err != nil || !strings.Contains(out, want) {
		t.Fatalf("%s: got %q, %v, want output containing %q", name, out, err, want)
	}
	rows, raw := listTable(t, storeArgs)
	got := map[string]string{}
	for tag, row := range rows {
		got[tag] = column(row)
	}
	if !maps.Equal(got, wantState) {
		t.Fatalf("%s: tags list shows %q, want %q:\n%s", name, got, wantState, raw)
	}
}

// cliStore is a store the admin commands reach, named by its flags.
type cliStore struct {
	name string
	args []string
}

// cliStores migrates a database of the test's PostgreSQL server and starts
// a NATS server, and returns the flags of both stores, the KV store's in
// bucket.
func cliStores(t *testing.T, bucket string) []cliStore {
	t.Helper()
	pg := testenv.Postgres(t)
	if out, err := runCmd(t, "migrate", "--postgres-url", pg); err != nil {
		t.Fatalf("migrate: %v\n%s", err, out)
	}
	ns := testenv.NATS(t)
	return []cliStore{
		{name: "postgres", args: []string{"--postgres-url", pg}},
		{name: "kv", args: []string{"--nats-url", ns.ClientURL(), "--segment-bucket", bucket}},
	}
}

// TestOrderedTagCommands: tags create --ordered, tags update
// --ordered=true|false, the ORDERED column of tags list, on every store;
// bad values fail and change nothing.
func TestOrderedTagCommands(t *testing.T) {
	stores := cliStores(t, "ordered_cli")
	// state is what tags list must show after a step: per tag "STEP ORDERED
	// DESCRIPTION".
	type state map[string]string
	steps := []struct {
		name    string
		args    []string
		env     string // DISPENSER_ORDERED, if not empty
		wantErr string // "": success
		want    string // in the output of a success
		state   state  // after a success; after an error, the list must be as before
	}{
		{name: "create ordered", args: []string{"create", "invoices", "--step", "10", "--ordered", "--description", "invoice numbers"},
			want: "created tag invoices: first ID 1, step 10, ordered yes", state: state{"invoices": "10 yes invoice numbers"}},
		{name: "create plain", args: []string{"create", "orders", "--step", "20"},
			want: "created tag orders: first ID 1, step 20, ordered no", state: state{"invoices": "10 yes invoice numbers", "orders": "20 no "}},
		{name: "create with a bad flag value", args: []string{"create", "users", "--step", "5", "--ordered=maybe"}, wantErr: `--ordered=maybe: want true or false`},
		{name: "create ordered existing", args: []string{"create", "orders", "--step", "20", "--ordered"}, wantErr: "already exists"},
		{name: "set on a plain tag, only --ordered", args: []string{"update", "orders", "--ordered=true"},
			want: "updated tag orders: ordered yes", state: state{"invoices": "10 yes invoice numbers", "orders": "20 yes "}},
		{name: "clear, step and description kept", args: []string{"update", "invoices", "--ordered=false"},
			want: "updated tag invoices: ordered no", state: state{"invoices": "10 no invoice numbers", "orders": "20 yes "}},
		{name: "bad value", args: []string{"update", "invoices", "--ordered=maybe"}, wantErr: `--ordered=maybe: want true or false`},
		{name: "value without =", args: []string{"update", "invoices", "--ordered", "false"}, wantErr: "--ordered=false"},
		{name: "empty value", args: []string{"update", "invoices", "--ordered="}, wantErr: "--ordered=: want true or false"},
		{name: "bare flag sets it", args: []string{"update", "invoices", "--ordered"},
			want: "ordered yes", state: state{"invoices": "10 yes invoice numbers", "orders": "20 yes "}},
		{name: "step only keeps it", args: []string{"update", "invoices", "--step", "30"},
			want: "updated tag invoices: step 30", state: state{"invoices": "30 yes invoice numbers", "orders": "20 yes "}},
		{name: "an exported DISPENSER_ORDERED is not read", args: []string{"update", "orders"}, env: "false", wantErr: "nothing to change"},
		{name: "with other fields", args: []string{"update", "orders", "--ordered=0", "--step", "25", "--description", "order numbers"},
			want: `step 25, description "order numbers", ordered no`, state: state{"invoices": "30 yes invoice numbers", "orders": "25 no order numbers"}},
		{name: "unknown tag", args: []string{"update", "nope", "--ordered=true"}, wantErr: "unknown tag"},
		{name: "invalid tag", args: []string{"update", "a.b", "--ordered=false"}, wantErr: "invalid tag"},
	}
	for _, st := range stores {
		t.Run(st.name, func(t *testing.T) {
			for _, s := range steps {
				var env map[string]string
				if s.env != "" {
					env = map[string]string{"DISPENSER_ORDERED": s.env}
				}
				tagStep(t, st.args, s.name, s.args, env, s.wantErr, s.want, s.state, func(row map[string]string) string {
					return row["STEP"] + " " + row["ORDERED"] + " " + row["DESCRIPTION"]
				})
			}
		})
	}
}

func TestHelpListsEnvironment(t *testing.T) {
	out, err := runCmd(t, "serve", "--help")
	if err == nil {
		t.Fatal("--help: want flag.ErrHelp")
	}
	for _, want := range []string{"--nats-url", "DISPENSER_NATS_URL", "--postgres-url", "DISPENSER_POSTGRES_URL", "--max-wait", "--queue-group"} {
		if !strings.Contains(out, want) {
			t.Errorf("help lacks %s", want)
		}
	}
	if _, err := runCmd(t, "frobnicate"); err == nil {
		t.Error("unknown command: want an error")
	}
	if _, err := runCmd(t, "serve", "--max-batch", "many"); err == nil {
		t.Error("bad flag value: want an error")
	}
}

func TestServeAndShutDown(t *testing.T) {
	url := testenv.Postgres(t)
	ns := testenv.NATS(t)
	if _, err := runCmd(t, "migrate", "--postgres-url", url); err != nil {
		t.Fatal(err)
	}
	if _, err := runCmd(t, "tags", "create", "orders", "--step", "100", "--postgres-url", url); err != nil {
		t.Fatal(err)
	}
	if _, err := runCmd(t, "tags", "create", "invoices", "--step", "10", "--ordered", "--postgres-url", url); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	var logs syncBuffer
	go func() {
		done <- run(ctx, []string{"--nats-url", ns.ClientURL(), "--postgres-url", url, "--instance", "w1"}, &logs, &logs)
	}()
	nc := testenv.Connect(t, ns)
	var body string
	// Each request waits until the deadline: one given up on could still
	// be served, taking IDs 1..3 (see waitForID).
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		resp, err := nc.Request("id.segment.orders", []byte("3"), time.Until(deadline))
		if err == nil && resp.Header.Get(micro.ErrorCodeHeader) == "" {
			body = string(resp.Data)
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if body != "1\n2\n3" {
		t.Fatalf("got %q, want 1..3; logs:\n%s", body, logs.String())
	}
	// This worker, the only one, owns the ordered tag once it served it.
	if resp, err := nc.Request("id.segment.invoices", nil, 30*time.Second); err != nil || resp.Header.Get(micro.ErrorCodeHeader) != "" {
		t.Fatalf("id.segment.invoices: %v %v; logs:\n%s", err, resp, logs.String())
	}
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("serve returned %v after shutdown", err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("serve did not stop")
	}
	// The log says what the shutdown gave back and released, and when
	// the worker stopped: its last line.
	lines := strings.Split(strings.TrimSpace(logs.String()), "\n")
	for _, want := range []string{
		`msg="released ordered tags to the other workers" count=1 tags=invoices`,
		`msg="gave unissued segment IDs back to the store" tags=1 ids=97 ranges="orders 4-100"`,
	} {
		if !strings.Contains(logs.String(), want) {
			t.Errorf("the shutdown's log lacks %s:\n%s", want, logs.String())
		}
	}
	if last := lines[len(lines)-1]; !strings.Contains(last, "msg=stopped shutdown=") {
		t.Errorf("the log's last line is %q, want msg=stopped", last)
	}
	if _, err := nc.Request("id.segment.orders", nil, 200*time.Millisecond); err != nats.ErrNoResponders && err != nats.ErrTimeout {
		t.Fatalf("after shutdown: err = %v, want no responders", err)
	}
	// The unissued rest of the segment was given back: the next ID is 4.
	out, err := runCmd(t, "tags", "list", "--postgres-url", url)
	if err != nil || !regexp.MustCompile(`(?m)^orders +4 `).MatchString(out) {
		t.Fatalf("after give-back: %q, %v; want next ID 4", out, err)
	}
}

// freeAddr returns a loopback address with a port that was free just now,
// below the kernel's ephemeral port range (testenv.ServerPort): a port from
// that range can be taken by any process's outgoing connection before the
// worker binds it (seen on a busy machine: "bind: address already in use").
func freeAddr(t *testing.T) string {
	t.Helper()
	port, err := testenv.ServerPort()
	if err != nil {
		t.Fatal(err)
	}
	return net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
}

func TestMetricsAndHealth(t *testing.T) {
	url := testenv.Postgres(t)
	ns := testenv.NATS(t)
	runCmd(t, "migrate", "--postgres-url", url)
	runCmd(t, "tags", "create", "orders", "--step", "100", "--postgres-url", url)
	addr := freeAddr(t)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	var logs syncBuffer
	go func() {
		done <- run(ctx, []string{"--nats-url", ns.ClientURL(), "--postgres-url", url, "--metrics-addr", addr, "--metrics-tags", "orders"}, &logs, &logs)
	}()
	t.Cleanup(func() { cancel(); <-done })
	nc := testenv.Connect(t, ns)
	deadline := time.Now().Add(30 * time.Second)
	for {
		if resp, err := nc.Request("id.segment.orders", []byte("7"), time.Until(deadline)); err == nil && resp.Header.Get(micro.ErrorCodeHeader) == "" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("service did not answer; logs:\n%s", logs.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
	if code, body := testenv.HTTPGet(t, "http://"+addr+"/healthz"); code != 200 {
		t.Fatalf("/healthz: %d %s", code, body)
	}
	if code, body := testenv.HTTPGet(t, "http://"+addr+"/readyz"); code != 200 {
		t.Fatalf("/readyz: %d %s", code, body)
	}
	code, body := testenv.HTTPGet(t, "http://"+addr+"/metrics")
	if code != 200 {
		t.Fatalf("/metrics: %d", code)
	}
	for _, want := range []string{
		`dispenser_ids_total{endpoint="segment",tag="orders",transport="nats"} 7`,
		`dispenser_segment_fetches_total{tag="orders"} 1`,
		"dispenser_request_duration_seconds_bucket",
		"dispenser_snowflake_lease_held 1",
		`dispenser_segment_fetch_duration_seconds_count{result="ok"} 1`,
		"dispenser_snowflake_clock_backwards_total 0",
		"go_goroutines",
	} {
		if !strings.Contains(body, want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}
}

// syncBuffer collects output for a test to read (testenv.LogBuffer).
type syncBuffer = testenv.LogBuffer

func TestZeroSetup(t *testing.T) {
	dir := t.TempDir()
	listen := freeAddr(t)
	t.Chdir(dir) // the default --data-dir is relative
	metrics := freeAddr(t)
	logs := startServe(t, "--nats-listen", listen, "--metrics-addr", metrics)
	nc, err := nats.Connect("nats://"+listen, nats.RetryOnFailedConnect(true), nats.MaxReconnects(-1), nats.ReconnectWait(10*time.Millisecond))
	if err != nil {
		t.Fatalf("connect to the embedded server: %v; logs:\n%s", err, logs.String())
	}
	t.Cleanup(nc.Close)
	// Tags are created on first use in zero-setup mode.
	if got := waitForID(t, nc, "id.segment.demo", logs); got != "1" {
		t.Fatalf("id.segment.demo: got %q, want 1", got)
	}
	sf := waitForID(t, nc, "id.snowflake", logs)
	resp, err := nc.Request("id.snowflake.decode", []byte(sf), 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	var parts struct {
		ID       string `json:"id"`
		Time     string `json:"time"`
		Worker   int    `json:"worker"`
		Sequence int    `json:"sequence"`
	}
	if err := json.Unmarshal(resp.Data, &parts); err != nil || parts.ID != sf {
		t.Fatalf("decode %s: %s (%v)", sf, resp.Data, err)
	}
	if ts, err := time.Parse(time.RFC3339, parts.Time); err != nil || time.Since(ts) > time.Hour || time.Since(ts) < -time.Hour {
		t.Fatalf("decoded time %q is not about now", parts.Time)
	}
	out, err := runCmd(t, "decode", sf)
	if err != nil || !strings.Contains(out, parts.Time) {
		t.Fatalf("dispenser decode %s: %q, %v; want time %s", sf, out, err, parts.Time)
	}
	// The KV store is administered with --nats-url and the worker's key
	// (a client without it is a requester: worker.RequesterUser).
	url := "nats://" + listen
	if out, err := runCmd(t, "tags", "list", "--nats-url", url); err == nil || !strings.Contains(err.Error(), "--nats-nkey ./dispenser-data/dispenser.nk") {
		t.Fatalf("tags list without the worker's key: %v %s; want a refusal that names --nats-nkey", err, out)
	}
	key := filepath.Join("dispenser-data", worker.KeyFile)
	if out, err := runCmd(t, "tags", "create", "orders", "--step", "50", "--start", "1000", "--nats-url", url, "--nats-nkey", key); err != nil {
		t.Fatalf("tags create: %v %s", err, out)
	}
	out, err = runCmd(t, "tags", "list", "--nats-url", url, "--nats-nkey", key)
	if err != nil || !strings.Contains(out, "demo") || !strings.Contains(out, "orders  1000") {
		t.Fatalf("tags list: %q, %v", out, err)
	}
	if got := waitForID(t, nc, "id.segment.orders", logs); got != "1000" {
		t.Fatalf("orders: got %q, want 1000", got)
	}
	if _, err := os.Stat(filepath.Join(dir, "dispenser-data", "jetstream")); err != nil {
		t.Fatalf("data directory: %v", err)
	}
	if code, body := testenv.HTTPGet(t, "http://"+metrics+"/readyz"); code != 200 {
		t.Fatalf("/readyz in zero-setup mode: %d %s", code, body)
	}
}

func TestDecodeRejectsBadInput(t *testing.T) {
	for _, arg := range []string{"abc", "-5", "99999999999999999999"} {
		if _, err := runCmd(t, "decode", arg); err == nil {
			t.Errorf("decode %q: want an error", arg)
		}
	}
}

// TestServeRejectsBadSettingsBeforeStarting: serve refuses each bad
// setting with an error that names its flag, before it starts anything
// (no data directory). Each case runs under a deadline, with an embedded
// nats-server that could start (a random port), so that a setting let
// through ends the case with "ran until the deadline", not a hang.
func TestServeRejectsBadSettingsBeforeStarting(t *testing.T) {
	tests := []struct {
		name string
		args []string
		flag string // the error must name it
	}{
		{name: "max batch 0", args: []string{"--max-batch", "0"}, flag: "--max-batch"},
		{name: "max batch too large", args: []string{"--max-batch", "100000000"}, flag: "--max-batch"},
		{name: "prefetch ratio 0", args: []string{"--prefetch-ratio", "0"}, flag: "--prefetch-ratio"},
		{name: "prefetch ratio above 1", args: []string{"--prefetch-ratio", "1.5"}, flag: "--prefetch-ratio"},
		{name: "max step 0", args: []string{"--max-step", "0"}, flag: "--max-step"},
		{name: "max depth 0", args: []string{"--max-depth", "0"}, flag: "--max-depth"},
		{name: "max depth too large", args: []string{"--max-depth", "2000000"}, flag: "--max-depth"},
		{name: "max wait 0", args: []string{"--max-wait", "0s"}, flag: "--max-wait"},
		{name: "fetch timeout 0", args: []string{"--fetch-timeout", "0s"}, flag: "--fetch-timeout"},
		{name: "refresh interval 0", args: []string{"--refresh-interval", "0s"}, flag: "--refresh-interval"},
		{name: "unknown tag ttl 0", args: []string{"--unknown-tag-ttl", "0s"}, flag: "--unknown-tag-ttl"},
		{name: "shutdown timeout 0", args: []string{"--shutdown-timeout", "0s"}, flag: "--shutdown-timeout"},
		{name: "witness replicas 0", args: []string{"--witness-replicas", "0"}, flag: "--witness-replicas"},
		{name: "witness replicas 6", args: []string{"--witness-replicas", "6"}, flag: "--witness-replicas"},
		{name: "http max conns 0", args: []string{"--http-max-conns", "0"}, flag: "--http-max-conns"},
		{name: "ordered replicas 0", args: []string{"--ordered-replicas", "0"}, flag: "--ordered-replicas"},
		{name: "ordered lease 0", args: []string{"--ordered-lease", "0s"}, flag: "--ordered-lease"},
		{name: "snowflake heartbeat above the lease", args: []string{"--snowflake-lease", "1s", "--snowflake-heartbeat", "2s"}, flag: "--snowflake-heartbeat"},
		{name: "snowflake epoch in the future", args: []string{"--snowflake-epoch", "2999-01-01T00:00:00Z"}, flag: "--snowflake-epoch"},
		{name: "snowflake layout unknown", args: []string{"--snowflake-layout", "js53"}, flag: "--snowflake-layout"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			t.Chdir(dir)
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			err := run(ctx, append([]string{"serve", "--nats-listen", "127.0.0.1:-1"}, tt.args...), io.Discard, io.Discard)
			switch {
			case ctx.Err() != nil:
				t.Errorf("serve %v: ran until the deadline (returned %v), want it refused naming %s", tt.args, err, tt.flag)
			case err == nil:
				t.Errorf("serve %v: no error, want one naming %s", tt.args, tt.flag)
			case !strings.Contains(err.Error(), tt.flag):
				t.Errorf("serve %v: %v, want an error naming %s", tt.args, err, tt.flag)
			}
			// Nothing was started: no data directory was created.
			if _, err := os.Stat(filepath.Join(dir, "dispenser-data")); !os.IsNotExist(err) {
				t.Errorf("serve %v: data directory exists after rejected settings: %v", tt.args, err)
			}
		})
	}
	out, err := runCmd(t, "tags", "--help")
	if err != nil || !strings.Contains(out, "tags create TAG") {
		t.Fatalf("tags --help: %q, %v", out, err)
	}
}

// Workers of different stores in one queue group would hand out the same
// IDs: the second one refuses to start.
func TestServeRefusesAQueueGroupOfAnotherStore(t *testing.T) {
	url := testenv.Postgres(t)
	ns := testenv.NATS(t)
	runCmd(t, "migrate", "--postgres-url", url)
	runCmd(t, "tags", "create", "orders", "--step", "100", "--postgres-url", url)
	logs := startServe(t, "--nats-url", ns.ClientURL(), "--postgres-url", url)
	nc := testenv.Connect(t, ns)
	waitForID(t, nc, "id.segment.orders", logs)

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var out bytes.Buffer
	err := run(ctx, []string{"--nats-url", ns.ClientURL(), "--snowflake-bucket", "other_workers"}, &out, &out)
	if err == nil || !strings.Contains(err.Error(), "hand out the same IDs") {
		t.Fatalf("KV worker beside a PostgreSQL worker: err = %v, want a refusal", err)
	}
	// Another queue group is fine.
	ctx2, cancel2 := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- run(ctx2, []string{"--nats-url", ns.ClientURL(), "--queue-group", "kv-workers", "--prefix", "kvid", "--snowflake-bucket", "other_workers"}, &out, &out)
	}()
	waitForID(t, nc, "kvid.snowflake", logs)
	cancel2()
	if err := <-done; err != nil {
		t.Fatalf("worker in its own queue group: %v", err)
	}
}
