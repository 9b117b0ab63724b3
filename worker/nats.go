package worker

import (
	"cmp"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nkeys"

	"github.com/dispenser-dev/dispenser/internal/redact"
)

// NATS says how to reach NATS: the URL and the credentials and TLS files
// of the connection that answers requests and of the one that carries
// JetStream. No secret needs to be in a URL (where it would reach the
// process list): credentials come from files (Creds, NKey, PasswordFile,
// TokenFile) or from a nats CLI context (Context). `dispenser serve`, the
// admin commands and `dispenser bench` fill it from one set of flags.
type NATS struct {
	// URL is the NATS server URL(s), comma-separated. In Config, empty
	// (and no URL in Context) starts an embedded nats-server
	// (Config.Embedded).
	URL string
	// Context names a nats CLI context (ADR-21): the file
	// $XDG_CONFIG_HOME/nats/context/NAME.json (default
	// ~/.config/nats/context/NAME.json), or, if it ends in .json, the
	// file itself. Its settings apply where the fields here are empty
	// (ReadContext says which it reads and which it refuses); a field
	// given here wins, and credentials given here (any of Creds, NKey,
	// User, Password, PasswordFile, Token, TokenFile) replace the
	// context's credentials as a whole. Empty: none; the nats CLI's
	// selected context (context.txt, NATS_CONTEXT) is never read.
	Context string
	// Creds is a credentials file (user JWT and seed), NKey an NKey seed
	// file; empty: none.
	Creds, NKey string
	// User and Password, or Token, authenticate with a user and password
	// or a token. PasswordFile and TokenFile are files holding them (one
	// line; the flags take only files, so that no secret is in the
	// process list); Password and Token are the secrets themselves, for a
	// program using package worker, and are never logged.
	User, Password, PasswordFile string
	Token, TokenFile             string
	// InboxPrefix replaces nats.go's _INBOX as the prefix of both
	// connections' reply subjects (nats.CustomInboxPrefix; a context's
	// inbox_prefix); empty: _INBOX.
	InboxPrefix string
	// TLSCA is a CA certificate file to verify the server with; TLSCert and
	// TLSKey a client certificate and its key (both or neither).
	TLSCA, TLSCert, TLSKey string
	// JSURL, JSCreds and JSNKey are those of the second connection, which
	// carries JetStream (KV store, witness, leases) and answers no requests;
	// empty: URL and the credentials of the first. JSCreds or JSNKey
	// replace the first connection's credentials on the second as a whole.
	// A second user keeps JetStream rights away from the connection that
	// answers requests.
	JSURL, JSCreds, JSNKey string

	// own are options of a worker's connections to the embedded server
	// it started (EmbeddedServer.NATS): its credentials; nil otherwise.
	own []nats.Option
}

// hasCreds reports whether n names credentials of its own.
func (n NATS) hasCreds() bool {
	return n.Creds != "" || n.NKey != "" || n.User != "" || n.Password != "" || n.PasswordFile != "" ||
		n.Token != "" || n.TokenFile != ""
}

// Resolve returns n with the settings of its context (Context) filled in
// where n leaves them empty, and PasswordFile and TokenFile read into
// Password and Token. Resolving a resolved NATS gives the same.
func (n NATS) Resolve() (NATS, error) {
	if n.Context != "" {
		c, err := ReadContext(n.Context)
		if err != nil {
			return NATS{}, err
		}
		n.URL = cmp.Or(n.URL, c.URL)
		if !n.hasCreds() {
			n.User, n.Password, n.Token, n.Creds, n.NKey = c.User, c.Password, c.Token, c.Creds, c.NKey
		}
		n.TLSCA, n.TLSCert, n.TLSKey = cmp.Or(n.TLSCA, c.CA), cmp.Or(n.TLSCert, c.Cert), cmp.Or(n.TLSKey, c.Key)
		n.InboxPrefix = cmp.Or(n.InboxPrefix, c.InboxPrefix)
	}
	var err error
	if n.PasswordFile != "" {
		if n.Password, err = readSecret(n.PasswordFile, "--nats-password-file"); err != nil {
			return NATS{}, err
		}
	}
	if n.TokenFile != "" {
		if n.Token, err = readSecret(n.TokenFile, "--nats-token-file"); err != nil {
			return NATS{}, err
		}
	}
	if err := CheckInboxPrefix(n.InboxPrefix, ""); err != nil {
		return NATS{}, fmt.Errorf("%w: %s: %w", ErrConfig, n.inboxSource(), err)
	}
	switch {
	case n.Password != "" && n.User == "":
		return NATS{}, fmt.Errorf("%w: a NATS password needs a user (--nats-user)", ErrConfig)
	case n.User != "" && n.Password == "":
		return NATS{}, fmt.Errorf("%w: NATS user %q needs a password (--nats-password-file)", ErrConfig, n.User)
	case n.User != "" && n.Token != "":
		return NATS{}, fmt.Errorf("%w: give a NATS user and password or a token, not both", ErrConfig)
	}
	return n, nil
}

