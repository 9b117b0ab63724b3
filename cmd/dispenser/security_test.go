package main

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"
	"github.com/nats-io/nkeys"

	"github.com/dispenser-dev/dispenser/testenv"
)

// startServe runs `dispenser serve` with args until the test ends.
func startServe(t *testing.T, args ...string) *syncBuffer {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	logs := &syncBuffer{}
	go func() { done <- run(ctx, args, logs, logs) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("serve: %v; logs:\n%s", err, logs.String())
		}
	})
	return logs
}

// waitForID requests subject until the service answers with IDs.
func waitForID(t *testing.T, nc *nats.Conn, subject string, logs *syncBuffer) string {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		resp, err := nc.Request(subject, nil, time.Second)
		if err == nil && resp.Header.Get(micro.ErrorCodeHeader) == "" {
			return string(resp.Data)
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: no IDs (last error %v); logs:\n%s", subject, err, logs.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// The README's least-privilege permissions, as server options.
func leastPrivilegeUsers() []*server.User {
	return []*server.User{
		{
			Username: "dispenser", Password: "worker-secret",
			Permissions: &server.Permissions{
				Publish:   &server.SubjectPermission{Allow: []string{"$JS.API.>", "$KV.dispenser_workers.>", "$KV.dispenser_segments.>", "$SRV.>", "_INBOX.>"}},
				Subscribe: &server.SubjectPermission{Allow: []string{"id.>", "$SRV.>", "_INBOX.>"}},
				Response:  &server.ResponsePermission{MaxMsgs: 1},
			},
		},
		{
			Username: "orders-app", Password: "app-secret",
			Permissions: &server.Permissions{
				Publish:   &server.SubjectPermission{Allow: []string{"id.segment.orders", "id.snowflake"}},
				Subscribe: &server.SubjectPermission{Allow: []string{"_INBOX.>"}},
			},
		},
	}
}

func TestLeastPrivilegePermissions(t *testing.T) {
	url := testenv.Postgres(t)
	runCmd(t, "migrate", "--postgres-url", url)
	runCmd(t, "tags", "create", "orders", "--step", "100", "--postgres-url", url)
	runCmd(t, "tags", "create", "payments", "--step", "100", "--postgres-url", url)
	opts := testenv.NATSOptions(t.TempDir())
	opts.Users = leastPrivilegeUsers()
	ns := testenv.StartNATS(t, opts)
	t.Cleanup(ns.Shutdown)
	base := "nats://" + ns.Addr().String()

	logs := startServe(t, "--nats-url", "nats://dispenser:worker-secret@"+ns.Addr().String(), "--postgres-url", url)
	app, err := nats.Connect(base, nats.UserInfo("orders-app", "app-secret"),
		nats.ErrorHandler(func(*nats.Conn, *nats.Subscription, error) {})) // the refused publish is expected
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(app.Close)
	if got := waitForID(t, app, "id.segment.orders", logs); got != "1" {
		t.Fatalf("orders: got %q, want 1", got)
	}
	// payments is not in the app's publish permissions: the request never
	// reaches a worker.
	if _, err := app.Request("id.segment.payments", nil, 300*time.Millisecond); err == nil {
		t.Fatal("orders-app got a reply for payments")
	}
	if _, err := nats.Connect(base, nats.UserInfo("orders-app", "wrong")); err == nil {
		t.Fatal("connected with a wrong password")
	}
}

// pki writes a CA, a server certificate for 127.0.0.1 and a client
// certificate into dir and returns their paths.
type pki struct{ ca, serverCert, serverKey, clientCert, clientKey string }

func newPKI(t *testing.T) pki {
	t.Helper()
	dir := t.TempDir()
	caKey, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	caTmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "dispenser test CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	caCert, _ := x509.ParseCertificate(caDER)
	write := func(name, typ string, der []byte) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	issue := func(name string, serial int64, usage x509.ExtKeyUsage) (string, string) {
		key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		tmpl := &x509.Certificate{
			SerialNumber: big.NewInt(serial), Subject: pkix.Name{CommonName: name},
			NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
			KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{usage},
			IPAddresses: []net.IP{net.ParseIP("127.0.0.1")},
		}
		der, err := x509.CreateCertificate(rand.Reader, tmpl, caCert, &key.PublicKey, caKey)
		if err != nil {
			t.Fatal(err)
		}
		keyDER, _ := x509.MarshalECPrivateKey(key)
		return write(name+".pem", "CERTIFICATE", der), write(name+"-key.pem", "EC PRIVATE KEY", keyDER)
	}
	p := pki{ca: write("ca.pem", "CERTIFICATE", caDER)}
	p.serverCert, p.serverKey = issue("server", 2, x509.ExtKeyUsageServerAuth)
	p.clientCert, p.clientKey = issue("client", 3, x509.ExtKeyUsageClientAuth)
	return p
}

// operator sets up decentralized JWT auth: one operator, one account with
// JetStream, and returns the server's trust settings and a creds-file maker.
func operator(t *testing.T, opts *server.Options) (creds func(name string) string) {
	t.Helper()
	okp, _ := nkeys.CreateOperator()
	opub, _ := okp.PublicKey()
	skp, _ := nkeys.CreateAccount() // the system account JetStream needs
	spub, _ := skp.PublicKey()
	oc := jwt.NewOperatorClaims(opub)
	oc.Name = "test-operator"
	oc.SystemAccount = spub
	ojwt, err := oc.Encode(okp)
	if err != nil {
		t.Fatal(err)
	}
	oc, _ = jwt.DecodeOperatorClaims(ojwt)
	sc := jwt.NewAccountClaims(spub)
	sc.Name = "SYS"
	sjwt, err := sc.Encode(okp)
	if err != nil {
		t.Fatal(err)
	}
	akp, _ := nkeys.CreateAccount()
	apub, _ := akp.PublicKey()
	ac := jwt.NewAccountClaims(apub)
	ac.Name = "IDS"
	ac.Limits.JetStreamLimits = jwt.JetStreamLimits{MemoryStorage: -1, DiskStorage: -1, Streams: -1, Consumer: -1}
	ajwt, err := ac.Encode(okp)
	if err != nil {
		t.Fatal(err)
	}
	resolver := &server.MemAccResolver{}
	resolver.Store(apub, ajwt)
	resolver.Store(spub, sjwt)
	opts.SystemAccount = spub
	opts.TrustedOperators = []*jwt.OperatorClaims{oc}
	opts.AccountResolver = resolver
	dir := t.TempDir()
	return func(name string) string {
		ukp, _ := nkeys.CreateUser()
		upub, _ := ukp.PublicKey()
		uc := jwt.NewUserClaims(upub)
		uc.Name = name
		ujwt, err := uc.Encode(akp)
		if err != nil {
			t.Fatal(err)
		}
		seed, _ := ukp.Seed()
		data, err := jwt.FormatUserConfig(ujwt, seed)
		if err != nil {
			t.Fatal(err)
		}
		p := filepath.Join(dir, name+".creds")
		if err := os.WriteFile(p, data, 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
}

func TestConnectWithCredsAndTLS(t *testing.T) {
	url := testenv.Postgres(t)
	runCmd(t, "migrate", "--postgres-url", url)
	runCmd(t, "tags", "create", "orders", "--step", "100", "--postgres-url", url)
	p := newPKI(t)
	opts := testenv.NATSOptions(t.TempDir())
	creds := operator(t, opts)
	tc, err := server.GenTLSConfig(&server.TLSConfigOpts{CertFile: p.serverCert, KeyFile: p.serverKey, CaFile: p.ca, Verify: true})
	if err != nil {
		t.Fatal(err)
	}
	opts.TLSConfig, opts.TLS, opts.TLSVerify = tc, true, true
	ns := testenv.StartNATS(t, opts)
	t.Cleanup(ns.Shutdown)
	addr := "tls://" + ns.Addr().String()

	logs := startServe(t, "--nats-url", addr, "--postgres-url", url,
		"--nats-creds", creds("dispenser"),
		"--nats-tls-ca", p.ca, "--nats-tls-cert", p.clientCert, "--nats-tls-key", p.clientKey)
	app, err := nats.Connect(addr, nats.UserCredentials(creds("app")),
		nats.RootCAs(p.ca), nats.ClientCert(p.clientCert, p.clientKey))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(app.Close)
	if got := waitForID(t, app, "id.segment.orders", logs); got != "1" {
		t.Fatalf("over TLS with creds: got %q, want 1", got)
	}
	// Without a client certificate the server refuses the connection.
	if nc, err := nats.Connect(addr, nats.UserCredentials(creds("nocert")), nats.RootCAs(p.ca)); err == nil {
		nc.Close()
		t.Fatal("connected without a client certificate")
	}
}
