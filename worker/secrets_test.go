package worker

import (
	"context"
	"errors"
	"log/slog"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/dispenser-dev/dispenser/tagmodel"
	"github.com/dispenser-dev/dispenser/testenv"
)

// TestSecretsNotLogged: a worker given a NATS URL with a user and password
// (the way before --nats-password-file) logs it masked, in text and JSON
// logs, and so does the status page; a failed connection's error masks it
// too.
func TestSecretsNotLogged(t *testing.T) {
	const password = "s3cret-pw"
	opts := testenv.NATSOptions(t.TempDir())
	opts.Users = []*server.User{{Username: "alice", Password: password}}
	ns := testenv.StartNATS(t, opts)
	t.Cleanup(ns.Shutdown)
	url := "nats://alice:" + password + "@" + ns.Addr().String()
	for _, format := range []string{"text", "json"} {
		t.Run(format, func(t *testing.T) {
			logs := &testenv.LogBuffer{}
			h := slog.Handler(slog.NewTextHandler(logs, nil))
			if format == "json" {
				h = slog.NewJSONHandler(logs, nil)
			}
			w, err := New(context.Background(), Config{NATS: NATS{URL: url}, Logger: slog.New(h), NoSnowflake: true,
				MetricsAddr: "127.0.0.1:0", Instance: "secrets-" + format, ShutdownTimeout: 2 * time.Second})
			if err != nil {
				t.Fatal(err)
			}
			_, status := testenv.HTTPGet(t, "http://"+w.httpAddr+"/status")
			w.Close()
			out := logs.String()
			if !strings.Contains(out, "serving") || !strings.Contains(out, "alice:xxxxx@") {
				t.Fatalf("no serving line with the masked URL in the log:\n%s", out)
			}
			if strings.Contains(out, password) {
				t.Errorf("the %s log shows the password:\n%s", format, out)
			}
			if strings.Contains(status, password) {
				t.Errorf("the status page shows the password")
			}
		})
	}
	_, err := NATS{URL: "nats://alice:" + password + "@127.0.0.1:1"}.Connect("t", false)
	if err == nil || strings.Contains(err.Error(), password) {
		t.Errorf("connecting to a closed port: err = %v, want an error without the password", err)
	}
}

// pingFails opens the KV store wrapped so that its Ping fails with an
// error naming a host and a user, as a database driver's do.
type pingFails struct{ KV }

const storeSecretHost, storeSecretUser = "db-primary.internal.example", "dispenser_admin"

type failingPing struct{ tagmodel.Store }

func (failingPing) Ping(context.Context) error {
	return errors.New("failed to connect to `user=" + storeSecretUser + " database=ids`: " + storeSecretHost + ":5432: connection refused")
}

func (p pingFails) OpenStore(ctx context.Context, js jetstream.JetStream, env StoreEnv) (*Store, error) {
	st, err := p.KV.OpenStore(ctx, js, env)
	if err != nil {
		return nil, err
	}
	st.Store = failingPing{st.Store}
	return st, nil
}

// TestReadyzHidesTheStoreError: /readyz of a worker whose store fails
// says which part is not ready, not the store's error (which names hosts
// and users, for anyone who reaches the port); the log has the detail.
func TestReadyzHidesTheStoreError(t *testing.T) {
	ns := testenv.StartNATS(t, testenv.NATSOptions(t.TempDir()))
	t.Cleanup(ns.Shutdown)
	logs := &testenv.LogBuffer{}
	w, err := New(context.Background(), Config{NATS: NATS{URL: ns.ClientURL()}, Logger: slog.New(slog.NewTextHandler(logs, nil)),
		Store: pingFails{}, NoSnowflake: true, MetricsAddr: "127.0.0.1:0", ShutdownTimeout: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { w.Close() })
	code, body := testenv.HTTPGet(t, "http://"+w.httpAddr+"/readyz")
	if code != http.StatusServiceUnavailable || !strings.Contains(body, "store") {
		t.Fatalf("/readyz with a failing store: %d %q, want 503 naming the store", code, body)
	}
	for _, secret := range []string{storeSecretHost, storeSecretUser} {
		if strings.Contains(body, secret) {
			t.Errorf("/readyz = %q: shows %q", body, secret)
		}
	}
	if out := logs.String(); !strings.Contains(out, storeSecretHost) {
		t.Errorf("the log does not say why the worker is not ready:\n%s", out)
	}
}

// TestUnparsableURLHidesThePassword: a NATS URL that does not parse (a
// password with a bare % or a space, as generated passwords hold) fails
// with an error that shows no part of the password: nats.go's parse error
// quotes the whole URL.
func TestUnparsableURLHidesThePassword(t *testing.T) {
	const secret = "s3cret"
	tests := []struct {
		name string
		nats NATS
	}{
		{"bare percent", NATS{URL: "nats://alice:" + secret + "%zz@127.0.0.1:1"}},
		{"space", NATS{URL: "nats://alice:" + secret + " pw@127.0.0.1:1"}},
		{"token", NATS{URL: "nats://" + secret + "%zz@127.0.0.1:1"}},
		{"second URL", NATS{URL: "nats://127.0.0.1:1,nats://alice:" + secret + "%zz@127.0.0.1:2"}},
		{"JetStream URL", NATS{URL: "nats://127.0.0.1:1", JSURL: "nats://alice:" + secret + "%zz@127.0.0.1:1"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := tt.nats.Connect("t", tt.nats.JSURL != "")
			if err == nil || strings.Contains(err.Error(), secret) || strings.Contains(err.Error(), "%zz") {
				t.Fatalf("err = %v, want an error without the password", err)
			}
		})
	}
}
