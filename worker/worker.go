// Package worker runs one dispenser worker in a process: it connects to
// NATS (or starts an embedded nats-server), opens the segment store, the
// allocator, the ownership leases of ordered tags and the snowflake
// worker-ID lease, and serves the NATS micro service, with metrics and
// health over HTTP if asked. `dispenser serve` is flags, a Config, New and
// Run; the bench and package dispensertest start workers the same way.
//
//	w, err := worker.New(ctx, worker.Config{NATS: worker.NATS{URL: url}})
//	if err != nil { … }
//	defer w.Close()
package worker

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/dispenser-dev/dispenser/dispenser"
	"github.com/dispenser-dev/dispenser/internal/htmlpage"
	"github.com/dispenser-dev/dispenser/internal/redact"
	"github.com/dispenser-dev/dispenser/ownership"
	"github.com/dispenser-dev/dispenser/protocol"
	"github.com/dispenser-dev/dispenser/segment"
	"github.com/dispenser-dev/dispenser/snowflake"
	"github.com/dispenser-dev/dispenser/tagmodel"
)

var (
	// ErrConfig means a Config (or a flag behind it) cannot work; New
	// returns it before it starts anything.
	ErrConfig = errors.New("worker: invalid configuration")
	// ErrDataDirInUse means another process (or another worker of this
	// one) holds the embedded nats-server's data directory (LockFile).
	ErrDataDirInUse = errors.New("worker: data directory in use")
	// ErrNetworkDataDir means the data directory is on a file system where
	// its lock cannot be trusted to keep a second worker out.
	ErrNetworkDataDir = errors.New("worker: data directory cannot be locked safely")
)

// Defaults of Config's zero values.
const (
	DefaultListen          = "127.0.0.1:4222"
	DefaultDataDir         = "./dispenser-data"
	DefaultPrefix          = protocol.DefaultPrefix
	DefaultQueueGroup      = protocol.DefaultQueueGroup
	DefaultMaxBatch        = protocol.DefaultMaxBatch
	DefaultShutdownTimeout = 10 * time.Second
)

// peerCheck is how long a worker waits for the running workers to describe
// themselves before it serves (dispenser.Config.PeerCheck).
const peerCheck = 150 * time.Millisecond

// Config configures a worker. Its zero value is a worker on an embedded
// nats-server (127.0.0.1:4222, data in ./dispenser-data) with segments in
// the JetStream KV bucket and snowflake IDs; every zero field means the
// default its comment names. The flags of `dispenser serve` in
// parentheses.
type Config struct {
	// NATS is how the worker connects (--nats-*). With NATS.URL empty it
	// starts an embedded nats-server as Embedded says.
	NATS     NATS
	Embedded Embedded
	// InboxPrefix and JSInboxPrefix are the inbox prefixes of the
	// connection that answers requests and of the JetStream one
	// (--nats-inbox-prefix, --nats-js-inbox-prefix), for a single-account
	// deployment where each user may subscribe to its own inboxes only
	// (docs/operations.md). Default "_INBOX"; JSInboxPrefix defaults to
	// InboxPrefix.
	InboxPrefix, JSInboxPrefix string
	// Instance names this worker: its NATS connections, its snowflake
	// lease and its ordered-tag leases (--instance). Default: the host
	// name, "-" and six random hex digits.
	Instance string
	// Logger gets the worker's log. Default slog.Default().
	Logger *slog.Logger

	// Store opens the segment store (--postgres-url, --segment-bucket,
	// --witness…). Default KV{}: the bucket kv.DefaultBucket.
	Store StoreOpener
	// Segment configures the allocator (--max-wait, --max-step, …, and
	// --auto-create-* as AutoCreateStep and AutoCreateMax); its zero
	// fields are the allocator's defaults. Store, Logger and OnFetch are
	// the worker's: values given here are ignored.
	Segment segment.Settings

	// Owners configures the ownership leases of ordered tags (--ordered-*).
	Owners Owners

	// Region places the worker in a region of a supercluster (--region,
	// --region-bits, --regions; docs/regions.md). Default: no regions.
	Region Region

	// NoSnowflake serves no snowflake IDs (--snowflake=false); default
	// false: snowflake IDs with a worker ID leased from Snowflake.Bucket.
	NoSnowflake bool
	// Snowflake configures the snowflake worker-ID lease (--snowflake-*);
	// zero fields are snowflake's defaults. Instance and Logger are the
	// worker's.
	Snowflake snowflake.NodeSettings

	// Prefix is the subject prefix (--prefix). Default "id".
	Prefix string
	// QueueGroup is the endpoints' queue group (--queue-group). Default
	// "dispenser".
	QueueGroup string
	// MaxBatch is the most IDs one request may ask for (--max-batch),
	// 1..1,000,000. Default 10,000.
	MaxBatch int

	// MetricsAddr, if not empty, serves /metrics, /healthz, /readyz and
	// the status page /status there (--metrics-addr). MetricsTags get metric series of their own
	// (--metrics-tags).
	MetricsAddr string
	MetricsTags []string

	// HTTP limits both HTTP servers (MetricsAddr, HTTPAddr): timeouts,
	// header size, concurrent connections (--http-max-conns). Zero fields:
	// the defaults.
	HTTP HTTPLimits

	// HTTPAddr, if not empty, serves Meituan Leaf's HTTP API there
	// (--http-addr): /api/segment/get/{key}, /api/snowflake/get/{key},
	// /decodeSnowflakeId, /cache and /db, from the same allocator and
	// snowflake generator as the NATS endpoints (package leafhttp).
	// Default empty: off.
	HTTPAddr string

	// ShutdownTimeout bounds Close (--shutdown-timeout). Default 10 s.
	ShutdownTimeout time.Duration
}