// inboxSource names where n.InboxPrefix came from, for errors.
func (n NATS) inboxSource() string {
	if n.Context != "" {
		return "inbox_prefix of --nats-context " + n.Context
	}
	return "NATS.InboxPrefix"
}

// readSecret reads a secret from the file path (flag names it in
// errors): its first line, without the line end.
func readSecret(path, flag string) (string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return "", fmt.Errorf("%w: %s: %w", ErrConfig, flag, err)
	}
	line, _, _ := strings.Cut(string(b), "\n")
	line = strings.TrimSuffix(line, "\r")
	if line == "" {
		return "", fmt.Errorf("%w: %s %s: the file is empty", ErrConfig, flag, path)
	}
	return line, nil
}

// Options returns the connection options of the connection that answers
// requests (jetStream false) or of the JetStream one (true): credentials,
// NKey and TLS, not the URL. It resolves n (Resolve) first.
func (n NATS) Options(jetStream bool) ([]nats.Option, error) {
	n, err := n.Resolve()
	if err != nil {
		return nil, err
	}
	if jetStream && (n.JSCreds != "" || n.JSNKey != "") {
		n.Creds, n.NKey, n.User, n.Password, n.Token = n.JSCreds, n.JSNKey, "", "", ""
	}
	var opts []nats.Option
	if n.Creds != "" {
		opts = append(opts, nats.UserCredentials(n.Creds))
	}
	if n.NKey != "" {
		opt, err := nats.NkeyOptionFromSeed(n.NKey)
		if err != nil {
			return nil, fmt.Errorf("NKey seed %s: %w", n.NKey, err)
		}
		opts = append(opts, opt)
	}
	if n.User != "" {
		opts = append(opts, nats.UserInfo(n.User, n.Password))
	}
	if n.Token != "" {
		opts = append(opts, nats.Token(n.Token))
	}
	if n.InboxPrefix != "" {
		opts = append(opts, nats.CustomInboxPrefix(n.InboxPrefix))
	}
	if n.TLSCA != "" {
		opts = append(opts, nats.RootCAs(n.TLSCA))
	}
	if (n.TLSCert == "") != (n.TLSKey == "") {
		return nil, fmt.Errorf("%w: --nats-tls-cert and --nats-tls-key go together", ErrConfig)
	}
	if n.TLSCert != "" {
		opts = append(opts, nats.ClientCert(n.TLSCert, n.TLSKey))
	}
	return opts, nil
}

// Connect connects to URL (jetStream false) or to JSURL, else URL (true),
// as name, with Options, extra options after them.
func (n NATS) Connect(name string, jetStream bool, extra ...nats.Option) (*nats.Conn, error) {
	n, err := n.Resolve()
	if err != nil {
		return nil, err
	}
	addr := n.URL
	if jetStream {
		addr = cmp.Or(n.JSURL, addr)
	}
	opts, err := n.Options(jetStream)
	if err != nil {
		return nil, err
	}
	nc, err := nats.Connect(addr, append(append(opts, nats.Name(name)), extra...)...)
	if perr := (*url.Error)(nil); errors.As(err, &perr) {
		// nats.go's parse error quotes the whole URL, password and all,
		// and the part it could not read is often the password's.
		return nil, fmt.Errorf("connecting to nats at %s: the URL does not parse: percent-encode the special characters (%%, @, :, /, space) of its user and password, and check its host and port", redact.URL(addr))
	}
	if err != nil {
		return nil, fmt.Errorf("connecting to nats at %s: %w", redact.URL(addr), err)
	}
	return nc, nil
}

