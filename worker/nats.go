package worker

import (
	"cmp"
	"fmt"
	"log/slog"
	"net"
	"net/url"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
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
	// Default "./dispenser-data".
	DataDir string
}

// EmbeddedOptions returns the options of an embedded nats-server with
// JetStream storing under storeDir. With syncAlways, JetStream writes every
// message to disk (fsync) before it acknowledges it: the KV buckets hold
// the only record of a tag's max_id and of a worker ID's timestamp bound,
// and JetStream's default (sync every two minutes) lets an OS crash or
// power loss roll acknowledged writes back, after which a restarted worker
// would hand out IDs again.
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

// StartEmbedded starts a nats-server with JetStream listening on
// e.Listen and storing under e.DataDir, syncing every write.
func StartEmbedded(e Embedded) (*server.Server, error) {
	listen, dataDir := cmp.Or(e.Listen, DefaultListen), cmp.Or(e.DataDir, DefaultDataDir)
	host, portStr, err := net.SplitHostPort(listen)
	if err != nil {
		return nil, fmt.Errorf("%w: --nats-listen %q: %w", ErrConfig, listen, err)
	}
	port, err := strconv.Atoi(portStr)
	if err != nil {
		return nil, fmt.Errorf("%w: --nats-listen %q: bad port: %w", ErrConfig, listen, err)
	}
	ns, err := server.NewServer(EmbeddedOptions("dispenser", host, port, filepath.Join(dataDir, "jetstream"), true))
	if err != nil {
		return nil, fmt.Errorf("embedded nats-server: %w", err)
	}
	ns.Start()
	if !ns.ReadyForConnections(10 * time.Second) {
		ns.Shutdown()
		return nil, fmt.Errorf("embedded nats-server did not start listening on %s", listen)
	}
	return ns, nil
}