// Owners configures the leases that give each ordered tag one owner at a
// time (package ownership).
type Owners struct {
	// Bucket is their JetStream KV bucket (--ordered-bucket). Default
	// ownership.DefaultBucket.
	Bucket string
	// Replicas of the bucket when it is created, and the fewest an
	// existing one may have (--ordered-replicas), 1..5. Default 1.
	Replicas int
	// Lease is an owner's lease (--ordered-lease), 10ms..ownership.MaxLease:
	// an owner that could not renew for this long stops serving the tag.
	// Default ownership.DefaultLease.
	Lease time.Duration
}

// withDefaults returns c with its zero fields set to their defaults.
func (c Config) withDefaults() Config {
	c.Embedded.Listen = cmp.Or(c.Embedded.Listen, DefaultListen)
	c.Embedded.DataDir = cmp.Or(c.Embedded.DataDir, DefaultDataDir)
	if c.Instance == "" {
		c.Instance = DefaultInstance()
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.Store == nil {
		c.Store = KV{}
	}
	c.Owners.Lease = cmp.Or(c.Owners.Lease, ownership.DefaultLease)
	// Region-local buckets get names of their own (stream names are
	// global in a supercluster): the lease bucket with region bits, the
	// owners' with a store per region.
	c.Snowflake.Bucket = c.Region.Name(c.Snowflake.Bucket, snowflake.DefaultBucket, c.Region.Bits > 0)
	c.Owners.Bucket = c.Region.Name(c.Owners.Bucket, ownership.DefaultBucket, c.Region.PerRegionStores())
	c.Prefix = cmp.Or(c.Prefix, DefaultPrefix)
	c.QueueGroup = cmp.Or(c.QueueGroup, DefaultQueueGroup)
	c.MaxBatch = cmp.Or(c.MaxBatch, DefaultMaxBatch)
	c.ShutdownTimeout = cmp.Or(c.ShutdownTimeout, DefaultShutdownTimeout)
	return c
}

// validate rejects settings that cannot work before anything starts, so
// that a typo changes nothing (no server started, no lease claimed). c has
// its defaults.
func (c Config) validate() error {
	var err error
	switch s := c.Segment; {
	case c.MaxBatch < 1 || c.MaxBatch > 1_000_000:
		err = fmt.Errorf("--max-batch %d: want 1..1000000 (and a reply of 20 bytes per ID must fit the NATS max payload)", c.MaxBatch)
	case !(s.PrefetchRatio >= 0 && s.PrefetchRatio <= 1):
		err = fmt.Errorf("--prefetch-ratio %v: want more than 0, at most 1", s.PrefetchRatio)
	case s.MaxStep < 0 || s.MaxStep > tagmodel.MaxStepLimit:
		err = fmt.Errorf("--max-step %d: want 1..%d", s.MaxStep, tagmodel.MaxStepLimit)
	case s.MaxDepth < 0 || s.MaxDepth > segment.MaxDepthLimit:
		err = fmt.Errorf("--max-depth %d: want 1..%d", s.MaxDepth, segment.MaxDepthLimit)
	case s.AutoCreateStep < 0 || s.AutoCreateStep > tagmodel.MaxStepLimit:
		err = fmt.Errorf("--auto-create-step %d: want 1..%d", s.AutoCreateStep, tagmodel.MaxStepLimit)
	case s.MaxWait < 0 || s.ColdWait < 0 || s.BufferTime < 0 || s.FetchTimeout < 0 || s.RefreshInterval < 0 || s.NegativeTTL < 0 || c.ShutdownTimeout < 0:
		err = errors.New("--max-wait, --cold-wait, --buffer-time, --fetch-timeout, --refresh-interval, --unknown-tag-ttl and --shutdown-timeout must be positive")
	case c.Owners.Replicas < 0 || c.Owners.Replicas > 5:
		err = fmt.Errorf("--ordered-replicas %d: want 1..5", c.Owners.Replicas)
	case c.Owners.Lease < 10*time.Millisecond || c.Owners.Lease > ownership.MaxLease:
		err = fmt.Errorf("--ordered-lease %v: want 10ms..%v", c.Owners.Lease, ownership.MaxLease)
	case c.Snowflake.Lease < 0 || c.Snowflake.Heartbeat < 0:
		err = errors.New("--snowflake-lease and --snowflake-heartbeat must not be negative")
	case c.Snowflake.Lease > 0 && c.Snowflake.Heartbeat >= c.Snowflake.Lease:
		err = fmt.Errorf("--snowflake-heartbeat %v must be below --snowflake-lease %v", c.Snowflake.Heartbeat, c.Snowflake.Lease)
	case !c.Snowflake.Epoch.Before(time.Now()):
		err = fmt.Errorf("--snowflake-epoch %v is in the future", c.Snowflake.Epoch)
	}
	if err == nil {
		err = c.Region.Check()
	}
	if err == nil {
		err = c.HTTP.check()
	}
	if err != nil {
		return fmt.Errorf("%w: %w", ErrConfig, err)
	}
	if _, err := c.NATS.Options(false); err != nil {
		return err
	}
	for _, p := range []struct{ flag, v string }{{"--nats-inbox-prefix", c.InboxPrefix}, {"--nats-js-inbox-prefix", c.JSInboxPrefix}} {
		if err := CheckInboxPrefix(p.v, c.Prefix); err != nil {
			return fmt.Errorf("%w: %s: %w", ErrConfig, p.flag, err)
		}
	}
	return c.Store.Validate()
}

// CheckInboxPrefix refuses an inbox prefix ("" is the default) that is
// not a plain subject (wildcards, empty tokens, white space), lies in a
// system namespace ($...) or under the service's prefix: requesters
// publish there, and the service answers no reply subject there.
func CheckInboxPrefix(p, prefix string) error {
	if p == "" {
		return nil
	}
	if err := protocol.CheckReply(p+".x", prefix); err != nil {
		return fmt.Errorf("inbox prefix %q: %w; want a plain subject such as _INBOX_dispenser", p, err)
	}
	if strings.ContainsAny(p, "*>") { // nats.go refuses them anywhere
		return fmt.Errorf("inbox prefix %q: contains * or >; want a plain subject such as _INBOX_dispenser", p)
	}
	return nil
}

// inboxOption returns the option that sets a connection's inbox prefix p,
// none for the default.
func inboxOption(p string) []nats.Option {
	if p == "" {
		return nil
	}
	return []nats.Option{nats.CustomInboxPrefix(p)}
}

// DefaultInstance returns the host name, "-" and six random hex digits.
func DefaultInstance() string {
	host, err := os.Hostname()
	if err != nil || host == "" {
		host = "dispenser"
	}
	var b [3]byte
	rand.Read(b[:])
	return host + "-" + hex.EncodeToString(b[:])
}

// Worker is a running dispenser worker. Close stops it.
type Worker struct {
	cfg Config
	log *slog.Logger

	// ctx is the worker's own context, for its background work (the
	// metrics server's requests); Close cancels it.
	ctx    context.Context
	cancel context.CancelFunc

	// ns is the embedded nats-server; nil with Config.NATS.URL. nats is
	// how the worker connects: Config.NATS, or ns's (EmbeddedServer.NATS).
	ns   *EmbeddedServer
	nats NATS

	jsnc       *nats.Conn // JetStream: store, witness and leases
	store      *Store
	leaseName  string // snowflake lease bucket identity and epoch; "" without snowflake
	ownersName string // owners bucket identity (BucketIdentity)
	alloc      *segment.Allocator
	owners     *ownership.Leases
	sf         *snowflake.Node
	svc        *dispenser.Service
	reg        *prometheus.Registry // nil without MetricsAddr
	http       *http.Server         // metrics and health; nil without MetricsAddr
	httpAddr   string               // the metrics server's address
	httpDone   chan struct{}        // closed when the metrics server's goroutine returns
	// statusSnap is the status page's state, computed at most once a
	// second for every viewer.
	statusSnap htmlpage.Snapshot[*Status]
	// readyLogged is when /readyz last logged why the worker is not
	// ready (UnixNano; 0: never).
	readyLogged atomic.Int64
	leaf        *http.Server  // Leaf's HTTP API; nil without HTTPAddr
	leafAddr    string        // its address
	leafDone    chan struct{} // closed when its goroutine returns
	leafNC      *nats.Conn    // its requests for ordered tags; nil without HTTPAddr

	closeOnce sync.Once
	closeErr  error // Close's result; written once under closeOnce

	// connMu protects nc, movable, closing and moves.Add.
	connMu sync.Mutex
	// nc serves requests; drained on shutdown, and replaced when its
	// server enters lame-duck mode (move).
	nc      *nats.Conn
	movable *dispenser.Service // svc once it serves; nil before
	closing bool               // Close has begun: no new move
	moves   sync.WaitGroup     // moves in progress
}

// New validates cfg, starts the worker and returns once it serves. ctx
// bounds the start only: the worker runs until Close. On an error
// everything started is stopped again. A JetStream not ready yet is
// waited for, at most kvbucket.StartWait per step (kvbucket.WaitReady).
func New(ctx context.Context, cfg Config) (*Worker, error) {
	cfg = cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	// The context (--nats-context) decides, with the flags, whether the
	// worker connects or starts an embedded nats-server (an empty URL).
	var err error
	if cfg.NATS, err = cfg.NATS.Resolve(); err != nil {
		return nil, err
	}
	// A context's inbox prefix applies unless --nats-inbox-prefix is
	// given: it may not lie under the service's prefix either.
	if cfg.InboxPrefix == "" {
		if err := CheckInboxPrefix(cfg.NATS.InboxPrefix, cfg.Prefix); err != nil {
			return nil, fmt.Errorf("%w: %s: %w", ErrConfig, cfg.NATS.inboxSource(), err)
		}
	}
	w := &Worker{cfg: cfg, log: cfg.Logger}
	w.statusSnap.Compute = func(context.Context) (*Status, error) { return w.fullStatus(), nil }
	w.statusSnap.OnCompute = testStatusComputed
	w.ctx, w.cancel = context.WithCancel(context.Background())
	if err := w.start(ctx); err != nil {
		return nil, errors.Join(err, w.Close())
	}
	return w, nil
}

// Run serves until ctx ends, then shuts down gracefully (Close): it stops
// taking requests, answers those in flight, gives unissued segment IDs
// back and returns.
func (w *Worker) Run(ctx context.Context) error {
	<-ctx.Done()
	w.log.Info("shutting down")
	return w.Close()
}

func (w *Worker) start(ctx context.Context) error {
	t0 := time.Now()
	cfg := w.cfg
	nopts := cfg.NATS
	if nopts.URL == "" {
		ns, err := StartEmbedded(cfg.Embedded, cfg.Prefix)
		if err != nil {
			return err
		}
		w.ns = ns
		// Only the embedded server's own credentials: the credentials and
		// TLS flags are for a NATS given by --nats-url.
		nopts = ns.NATS()
		w.log.Info("embedded nats-server started", "listen", nopts.URL, "store", filepath.Join(cfg.Embedded.DataDir, "jetstream"),
			"admin_nkey", ns.KeyFile())
	}
	w.nats = nopts
	// Two connections: one serves requests and is drained on shutdown, the
	// other carries JetStream (KV store, leases) until the very end. They
	// may log in as two users, so that the one answering requests, whose
	// reply subjects the requesters choose, holds no JetStream rights.
	nc, err := nopts.connect(cfg.Instance, false, w.log, append(inboxOption(cfg.InboxPrefix), nats.LameDuckModeHandler(w.lameDuck))...)
	if err != nil {
		return err
	}
	w.connMu.Lock()
	w.nc = nc
	w.connMu.Unlock()
	if w.jsnc, err = nopts.connect(cfg.Instance+"-js", true, w.log, inboxOption(cmp.Or(cfg.JSInboxPrefix, cfg.InboxPrefix))...); err != nil {
		return err
	}
	js, err := jetstream.New(w.jsnc)
	if err != nil {
		return fmt.Errorf("jetstream: %w", err)
	}
	var reg *prometheus.Registry
	if cfg.MetricsAddr != "" {
		reg = prometheus.NewRegistry()
		reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	}
	var regr prometheus.Registerer // nil unless reg is: no typed nil
	if reg != nil {
		regr = reg
	}
	env := StoreEnv{Logger: w.log, Registerer: regr, Region: cfg.Region}
	if cfg.Region.On() {
		// Region-local buckets are created in this region's cluster.
		env.Cluster = w.jsnc.ConnectedClusterName()
	}
	if w.store, err = cfg.Store.OpenStore(ctx, js, env); err != nil {
		return err
	}
	verify, err := w.checkRegions(ctx)
	if err != nil {
		return err
	}
	st := cfg.Segment
	st.Store = w.store.Store
	st.Logger = w.log
	st.OnFetch = nil
	st.Regions = cfg.Region.Segments()
	st.Verify = verify
	if reg != nil {
		st.OnFetch = fetchHistogram(reg)
	}
	if w.alloc, err = segment.New(st); err != nil {
		return err
	}
	ownerToken, ownerSubject, err := w.openOwners(ctx, js)
	if err != nil {
		return err
	}
	var sf dispenser.Snowflake
	if !cfg.NoSnowflake {
		sfs := cfg.Snowflake
		sfs.Instance = cfg.Instance
		sfs.Logger = w.log
		if cfg.Region.Bits > 0 {
			if (sfs.Layout == snowflake.Layout{}) {
				sfs.Layout = snowflake.DefaultLayout
			}
			sfs.Layout.RegionBits, sfs.Region, sfs.Cluster = cfg.Region.Bits, cfg.Region.N, env.Cluster
			if sfs.Bucket == cfg.Region.Name("", snowflake.DefaultBucket, true) {
				// The region's default bucket holds worker IDs the
				// bucket without region bits held, if region bits were
				// turned on later: it starts above that bucket's bounds
				// (snowflake.NodeSettings.Predecessor).
				sfs.Predecessor = snowflake.DefaultBucket
				// Every region must use the same region bits.
				sfs.Siblings = snowflake.DefaultBucket + "_r"
			}
		} else if cmp.Or(sfs.Bucket, snowflake.DefaultBucket) == snowflake.DefaultBucket {
			// The regions' buckets hold this bucket's worker IDs too.
			sfs.RegionBuckets = snowflake.DefaultBucket + "_r"
		}
		if w.sf, err = snowflake.Start(ctx, js, sfs); err != nil {
			return err // snowflake's errors say "snowflake:" themselves
		}
		sf = w.sf
		id, _ := w.sf.WorkerID()
		w.log.Info("snowflake worker ID leased", "worker_id", id, "bucket", sfs.Bucket)
		if w.leaseName, err = BucketIdentity(ctx, js, cmp.Or(sfs.Bucket, snowflake.DefaultBucket)); err != nil {
			return err
		}
		w.leaseName += " epoch " + w.sf.Epoch().Format(time.RFC3339Nano)
		if l := w.sf.Layout(); !l.Same(snowflake.DefaultLayout) {
			// Only a layout other than the default is named, so that
			// workers of versions without layouts still match.
			w.leaseName += " layout " + l.String()
		}
	}

	dc := dispenser.Config{
		Conn:            nc,
		Segments:        w.alloc,
		Owners:          w.owners,
		OwnerSubject:    ownerSubject,
		OwnerID:         ownerToken,
		Snowflake:       sf,
		Prefix:          cfg.Prefix,
		QueueGroup:      cfg.QueueGroup,
		MaxBatch:        cfg.MaxBatch,
		Logger:          w.log,
		Store:           w.store.Name,
		StoreID:         w.store.ID,
		SnowflakeLeases: w.leaseName,
		OwnersBucket:    w.ownersName,
		Region:          cfg.Region,
		PeerCheck:       peerCheck,
	}
	if reg != nil {
		dc.Registerer = reg
		dc.MetricsTags = cfg.MetricsTags
	}
	if w.svc, err = dispenser.New(dc); err != nil {
		return err
	}
	w.connMu.Lock()
	w.movable = w.svc
	w.connMu.Unlock()
	if cfg.HTTPAddr != "" {
		if err := w.serveLeaf(nopts); err != nil {
			return err
		}
	}
	if reg != nil {
		w.reg = reg
		if err := w.serveHTTP(reg); err != nil {
			return err
		}
	}
	info := w.svc.Info()
	attrs := []any{"service", info.Name, "id", info.ID, "nats", redact.URL(nopts.URL), "prefix", cfg.Prefix,
		"queue_group", cfg.QueueGroup, "store", w.store.Name, "startup", time.Since(t0).Round(time.Millisecond)}
	if cfg.Region.On() {
		attrs = append(attrs, "region", cfg.Region.String())
	}
	w.log.Info("serving", attrs...)
	return nil
}

// checkRegions makes sure the store serves the worker's region settings
// (tagmodel.CheckRegions): a store per region records its region, and a
// worker of another region, or without regions, is refused. A store that
// cannot be reached now is not an error (a worker starts while its
// database is down): the returned func checks before the allocator's
// first fetch (segment.Settings.Verify); nil if the check passed.
func (w *Worker) checkRegions(ctx context.Context) (verify func(context.Context) error, err error) {
	r := w.cfg.Region.Segments()
	rs, ok := w.store.Admin.(tagmodel.RegionStore)
	if !ok {
		if r.Count > 1 {
			return nil, fmt.Errorf("%w: --regions: the store %s cannot record its region", ErrConfig, w.store.Name)
		}
		return nil, nil
	}
	cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	err = tagmodel.CheckRegions(cctx, rs, r)
	if err == nil || errors.Is(err, tagmodel.ErrRegionMismatch) || errors.Is(err, tagmodel.ErrInvalidArgument) {
		return nil, err
	}
	w.log.Warn("cannot check the store's region settings now; starting anyway: the first fetch checks them", "err", err)
	return func(ctx context.Context) error {
		err := tagmodel.CheckRegions(ctx, rs, r)
		if errors.Is(err, tagmodel.ErrRegionMismatch) {
			w.log.Error("the store belongs to another region: no segment is fetched from it", "err", err)
		}
		return err
	}, nil
}

// openOwners opens the ownership leases of ordered tags, wired to the
// allocator by ownership.Open, and returns the token that names this
// worker as an owner (in its direct subjects, protocol.DirectSubject) and
// the subject on which it takes forwarded requests.
func (w *Worker) openOwners(ctx context.Context, js jetstream.JetStream) (token, subject string, err error) {
	ownerToken := strings.ToLower(rand.Text()[:16])
	ownerSubject := w.cfg.Prefix + ".owner." + ownerToken
	var cluster string
	if w.cfg.Region.PerRegionStores() {
		cluster = w.jsnc.ConnectedClusterName()
	}
	w.owners, err = ownership.Open(ctx, js, w.alloc, ownership.Settings{
		Bucket: w.cfg.Owners.Bucket, Replicas: w.cfg.Owners.Replicas, Lease: w.cfg.Owners.Lease, Cluster: cluster,
		Owner: w.cfg.Instance + "-" + ownerToken, Subject: ownerSubject, Logger: w.log,
	})
	if err != nil {
		return "", "", err
	}
	// Its identity for the peer check: workers of one queue group must
	// record their owners in one bucket.
	if w.ownersName, err = BucketIdentity(ctx, js, w.cfg.Owners.Bucket); err != nil {
		return "", "", fmt.Errorf("owners of ordered tags: %w", err)
	}
	return ownerToken, ownerSubject, nil
}
