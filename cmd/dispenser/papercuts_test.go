package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"html"
	"net"
	"regexp"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"

	"github.com/dispenser-dev/dispenser/internal/buildinfo"
	"github.com/dispenser-dev/dispenser/protocol"
	"github.com/dispenser-dev/dispenser/testenv"
)

// TestVersion: `dispenser version` prints the module's version and the Go
// version (and, in a binary built in a checkout, the VCS revision).
func TestVersion(t *testing.T) {
	out, err := runCmd(t, "version")
	if err != nil {
		t.Fatalf("version: %v", err)
	}
	if !strings.HasPrefix(out, "dispenser ") || !strings.Contains(out, runtime.Version()) {
		t.Errorf("version printed %q, want dispenser, a version and %s", out, runtime.Version())
	}
}

// TestHelpListsCommands: `dispenser --help` shows the commands, then
// serve's flags, each default once.
func TestHelpListsCommands(t *testing.T) {
	out, err := runCmd(t, "--help")
	if err != nil && !errors.Is(err, flag.ErrHelp) {
		t.Fatalf("--help: %v", err)
	}
	for _, want := range []string{"dispenser migrate", "dispenser tags create", "dispenser version", "--nats-url", "--snowflake-heartbeat"} {
		if !strings.Contains(out, want) {
			t.Errorf("--help lacks %q:\n%s", want, out)
		}
	}
	if strings.Contains(out, "(default 0s)") {
		t.Errorf("--help shows a zero duration as a default:\n%s", out)
	}
}