// PingInterval is how often a worker pings its NATS server on each of its
// connections, and MaxPingsOut how many pings may go unanswered: a
// connection whose server stopped answering (a black-holed link, a frozen
// server) counts as lost, and the worker reconnects elsewhere, within
// PingInterval*(MaxPingsOut+1), 6 s, not nats.go's default of minutes.
// The server's own ping_interval decides when it drops the subscriptions
// of a worker it no longer reaches (docs/operations.md).
const (
	PingInterval = 2 * time.Second
	MaxPingsOut  = 2
)

// connect connects a worker's connection: it pings every PingInterval,
// reconnects for ever and logs disconnections, reconnections and
// asynchronous errors.
func (n NATS) connect(name string, jetStream bool, log *slog.Logger, extra ...nats.Option) (*nats.Conn, error) {
	log = log.With("conn", name)
	extra = append(n.own[:len(n.own):len(n.own)], extra...)
	return n.Connect(name, jetStream, append([]nats.Option{
		nats.PingInterval(PingInterval),
		nats.MaxPingsOutstanding(MaxPingsOut),
		nats.MaxReconnects(-1),
		nats.ReconnectWait(250 * time.Millisecond),
		nats.ReconnectJitter(250*time.Millisecond, time.Second),
		nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
			if err != nil { // nil: we closed the connection ourselves
				log.Warn("nats disconnected", "err", err)
			}
		}),
		nats.ReconnectHandler(func(nc *nats.Conn) {
			log.Info("nats reconnected", "url", redact.URL(nc.ConnectedUrl()))
		}),
		nats.ErrorHandler(func(_ *nats.Conn, sub *nats.Subscription, err error) {
			subject := ""
			if sub != nil {
				subject = sub.Subject
			}
			log.Error("nats error", "subject", subject, "err", err)
		}),
	}, extra...)...)
}

// moveURLs lists the servers a worker leaving a server in lame-duck mode
// may connect to: the configured URLs, then those the cluster advertised
// (discovered). nats.go reports discovered servers without user
// information; like nats.go on a reconnect, they get the first configured
// URL's, so that a user and password given in the URL reach them too.
func moveURLs(configured string, discovered []string) string {
	urls := []string{}
	if configured != "" {
		urls = append(urls, configured)
	}
	var user *url.Userinfo
	if first, _, _ := strings.Cut(configured, ","); first != "" {
		if u, err := url.Parse(strings.TrimSpace(first)); err == nil {
			user = u.User
		}
	}
	for _, d := range discovered {
		if u, err := url.Parse(d); err == nil && u.User == nil && user != nil {
			u.User = user
			d = u.String()
		}
		urls = append(urls, d)
	}
	return strings.Join(urls, ",")
}

// Embedded configures the nats-server a worker starts in its own process
// when Config.NATS.URL is empty (zero-setup mode).
type Embedded struct {
	// Listen is the address it listens on. Default "127.0.0.1:4222".
	Listen string
	// DataDir is its data directory; JetStream stores under DataDir/jetstream.
	// Default "./dispenser-data". One process at a time holds it
	// (LockFile; ErrDataDirInUse).
	DataDir string
}

// EmbeddedOptions returns the options of an embedded nats-server with
// JetStream storing under storeDir. With syncAlways, JetStream writes every
// message to disk (fsync) before it acknowledges it: the KV buckets hold
// the only record of a tag's max_id and of a worker ID's timestamp bound,
// and JetStream's default (sync every two minutes) lets an OS crash or
// power loss roll acknowledged writes back, after which a restarted worker
// would hand out IDs again. The options have no authorization (package
// dispensertest, the bench); StartEmbedded adds it.
func EmbeddedOptions(name, host string, port int, storeDir string, syncAlways bool) *server.Options {
	return &server.Options{
		ServerName: name,
		Host:       host,
		Port:       port,
		JetStream:  true,
		StoreDir:   storeDir,
		SyncAlways: syncAlways,
		NoSigs:     true,
		NoLog:      true,
	}
}

