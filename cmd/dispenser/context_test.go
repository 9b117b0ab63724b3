package main

import (
	"cmp"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"

	"github.com/dispenser-dev/dispenser/testenv"
)

// writeContext writes the nats CLI context name into a fresh
// XDG_CONFIG_HOME, as `nats context save` would, and returns its file.
func writeContext(t *testing.T, name string, fields map[string]any) string {
	t.Helper()
	dir := os.Getenv("XDG_CONFIG_HOME")
	if dir == "" {
		dir = t.TempDir()
		t.Setenv("XDG_CONFIG_HOME", dir)
	}
	p := filepath.Join(dir, "nats", "context", name+".json")
	if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
		t.Fatal(err)
	}
	data, err := json.Marshal(fields)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, data, 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// writeFile writes a secret file and returns its path.
func writeFile(t *testing.T, name, content string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestNATSContext: the worker and the admin commands connect with a nats
// CLI context (user and password; a creds file), flags override it, a
// password file works without a context, and a context with a setting
// dispenser does not support is refused, naming it.
func TestNATSContext(t *testing.T) {
	const password = "ctx-s3cret"
	opts := testenv.NATSOptions(t.TempDir())
	opts.Users = []*server.User{{Username: "alice", Password: password}}
	ns := testenv.StartNATS(t, opts)
	t.Cleanup(ns.Shutdown)
	url := ns.ClientURL()
	// Not given on any command line below, so no process list shows it.
	writeContext(t, "ids", map[string]any{
		"description": "the ids deployment", "url": url, "user": "alice", "password": password,
		"creds": "", "nkey": "", "cert": "", "key": "", "ca": "", "jetstream_domain": "", "tls_first": false,
	})
	writeContext(t, "wrong", map[string]any{"url": "nats://127.0.0.1:1", "user": "alice", "password": "not-it"})
	writeContext(t, "domain", map[string]any{"url": url, "user": "alice", "password": password, "jetstream_domain": "hub"})
	writeContext(t, "resolver", map[string]any{"url": url, "user": "alice", "password": "op://vault/nats/password"})
	pwFile := writeFile(t, "password", password+"\n")

	tests := []struct {
		name    string
		args    []string
		wantErr string // empty: success
	}{
		{name: "context", args: []string{"--nats-context", "ids"}},
		{name: "context file path", args: []string{"--nats-context", filepath.Join(os.Getenv("XDG_CONFIG_HOME"), "nats", "context", "ids.json")}},
		{name: "flags override the context", args: []string{"--nats-context", "wrong", "--nats-url", url, "--nats-user", "alice", "--nats-password-file", pwFile}},
		{name: "password file", args: []string{"--nats-url", url, "--nats-user", "alice", "--nats-password-file", pwFile}},
		{name: "no credentials", args: []string{"--nats-url", url}, wantErr: "Authorization Violation"},
		{name: "context credentials replaced by the flags'", args: []string{"--nats-context", "ids", "--nats-token-file", pwFile}, wantErr: "Authorization Violation"},
		{name: "unsupported field", args: []string{"--nats-context", "domain"}, wantErr: "sets jetstream_domain, which dispenser does not support"},
		{name: "resolver reference", args: []string{"--nats-context", "resolver"}, wantErr: "password is a reference for a credential resolver (op://…)"},
		{name: "unknown context", args: []string{"--nats-context", "nope"}, wantErr: "nope.json: no such file"},
		{name: "bad context name", args: []string{"--nats-context", "../x"}, wantErr: "want a context name"},
		{name: "password without user", args: []string{"--nats-url", url, "--nats-password-file", pwFile}, wantErr: "needs a user"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			out, err := runCmd(t, append([]string{"tags", "list"}, tt.args...)...)
			if tt.wantErr == "" {
				if err != nil {
					t.Fatalf("tags list %v: %v\n%s", tt.args, err, out)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("tags list %v: err = %v, want one containing %q", tt.args, err, tt.wantErr)
			}
			if strings.Contains(err.Error()+out, password) {
				t.Errorf("the error shows the password: %v", err)
			}
		})
	}

	// The worker: serves with the context, and its log has no password.
	logs := startServe(t, "--nats-context", "ids", "--auto-create-tags")
	app, err := nats.Connect(url, nats.UserInfo("alice", password))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(app.Close)
	if got := waitForID(t, app, "id.segment.ctx", logs); got != "1" {
		t.Fatalf("a worker with --nats-context: got %q, want 1", got)
	}
	if strings.Contains(logs.String(), password) {
		t.Errorf("the worker's log shows the password:\n%s", logs.String())
	}
}

// TestNATSContextCreds: a context naming a creds file reaches a server
// with decentralized JWT auth.
func TestNATSContextCreds(t *testing.T) {
	opts := testenv.NATSOptions(t.TempDir())
	creds := operator(t, opts)
	ns := testenv.StartNATS(t, opts)
	t.Cleanup(ns.Shutdown)
	writeContext(t, "jwt", map[string]any{"url": ns.ClientURL(), "creds": creds("dispenser")})
	logs := startServe(t, "--nats-context", "jwt", "--auto-create-tags")
	app, err := nats.Connect(ns.ClientURL(), nats.UserCredentials(creds("app")))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(app.Close)
	if got := waitForID(t, app, "id.segment.jwt", logs); got != "1" {
		t.Fatalf("a worker with a creds context: got %q, want 1", got)
	}
	if out, err := runCmd(t, "tags", "list", "--nats-context", "jwt"); err != nil || !strings.Contains(out, "jwt") {
		t.Fatalf("tags list with a creds context: %v\n%s", err, out)
	}
}

// TestNATSContextInboxPrefix: a context's inbox_prefix is used (a user who
// may subscribe only under its own prefix reaches the store with it, not
// without it) and is checked as --nats-inbox-prefix is: a prefix that is
// not a plain subject is refused, and so is, for a worker, one under the
// service's prefix, where requesters publish; --nats-inbox-prefix
// replaces it. Before, a context's prefix was used unchecked.
func TestNATSContextInboxPrefix(t *testing.T) {
	const password = "inbox-s3cret"
	opts := testenv.NATSOptions(t.TempDir())
	opts.Users = []*server.User{
		{Username: "alice", Password: password, Permissions: &server.Permissions{
			Publish:   &server.SubjectPermission{Allow: []string{">"}},
			Subscribe: &server.SubjectPermission{Allow: []string{"_INBOX_alice.>"}},
		}},
		{Username: "svc", Password: password},
	}
	ns := testenv.StartNATS(t, opts)
	t.Cleanup(ns.Shutdown)
	url := ns.ClientURL()
	ctx := func(name, user, inbox string) {
		fields := map[string]any{"url": url, "user": user, "password": password}
		if inbox != "" {
			fields["inbox_prefix"] = inbox
		}
		writeContext(t, name, fields)
	}
	ctx("scoped", "alice", "_INBOX_alice")
	ctx("unscoped", "alice", "")
	ctx("wildcard", "svc", "_INBOX_*")
	ctx("system", "svc", "$SYS.replies")
	ctx("service", "svc", "id.replies")

	for _, tt := range []struct {
		name    string
		args    []string
		wantErr string        // empty: success
		wait    time.Duration // the run's deadline; default 20 s
	}{
		{name: "its own prefix", args: []string{"tags", "list", "--nats-context", "scoped"}},
		// Its requests wait for replies the server does not deliver,
		// until the deadline.
		{name: "the default prefix, not allowed", args: []string{"tags", "list", "--nats-context", "unscoped"}, wantErr: "Permissions Violation",
			wait: 3 * time.Second},
		{name: "a wildcard", args: []string{"tags", "list", "--nats-context", "wildcard"}, wantErr: "inbox_prefix of --nats-context wildcard"},
		{name: "a system subject", args: []string{"tags", "list", "--nats-context", "system"}, wantErr: "inbox_prefix of --nats-context system"},
		{name: "a worker's inbox under its prefix", args: []string{"serve", "--nats-context", "service"}, wantErr: "inbox_prefix of --nats-context service"},
		{name: "a worker's inbox with a wildcard", args: []string{"serve", "--nats-context", "wildcard"}, wantErr: "inbox_prefix of --nats-context wildcard"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			// Bounded: a worker that were not refused would serve.
			c, cancel := context.WithTimeout(context.Background(), cmp.Or(tt.wait, 20*time.Second))
			defer cancel()
			out, err := runCmdCtx(c, tt.args...)
			if tt.wantErr == "" {
				if err != nil {
					t.Fatalf("%v: %v\n%s", tt.args, err, out)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error()+out, tt.wantErr) {
				t.Fatalf("%v: err = %v, want one containing %q\n%s", tt.args, err, tt.wantErr, out)
			}
		})
	}

	// --nats-inbox-prefix replaces the context's: the worker serves.
	logs := startServe(t, "--nats-context", "service", "--nats-inbox-prefix", "_INBOX_svc", "--auto-create-tags")
	app, err := nats.Connect(url, nats.UserInfo("svc", password))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(app.Close)
	if got := waitForID(t, app, "id.segment.inbox", logs); got != "1" {
		t.Fatalf("a worker whose --nats-inbox-prefix replaces the context's: got %q, want 1", got)
	}
}