// TestVersionEverywhere: the binary's `version` and `--version`, its micro
// service ($SRV.INFO, what `nats micro ls` shows) and its status page
// report one version, a semantic version (micro's rule), built by `go
// build` as a user builds it.
func TestVersionEverywhere(t *testing.T) {
	bin := dispenserBinary(t)
	var printed []string
	for _, arg := range []string{"version", "--version"} {
		out, errOut, err := runBinary(t, nil, bin, arg)
		if err != nil {
			t.Fatalf("dispenser %s: %v\n%s", arg, err, errOut)
		}
		f := strings.Fields(out)
		if len(f) < 3 || f[0] != "dispenser" {
			t.Fatalf("dispenser %s printed %q, want dispenser VERSION GOVERSION …", arg, out)
		}
		printed = append(printed, f[1])
	}
	if printed[0] != printed[1] {
		t.Errorf("version says %s, --version %s", printed[0], printed[1])
	}
	v := printed[0]
	if !buildinfo.ValidVersion(v) {
		t.Errorf("version %q is not a semantic version", v)
	}
	listen, metrics := freeAddr(t), freeAddr(t)
	p := startBinary(t, t.TempDir(), "--nats-listen", listen, "--metrics-addr", metrics)
	info := p.serviceInfo(t, "nats://"+listen, "snowflake")
	if info.Version != v {
		t.Errorf("the micro service reports version %q, the binary %q", info.Version, v)
	}
	// The metrics listener opens after the service registers.
	deadline := time.Now().Add(30 * time.Second)
	for {
		c, err := net.Dial("tcp", metrics)
		if err == nil {
			c.Close()
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("--metrics-addr %s: %v", metrics, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	code, page := testenv.HTTPGet(t, "http://"+metrics+"/status")
	// html/template writes + as &#43;: compare the text, unescaped.
	want := `<th class="name">version</th><td class="name">` + v + `</td>`
	if code != 200 || !strings.Contains(html.UnescapeString(page), want) {
		t.Errorf("/status (%d) does not show version %s as %q:\n%s", code, v, want, page)
	}
}

// TestFlagErrors: a mistyped flag or a bad value prints one error and
// where to look, not the command's help (about 170 lines for serve) above
// and below it.
func TestFlagErrors(t *testing.T) {
	for _, tc := range []struct {
		name string
		args []string
		want string // the error main prints after "dispenser: "
	}{
		{"unknown flag", []string{"--maxwait", "1s"}, "unknown flag: --maxwait\nrun 'dispenser serve --help' for its flags"},
		{"unknown flag of serve", []string{"serve", "-bogus"}, "unknown flag: --bogus\nrun 'dispenser serve --help' for its flags"},
		{"bad boolean", []string{"tags", "create", "x", "--step", "1", "--ordered=maybe"}, "--ordered=maybe: want true or false\nrun 'dispenser tags create --help' for its flags"},
		{"bad number", []string{"--max-batch", "many"}, "--max-batch=many: want a whole number\nrun 'dispenser serve --help' for its flags"},
		{"bad duration", []string{"--max-wait", "5"}, "--max-wait=5: want a duration such as 250ms, 2s or 1m\nrun 'dispenser serve --help' for its flags"},
		{"missing value", []string{"decode", "--region-bits"}, "flag needs an argument: --region-bits\nrun 'dispenser decode --help' for its flags"},
		{"unknown command", []string{"frobnicate"}, "unknown command \"frobnicate\"\nrun 'dispenser help' for the commands"},
		// Go's zero time is the snowflake package's "unset": serve and
		// decode silently counted from the default epoch (2026) instead.
		{"zero epoch", []string{"--snowflake-epoch", "0001-01-01T00:00:00Z", "--nats-url", "nats://127.0.0.1:1"}, zeroEpoch},
		{"zero epoch in another zone", []string{"--snowflake-epoch", "0001-01-01T01:00:00+01:00", "--nats-url", "nats://127.0.0.1:1"}, `--snowflake-epoch "0001-01-01T01:00:00+01:00": ` + zeroEpoch[len(`--snowflake-epoch "0001-01-01T00:00:00Z": `):]},
		{"zero epoch of decode", []string{"decode", "1", "--snowflake-epoch", "0001-01-01T00:00:00Z"}, zeroEpoch},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var out bytes.Buffer
			err := run(context.Background(), tc.args, &out, &out)
			if err == nil || err.Error() != tc.want {
				t.Errorf("error %v, want %q", err, tc.want)
			}
			if out.Len() > 0 {
				t.Errorf("printed %d lines besides the error:\n%s", strings.Count(out.String(), "\n"), out.String())
			}
		})
	}
}

// zeroEpoch is the refusal of --snowflake-epoch 0001-01-01T00:00:00Z.
const zeroEpoch = `--snowflake-epoch "0001-01-01T00:00:00Z": snowflake: invalid settings: the zero time stands for "not set" (the default epoch, 2026-01-01T00:00:00Z), and it is far beyond any layout's range: give the epoch the workers use, e.g. 2026-01-01T00:00:00Z`

// TestEnvironmentScope: environment variables are for what a deployment
// sets. A command's own settings read none (an exported DISPENSER_STEP
// does not change the next `tags create`), and every variable a command
// reads is one of serve's, with serve's meaning.
func TestEnvironmentScope(t *testing.T) {
	bucket := "env_scope"
	ns := testenv.NATS(t)
	store := []string{"--nats-url", ns.ClientURL(), "--segment-bucket", bucket}
	for k, v := range map[string]string{"DISPENSER_STEP": "5", "DISPENSER_START": "100", "DISPENSER_ORDERED": "true",
		"DISPENSER_DESCRIPTION": "from the shell", "DISPENSER_RESET": "day", "DISPENSER_FORMAT": "X-{seq:3}"} {
		t.Setenv(k, v)
	}
	if _, err := runCmd(t, append([]string{"tags", "create", "x"}, store...)...); err == nil || !strings.Contains(err.Error(), "--step is required") {
		t.Errorf("tags create x with DISPENSER_STEP=5: error %v, want --step is required", err)
	}
	out, err := runCmd(t, append([]string{"tags", "create", "x", "--step", "7"}, store...)...)
	if want := "created tag x: first ID 1, step 7, ordered no\n"; err != nil || out != want {
		t.Errorf("tags create x --step 7 with DISPENSER_*: %q, %v; want %q", out, err, want)
	}
	if _, err := runCmd(t, append([]string{"tags", "update", "x"}, store...)...); err == nil || !strings.Contains(err.Error(), "nothing to change") {
		t.Errorf("tags update x with DISPENSER_*: error %v, want nothing to change", err)
	}
	// Store flags do read theirs: the bucket from the environment.
	t.Setenv("DISPENSER_SEGMENT_BUCKET", bucket)
	if out, err := runCmd(t, "tags", "list", "--nats-url", ns.ClientURL()); err != nil || !strings.Contains(out, "\nx ") {
		t.Errorf("tags list with DISPENSER_SEGMENT_BUCKET: %q, %v; want tag x", out, err)
	}

	serveOut, _ := runCmd(t, "serve", "--help")
	envLine := regexp.MustCompile(`(?m)^\s+env (DISPENSER_[A-Z0-9_]+)$`)
	serveEnv := map[string]bool{}
	for _, m := range envLine.FindAllStringSubmatch(serveOut, -1) {
		serveEnv[m[1]] = true
	}
	if !serveEnv["DISPENSER_NATS_URL"] || !serveEnv["DISPENSER_MAX_WAIT"] {
		t.Fatalf("serve --help lists no environment variables:\n%s", serveOut)
	}
	for _, cmd := range [][]string{{"migrate"}, {"tags", "list"}, {"tags", "create"}, {"tags", "update"}, {"tags", "import"}, {"decode"}, {"bench"}} {
		out, _ := runCmd(t, append(cmd, "--help")...)
		for _, m := range envLine.FindAllStringSubmatch(out, -1) {
			if !serveEnv[m[1]] {
				t.Errorf("%s reads %s, which is no flag of serve", strings.Join(cmd, " "), m[1])
			}
		}
		for _, own := range []string{"DISPENSER_STEP", "DISPENSER_FORMAT", "DISPENSER_ORDERED", "DISPENSER_DURATION"} {
			if strings.Contains(out, own) {
				t.Errorf("%s --help lists %s", strings.Join(cmd, " "), own)
			}
		}
	}
}

// TestOperatorErrorText: the errors an operator reads (the binary's last
// line, dispenser: …) and a client reads (an error reply's description)
// are sentences said once: no package names of the code ("kv:",
// "segment:", "protocol:"), no "dispenser: dispenser:".
func TestOperatorErrorText(t *testing.T) {
	bin := dispenserBinary(t)
	listen := freeAddr(t)
	p := startBinary(t, t.TempDir(), "--nats-listen", listen)
	url := "nats://" + listen
	p.serviceInfo(t, url, "segment", "snowflake", "snowflake_decode")
	// The embedded server lets only the worker's key administer it, and
	// requesters without it ask only for well-formed subjects.
	key, _ := p.keyFile()

	for _, tc := range []struct {
		name string
		args []string
		want string // the binary's standard error
	}{
		{"invalid tag", []string{"tags", "create", "a.b", "--step", "5", "--nats-url", url, "--nats-nkey", key},
			`dispenser: create tag: invalid tag "a.b": want 1-128 characters of [A-Za-z0-9_-]`},
		{"invalid step", []string{"tags", "create", "x", "--step", "0", "--nats-url", url, "--nats-nkey", key},
			`dispenser: create tag: "x": invalid step 0: want 1..2147483647`},
		{"unknown tag", []string{"tags", "update", "nope", "--step", "5", "--nats-url", url, "--nats-nkey", key},
			`dispenser: update tag "nope": unknown tag`},
		{"bad worker setting", []string{"--max-batch", "2000000", "--nats-url", url},
			`dispenser: invalid configuration: --max-batch 2000000: want 1..1000000 (and a reply of 20 bytes per ID must fit the NATS max payload)`},
		{"bad flag", []string{"tags", "create", "x", "--stp", "5"},
			"dispenser: unknown flag: --stp\nrun 'dispenser tags create --help' for its flags"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, errOut, err := runBinary(t, nil, bin, tc.args...)
			if err == nil {
				t.Fatalf("dispenser %v succeeded, want: %s", tc.args, tc.want)
			}
			if got := strings.TrimRight(errOut, "\n"); got != tc.want {
				t.Errorf("dispenser %v printed\n%s\nwant\n%s", tc.args, got, tc.want)
			}
		})
	}

	opt, err := nats.NkeyOptionFromSeed(key)
	if err != nil {
		t.Fatal(err)
	}
	nc, err := nats.Connect(url, opt)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	for _, tc := range []struct {
		name, subject, body, format string
		want                        string // the description
	}{
		{"decode not a number", "id.snowflake.decode", "abc", "", `bad snowflake ID: "abc" is not a non-negative decimal int64`},
		{"decode negative", "id.snowflake.decode", "-5", "", `bad snowflake ID: "-5" is not a non-negative decimal int64`},
		{"bad count", "id.segment.orders", "zero", "", `bad count "zero": want a decimal count in 1..10000`},
		{"bad subject", "id.segment.a.b", "", "", `bad subject "id.segment.a.b": want id.segment.<tag>, tag 1-128 characters of [A-Za-z0-9_-]`},
		{"bad format", "id.segment.orders", "", "xml", `bad header: Id-Format "xml": want list, range or formatted`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			msg := nats.NewMsg(tc.subject)
			msg.Data = []byte(tc.body)
			if tc.format != "" {
				msg.Header.Set(protocol.FormatHeader, tc.format)
			}
			resp, err := nc.RequestMsg(msg, 10*time.Second)
			if err != nil {
				t.Fatal(err)
			}
			if got := resp.Header.Get(micro.ErrorHeader); got != tc.want {
				t.Errorf("description %q, want %q", got, tc.want)
			}
		})
	}
}

// TestJSONLogDurations: --log-format json writes a duration as text with
// its unit ("312ms"), not as nanoseconds.
func TestJSONLogDurations(t *testing.T) {
	var out bytes.Buffer
	log, err := newLogger(&out, "info", "json")
	if err != nil {
		t.Fatal(err)
	}
	log.Info("serving", "startup", 312*time.Millisecond)
	if want := `"startup":"312ms"`; !strings.Contains(out.String(), want) {
		t.Errorf("logged %s, want %s", out.String(), want)
	}
}