// KeyFile is the file in the data directory that holds the NKey seed of
// the embedded nats-server's worker user (0600, a new key every start),
// for admin commands run beside the worker: `dispenser tags list
// --nats-url nats://127.0.0.1:4222 --nats-nkey ./dispenser-data/dispenser.nk`.
const KeyFile = "dispenser.nk"

// RequesterUser is the user of the embedded nats-server that a client
// without credentials is (no_auth_user).
const RequesterUser = "requester"

// EmbeddedServer is a running embedded nats-server (StartEmbedded) and the
// data directory it holds. Close stops it and releases the directory.
type EmbeddedServer struct {
	*server.Server
	lock    *dirLock
	keyFile string
	// own are the options of the worker's connections: the worker user's
	// NKey and a private inbox prefix.
	own []nats.Option
}

// Who may do what on the embedded nats-server.
//
// Safety argument: a server reachable by others (the image listens on
// 0.0.0.0, and loopback is reachable by every process of the host) must
// not let a peer answer ID requests (it would hand out forged IDs, which
// clients would then hold twice) nor use JetStream (it could delete or
// rewind the buckets, after which IDs repeat). Requesters still need no
// set-up. So the server has two users, and always, on loopback too:
//
//   - the worker user, an NKey made at every start and never sent (the
//     server checks a signature of its nonce): all rights. The worker's
//     own connections log in with it (EmbeddedServer.NATS) and use a
//     random private inbox prefix, which no requester can subscribe to, so
//     that no requester reads or answers the worker's JetStream replies.
//     Its seed is also written to DataDir/KeyFile (0600) for admin
//     commands: whoever can read the data directory can read or change
//     the JetStream store directly anyway, so the file gives no one more.
//   - RequesterUser, the no_auth_user: a client without credentials is
//     it. It may publish only requests to the service's endpoints and
//     subscribe only to _INBOX.>: it cannot subscribe to the service's
//     subjects (no queue group, no forged answers), to $SRV (no forged
//     discovery), nor publish to $JS, $KV, $SRV (micro's $SRV handlers
//     answer any reply subject, with the worker's rights), to the owners'
//     forwarding subjects (owners trust them), or to anyone's inbox (no
//     forged replies). Its password is random and never used.
//
// Reply subjects a requester chooses are checked by the service
// (docs/operations.md, the reply-subject rule).
func embeddedAuth(o *server.Options, prefix, workerKey string) error {
	pw := make([]byte, 24)
	if _, err := rand.Read(pw); err != nil {
		return err
	}
	o.Nkeys = []*server.NkeyUser{{Nkey: workerKey}}
	o.Users = []*server.User{{
		Username: RequesterUser,
		Password: hex.EncodeToString(pw),
		Permissions: &server.Permissions{
			Publish: &server.SubjectPermission{Allow: []string{
				prefix + ".segment.*", prefix + ".snowflake", prefix + ".snowflake.decode", prefix + ".direct.*.*",
			}},
			Subscribe: &server.SubjectPermission{Allow: []string{"_INBOX.>"}},
		},
	}}
	o.NoAuthUser = RequesterUser
	return nil
}

