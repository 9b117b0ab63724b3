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
)

// NATS says how to reach NATS: the URL and the credentials and TLS files
// of the connection that answers requests and of the one that carries
// JetStream. User, password and token go in the URLs. `dispenser serve`,
// the admin commands and `dispenser bench` fill it from one set of flags.
type NATS struct {
	// URL is the NATS server URL(s), comma-separated. In Config, empty
	// starts an embedded nats-server (Config.Embedded).
	URL string
	// Creds is a credentials file (user JWT and seed), NKey an NKey seed
	// file; empty: none.
	Creds, NKey string
	// TLSCA is a CA certificate file to verify the server with; TLSCert and
	// TLSKey a client certificate and its key (both or neither).
	TLSCA, TLSCert, TLSKey string
	// JSURL, JSCreds and JSNKey are those of the second connection, which
	// carries JetStream (KV store, witness, leases) and answers no requests;
	// empty: URL, Creds and NKey. A second user in JSURL keeps JetStream
	// rights away from the connection that answers requests.
	JSURL, JSCreds, JSNKey string

	// own are options of a worker's connections to the embedded server
	// it started (EmbeddedServer.NATS): its credentials; nil otherwise.
	own []nats.Option
}

// Options returns the connection options of the connection that answers
// requests (jetStream false) or of the JetStream one (true): credentials,
// NKey and TLS, not the URL.
func (n NATS) Options(jetStream bool) ([]nats.Option, error) {
	creds, nkey := n.Creds, n.NKey
	if jetStream {
		creds, nkey = cmp.Or(n.JSCreds, creds), cmp.Or(n.JSNKey, nkey)
	}
	var opts []nats.Option
	if creds != "" {
		opts = append(opts, nats.UserCredentials(creds))
	}
	if nkey != "" {
		opt, err := nats.NkeyOptionFromSeed(nkey)
		if err != nil {
			return nil, fmt.Errorf("NKey seed %s: %w", nkey, err)
		}
		opts = append(opts, opt)
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
	url := n.URL
	if jetStream {
		url = cmp.Or(n.JSURL, url)
	}
	opts, err := n.Options(jetStream)
	if err != nil {
		return nil, err
	}
	nc, err := nats.Connect(url, append(append(opts, nats.Name(name)), extra...)...)
	if err != nil {
		return nil, fmt.Errorf("connecting to nats at %s: %w", url, err)
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
			log.Info("nats reconnected", "url", nc.ConnectedUrlRedacted())
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
