package main

import (
	"cmp"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nats.go/micro"
	"github.com/nats-io/nkeys"

	"github.com/dispenser-dev/dispenser/protocol"
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

// waitForID requests subject until the service answers with IDs. Each
// request waits for its reply until the deadline, never less: a request
// given up on can still be served, and the IDs of its lost reply (the tag's
// first, which callers check) would be missing.
func waitForID(t *testing.T, nc *nats.Conn, subject string, logs *syncBuffer) string {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		resp, err := nc.Request(subject, nil, time.Until(deadline))
		if err == nil && resp.Header.Get(micro.ErrorCodeHeader) == "" {
			return string(resp.Data)
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: no IDs (last error %v); logs:\n%s", subject, err, logs.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// readmePermissions returns the nats-server configuration block that the
// documentation (docs/operations.md) gives as the least-privilege permission
// set, so that the test runs exactly what the document says.
func readmePermissions(tb testing.TB) string {
	tb.Helper()
	readme := readDocs(tb)
	_, rest, ok := strings.Cut(string(readme), "A least-privilege permission set")
	if !ok {
		tb.Fatal(`README and docs/: no "A least-privilege permission set"`)
	}
	_, rest, ok = strings.Cut(rest, "```\n")
	block, _, ok2 := strings.Cut(rest, "```")
	if !ok || !ok2 || !strings.Contains(block, "authorization") {
		tb.Fatalf("README: no configuration block after the least-privilege heading:\n%s", rest[:min(len(rest), 500)])
	}
	return block
}

// docPasswords sets the password variables of the documented
// configuration blocks; each user's password is "<user>-secret".
const docPasswords = `WORKER_PASSWORD: "dispenser-secret"
WORKER_JS_PASSWORD: "dispenser-js-secret"
ORDERS_PASSWORD: "orders-app-secret"
PAYMENTS_PASSWORD: "payments-app-secret"
OPS_PASSWORD: "ops-secret"
`

// serverOptions parses a documented configuration block, with its
// password variables set, into server options.
func serverOptions(tb testing.TB, block string) *server.Options {
	tb.Helper()
	conf := filepath.Join(tb.TempDir(), "auth.conf")
	var text string
	for line := range strings.Lines(docPasswords) { // only those it uses: nats-server refuses others
		if name, _, _ := strings.Cut(line, ":"); strings.Contains(block, "$"+name) {
			text += line
		}
	}
	text += block
	if err := os.WriteFile(conf, []byte(text), 0o600); err != nil {
		tb.Fatal(err)
	}
	o, err := server.ProcessConfigFile(conf)
	if err != nil {
		tb.Fatalf("the documented configuration block: %v\n%s", err, text)
	}
	return o
}

// inboxPrefix returns the inbox prefix user u may subscribe to: its
// subscribe permission's "<prefix>.>" entry; "" for the default _INBOX.
func inboxPrefix(tb testing.TB, u *server.User) string {
	tb.Helper()
	if u.Permissions == nil || u.Permissions.Subscribe == nil {
		return ""
	}
	for _, s := range u.Permissions.Subscribe.Allow {
		if p, ok := strings.CutSuffix(s, ".>"); ok && strings.HasPrefix(p, "_INBOX") {
			if p == "_INBOX" {
				return ""
			}
			return p
		}
	}
	return ""
}

// docUser returns the user named name of users.
func docUser(tb testing.TB, users []*server.User, name string) *server.User {
	tb.Helper()
	for _, u := range users {
		if u.Username == name {
			return u
		}
	}
	tb.Fatalf("the documented block has no user %s", name)
	return nil
}

// leastPrivilegeUsers parses the README's permission block, with the
// passwords it leaves to variables set, into server users.
func leastPrivilegeUsers(tb testing.TB) []*server.User {
	tb.Helper()
	o := serverOptions(tb, readmePermissions(tb))
	names := map[string]bool{}
	for _, u := range o.Users {
		names[u.Username] = u.Permissions != nil
	}
	if len(o.Users) != 5 || !names["dispenser"] || !names["dispenser-js"] || !names["orders-app"] || !names["payments-app"] || !names["ops"] {
		tb.Fatalf("the README's permission block has users %v, want dispenser, dispenser-js, orders-app, payments-app and ops, all with permissions", names)
	}
	for _, u := range o.Users {
		if u.Username == "dispenser" && u.Permissions.Response != nil {
			tb.Fatal("the README's permission block gives the user that answers requests allow_responses: it lets a reply go anywhere")
		}
	}
	return o.Users
}

// mustRun runs a dispenser command and fails the test if it fails.
func mustRun(t *testing.T, args ...string) string {
	t.Helper()
	out, err := runCmd(t, args...)
	if err != nil {
		t.Fatalf("dispenser %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return out
}

// TestLeastPrivilegePermissions runs a worker and a requester with the
// README's permission set, on each segment store: the requester gets its
// tag's IDs and snowflake IDs, another tag is refused by the server with a
// permissions violation, and the worker listens on nothing a requester
// could use to administer tags.
func TestLeastPrivilegePermissions(t *testing.T) {
	t.Parallel() // one of the package's slow tests: they run beside each other
	for _, store := range []string{"postgres", "kv"} {
		t.Run(store, func(t *testing.T) { testLeastPrivilege(t, store) })
	}
}

func testLeastPrivilege(t *testing.T, store string) {
	opts := testenv.NATSOptions(t.TempDir())
	// The documented users include an operator's tool (ops) allowed to
	// ask micro's discovery subjects, which the reply-subject rule cannot
	// cover: only the two users keep its replies out of JetStream.
	opts.Users = leastPrivilegeUsers(t)
	ns := testenv.StartNATS(t, opts)
	t.Cleanup(ns.Shutdown)
	base := "nats://" + ns.Addr().String()
	workerURL := "nats://dispenser:dispenser-secret@" + ns.Addr().String()
	jsURL := "nats://dispenser-js:dispenser-js-secret@" + ns.Addr().String()
	// Each user with the inbox prefix the block lets it subscribe to.
	inbox := func(user string) string { return inboxPrefix(t, docUser(t, opts.Users, user)) }
	inboxOpt := func(user string) nats.Option {
		if p := inbox(user); p != "" {
			return nats.CustomInboxPrefix(p)
		}
		return func(*nats.Options) error { return nil }
	}

	// The tags are made with the admin commands, against the store.
	storeFlags := []string{"--nats-url", jsURL, "--nats-inbox-prefix", inbox("dispenser-js")}
	if store == "postgres" {
		url := testenv.Postgres(t)
		mustRun(t, "migrate", "--postgres-url", url)
		storeFlags = []string{"--postgres-url", url}
	}
	// orders is ordered, so that an owner's subscriptions are checked too.
	mustRun(t, append([]string{"tags", "create", "orders", "--step", "100", "--ordered"}, storeFlags...)...)
	mustRun(t, append([]string{"tags", "create", "payments", "--step", "100"}, storeFlags...)...)
	tagsBefore := tagSteps(mustRun(t, append([]string{"tags", "list"}, storeFlags...)...))
	if tagsBefore != "orders:100 payments:100" {
		t.Fatalf("tags list: %q, want orders and payments with step 100", tagsBefore)
	}

	serveFlags := []string{"--nats-url", workerURL, "--nats-js-url", jsURL,
		"--nats-inbox-prefix", inbox("dispenser"), "--nats-js-inbox-prefix", inbox("dispenser-js")}
	if store == "postgres" {
		serveFlags = append(serveFlags, storeFlags...)
	}
	logs := startServe(t, serveFlags...)
	violations := make(chan error, 16)
	app, err := nats.Connect(base, nats.UserInfo("orders-app", "orders-app-secret"), inboxOpt("orders-app"),
		nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) {
			select {
			case violations <- err:
			default:
			}
		}))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(app.Close)
	if got := waitForID(t, app, "id.segment.orders", logs); got != "1" {
		t.Fatalf("orders: got %q, want 1", got)
	}
	if got := waitForID(t, app, "id.snowflake", logs); got == "" {
		t.Fatal("snowflake: empty reply")
	}
	// The owner of orders names its direct subject in its replies; the
	// block lets the app use it for orders, and only for orders.
	resp, err := app.RequestMsg(&nats.Msg{Subject: "id.segment.orders", Header: nats.Header{protocol.DirectHeader: {"1"}}}, 10*time.Second)
	if err != nil || string(resp.Data) != "2" {
		t.Fatalf("orders: %v, %v; want 2", resp, err)
	}
	direct := resp.Header.Get(protocol.DirectHeader)
	if err := protocol.CheckDirect(direct, "id", "orders"); err != nil {
		t.Fatalf("the owner's reply: %v", err)
	}
	if resp, err := app.Request(direct, nil, 10*time.Second); err != nil || string(resp.Data) != "3" || resp.Header.Get(micro.ErrorCodeHeader) != "" {
		t.Fatalf("orders on its direct subject %s: %v, %v; want 3", direct, resp, err)
	}
	owner := direct[strings.LastIndexByte(direct, '.')+1:]
	for _, subject := range []string{"id.segment.payments", protocol.DirectSubject("id", "payments", owner)} {
		// payments is not in the app's publish permissions: the server
		// refuses the request, which never reaches a worker.
		if resp, err := app.Request(subject, nil, 2*time.Second); err == nil {
			t.Fatalf("orders-app got a reply on %s: %q (code %q)", subject, resp.Data, resp.Header.Get(micro.ErrorCodeHeader))
		}
		select {
		case err := <-violations:
			if !errors.Is(err, nats.ErrPermissionViolation) || !strings.Contains(err.Error(), `"`+subject+`"`) {
				t.Errorf("refused request: %v, want a permissions violation for %s", err, subject)
			}
		case <-time.After(10 * time.Second):
			t.Errorf("refused request on %s: no permissions violation reported", subject)
		}
	}

	if _, err := nats.Connect(base, nats.UserInfo("orders-app", "wrong"), inboxOpt("orders-app")); !errors.Is(err, nats.ErrAuthorization) {
		t.Errorf("connect with a wrong password: %v, want an authorization error", err)
	}

	// Requesters cannot reach tag administration: the worker listens only
	// on the ID endpoints, its subject for forwarded ID requests of ordered
	// tags, micro's read-only $SRV subjects and its inboxes.
	checkWorkerSubscriptions(t, ns, inbox("dispenser"), inbox("dispenser-js"))

	// micro's discovery handlers answer any reply subject; asked by a
	// user who may, with JetStream API subjects as replies, they change
	// nothing: the connection they answer on has no JetStream rights.
	jsnc, err := nats.Connect(jsURL, inboxOpt("dispenser-js"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(jsnc.Close)
	js, err := jetstream.New(jsnc)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	before := bucketState(t, ctx, js)
	workers, err := js.KeyValue(ctx, "dispenser_workers")
	if err != nil {
		t.Fatal(err)
	}
	epoch, err := workers.Get(ctx, "config") // never changes
	if err != nil {
		t.Fatal(err)
	}
	mon, err := nats.Connect(base, nats.UserInfo("ops", "ops-secret"), inboxOpt("ops"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(mon.Close)
	for _, verb := range []string{"PING", "INFO", "STATS"} {
		replies := []string{"$KV.dispenser_workers.config", "$KV.dispenser_owners.orders"}
		for bucket := range before {
			replies = append(replies, "$JS.API.STREAM.PURGE.KV_"+bucket, "$JS.API.STREAM.DELETE.KV_"+bucket)
		}
		for _, reply := range replies {
			if err := mon.PublishRequest("$SRV."+verb, reply, nil); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := mon.Flush(); err != nil {
		t.Fatal(err)
	}
	// The discovery answers are what the attack would use; once one has
	// come back to an inbox, the hostile ones were answered or refused.
	if _, err := mon.Request("$SRV.PING.dispenser", nil, 5*time.Second); err != nil {
		t.Fatalf("$SRV.PING: %v", err)
	}
	if e, err := workers.Get(ctx, "config"); err != nil || e.Revision() != epoch.Revision() {
		t.Errorf("the lease bucket's epoch changed by discovery requests with a KV reply (%v): now %.80q", err, e.Value())
	}
	after := bucketState(t, ctx, js)
	for bucket, b := range before {
		if a, ok := after[bucket]; !ok || !a.created.Equal(b.created) || len(a.keys) < len(b.keys) {
			t.Errorf("bucket %s changed by discovery requests with JetStream replies: before %v, after %v (%v)", bucket, b, a, ok)
		}
	}
	if got := waitForID(t, app, "id.segment.orders", logs); got != "4" {
		t.Errorf("orders after the discovery requests: got %q, want 4", got)
	}

	if after := tagSteps(mustRun(t, append([]string{"tags", "list"}, storeFlags...)...)); after != tagsBefore {
		t.Errorf("tags or steps changed by requests: before %s, after %s", tagsBefore, after)
	}
}

// tagSteps returns the tags and steps of a `tags list` output (the next ID
// and the time change with every fetch).
func tagSteps(list string) string {
	var out []string
	for _, line := range strings.Split(strings.TrimSpace(list), "\n")[1:] {
		if f := strings.Fields(line); len(f) >= 3 {
			out = append(out, f[0]+":"+f[2])
		}
	}
	return strings.Join(out, " ")
}

// checkWorkerSubscriptions fails the test if a connection of user dispenser
// subscribes to anything but the ID endpoints, its subject for forwarded
// requests, its direct subject (id.direct.*.<its own ID>), $SRV.PING, INFO
// and STATS, and its inboxes (under inbox, "" for _INBOX; jsInbox for the
// JetStream connection).
func checkWorkerSubscriptions(t *testing.T, ns *server.Server, inbox, jsInbox string) {
	t.Helper()
	inbox, jsInbox = cmp.Or(inbox, "_INBOX"), cmp.Or(jsInbox, "_INBOX")
	jz, err := ns.Connz(&server.ConnzOptions{Username: true, User: "dispenser-js", Subscriptions: true})
	if err != nil {
		t.Fatal(err)
	}
	named := 0
	for _, c := range jz.Conns {
		if c.Name == "" {
			continue // an admin command's or the test's own connection
		}
		named++
		for _, sub := range c.Subs {
			if !strings.HasPrefix(sub, jsInbox+".") {
				t.Errorf("JetStream connection %q subscribes to %q: it must answer no requests", c.Name, sub)
			}
		}
	}
	if named == 0 {
		t.Error("no worker connection of user dispenser-js")
	}
	cz, err := ns.Connz(&server.ConnzOptions{Username: true, User: "dispenser", Subscriptions: true})
	if err != nil {
		t.Fatal(err)
	}
	endpoints := map[string]bool{}
	for _, c := range cz.Conns {
		for _, sub := range c.Subs {
			tokens := strings.Split(sub, ".")
			switch {
			case sub == "id.segment.>" || sub == "id.snowflake" || sub == "id.snowflake.decode":
				endpoints[sub] = true
			case tokens[0] == "$SRV" && len(tokens) >= 2 && (tokens[1] == "PING" || tokens[1] == "INFO" || tokens[1] == "STATS"):
			case len(tokens) == 4 && tokens[0] == "id" && tokens[1] == "owner" && tokens[3] == "*":
				// ID requests for ordered tags forwarded by other workers
			case len(tokens) == 4 && tokens[0] == "id" && tokens[1] == "direct" && tokens[2] == "*" && protocol.ValidTag(tokens[3]):
				// its direct subject: requests for the ordered tags it owns
			case tokens[0] == inbox:
			default:
				t.Errorf("worker connection %q subscribes to %q", c.Name, sub)
			}
		}
	}
	if len(endpoints) != 3 {
		t.Errorf("worker endpoints %v, want id.segment.>, id.snowflake and id.snowflake.decode", endpoints)
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