// StartEmbedded starts a nats-server with JetStream listening on
// e.Listen and storing under e.DataDir, syncing every write, for the
// service under prefix (embeddedAuth). It takes the data directory's
// lock first (ErrDataDirInUse) and makes sure the address is free.
func StartEmbedded(e Embedded, prefix string) (*EmbeddedServer, error) {
	listen, dataDir := cmp.Or(e.Listen, DefaultListen), cmp.Or(e.DataDir, DefaultDataDir)
	prefix = cmp.Or(prefix, DefaultPrefix)
	host, portStr, err := net.SplitHostPort(listen)
	if err != nil {
		return nil, fmt.Errorf("%w: --nats-listen %q: %w", ErrConfig, listen, err)
	}
	port, err := strconv.Atoi(portStr)
	if err != nil {
		return nil, fmt.Errorf("%w: --nats-listen %q: bad port: %w", ErrConfig, listen, err)
	}
	// Lock order: the data directory before anything else, so that a
	// second worker on it says so (not that the port is taken) and
	// nothing opens the store before the lock is held.
	lock, err := lockDataDir(dataDir)
	if err != nil {
		return nil, err
	}
	es := &EmbeddedServer{lock: lock}
	fail := func(err error) (*EmbeddedServer, error) {
		es.Close()
		return nil, err
	}
	if port > 0 {
		// nats-server, logging nothing here, would only not become ready:
		// find out now, and say why.
		ln, err := net.Listen("tcp", listen)
		if err != nil {
			return fail(listenError(listen, err))
		}
		ln.Close()
	}
	kp, err := nkeys.CreateUser()
	if err != nil {
		return fail(fmt.Errorf("embedded nats-server: worker key: %w", err))
	}
	pub, _ := kp.PublicKey()
	seed, _ := kp.Seed()
	if es.keyFile, err = writeKeyFile(dataDir, seed); err != nil {
		return fail(err)
	}
	opts := EmbeddedOptions("dispenser", host, port, filepath.Join(dataDir, "jetstream"), true)
	if err := embeddedAuth(opts, prefix, pub); err != nil {
		return fail(fmt.Errorf("embedded nats-server: %w", err))
	}
	inbox := make([]byte, 8)
	rand.Read(inbox)
	es.own = []nats.Option{
		nats.Nkey(pub, kp.Sign),
		nats.CustomInboxPrefix("_INBOX_dispenser_" + hex.EncodeToString(inbox)),
	}
	if es.Server, err = server.NewServer(opts); err != nil {
		return fail(fmt.Errorf("embedded nats-server: %w", err))
	}
	es.Start()
	if !es.ReadyForConnections(10 * time.Second) {
		return fail(fmt.Errorf("embedded nats-server did not start listening on %s within 10s (is the address taken by another process? --nats-listen picks another)", listen))
	}
	return es, nil
}

// listenError explains why the embedded server cannot listen on listen.
func listenError(listen string, err error) error {
	if errors.Is(err, syscall.EADDRINUSE) {
		return fmt.Errorf("--nats-listen %s: address already in use: another process listens there (another dispenser worker or a nats-server?); give this worker another address with --nats-listen HOST:PORT, or, to use that NATS server, --nats-url nats://%s: %w", listen, listen, err)
	}
	return fmt.Errorf("--nats-listen %s: cannot listen there: %w", listen, err)
}

// writeKeyFile writes seed to dir/KeyFile, readable by the owner only,
// replacing an older one at once (rename), and returns its path.
func writeKeyFile(dir string, seed []byte) (string, error) {
	path := filepath.Join(dir, KeyFile)
	f, err := os.CreateTemp(dir, KeyFile+".*") // 0600
	if err != nil {
		return "", fmt.Errorf("--data-dir %s: key file: %w", dir, err)
	}
	_, err = f.Write(append(seed, '\n'))
	err = errors.Join(err, f.Close())
	if err == nil {
		err = os.Rename(f.Name(), path)
	}
	if err != nil {
		os.Remove(f.Name())
		return "", fmt.Errorf("--data-dir %s: key file: %w", dir, err)
	}
	return path, nil
}

// NATS returns how the worker's own connections reach the server: its
// URL, the worker user's NKey and a private inbox prefix.
func (e *EmbeddedServer) NATS() NATS {
	return NATS{URL: e.ClientURL(), own: e.own}
}

// KeyFile returns the path of the worker user's NKey seed file (KeyFile).
func (e *EmbeddedServer) KeyFile() string { return e.keyFile }

// Close shuts the server down, waits until it has closed its JetStream
// files, removes the key file (its key dies with the server) and only then
// releases the data directory. Calls after the first do nothing.
func (e *EmbeddedServer) Close() {
	if e.Server != nil {
		e.Shutdown()
		e.WaitForShutdown()
	}
	if e.keyFile != "" {
		os.Remove(e.keyFile)
		e.keyFile = ""
	}
	e.lock.unlock()
}
