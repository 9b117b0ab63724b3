package main

import (
	"cmp"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/dispenser-dev/dispenser/dispenser"
	"github.com/dispenser-dev/dispenser/ordered"
	"github.com/dispenser-dev/dispenser/ownership"
	"github.com/dispenser-dev/dispenser/schema"
	"github.com/dispenser-dev/dispenser/segment"
	"github.com/dispenser-dev/dispenser/segment/kv"
	"github.com/dispenser-dev/dispenser/segment/postgres"
	"github.com/dispenser-dev/dispenser/segment/witness"
	"github.com/dispenser-dev/dispenser/snowflake"
)

// serveConfig holds the flags of `dispenser serve`.
type serveConfig struct {
	NATSURL    string
	NATSListen string
	DataDir    string
	Instance   string

	NATSCreds string
	NATSNKey  string
	// The JetStream connection's URL and credentials; empty: as above.
	NATSJSURL   string
	NATSJSCreds string
	NATSJSNKey  string
	NATSTLSCA   string
	NATSTLSCert string
	NATSTLSKey  string

	MetricsAddr string
	MetricsTags []string

	PostgresURL     string
	Migrate         bool
	SegmentBucket   string
	SegmentReplicas int
	NoWitness       bool // --witness=false
	OwnersBucket    string
	OwnersReplicas  int
	OwnersLease     time.Duration
	WitnessBucket   string
	WitnessReplicas int
	AutoCreateTags  bool
	AutoCreateStep  int64

	Snowflake         bool
	SnowflakeBucket   string
	SnowflakeEpoch    string
	SnowflakeSettings snowflake.WorkerSettings

	Prefix     string
	QueueGroup string
	MaxBatch   int

	Segment segment.Settings

	ShutdownTimeout time.Duration
}

// Server runs one dispenser worker: an optional embedded nats-server, the
// segment allocator and the micro service.
type Server struct {
	cfg serveConfig
	log *slog.Logger

	ns        *server.Server
	nc        *nats.Conn // serves requests; drained on shutdown
	jsnc      *nats.Conn // JetStream: KV store and leases
	pool      *pgxpool.Pool
	store     segment.Store
	storeName string
	leaseName string // snowflake lease bucket identity and epoch; "" without snowflake
	alloc     *segment.Allocator
	owners    *ownership.Leases
	worker    *snowflake.Worker
	svc       *dispenser.Service
	http      *http.Server // metrics and health; nil without --metrics-addr
}

// NewServer returns a Server for cfg; Run starts it.
func NewServer(cfg serveConfig, log *slog.Logger) *Server {
	return &Server{cfg: cfg, log: log}
}

// Run starts the worker and serves until ctx ends, then shuts down
// gracefully: it stops taking requests, answers those in flight, gives
// unissued segment IDs back and returns.
func (s *Server) Run(ctx context.Context) error {
	if err := s.Start(ctx); err != nil {
		s.Close()
		return err
	}
	<-ctx.Done()
	s.log.Info("shutting down")
	return s.Close()
}

// Start starts the worker and returns once it serves. Close stops it.
func (s *Server) Start(ctx context.Context) error {
	t0 := time.Now()
	url := s.cfg.NATSURL
	if url == "" {
		ns, err := startEmbeddedNATS(s.cfg.NATSListen, s.cfg.DataDir)
		if err != nil {
			return err
		}
		s.ns = ns
		url = ns.ClientURL()
		s.log.Info("embedded nats-server started", "listen", url, "store", filepath.Join(s.cfg.DataDir, "jetstream"))
	}
	// Two connections: one serves requests and is drained on shutdown, the
	// other carries JetStream (KV store, leases) until the very end. They
	// may log in as two users, so that the one answering requests, whose
	// reply subjects the requesters choose, holds no JetStream rights.
	var err error
	if s.nc, err = s.connect(url, s.cfg.Instance, s.cfg.NATSCreds, s.cfg.NATSNKey); err != nil {
		return err
	}
	if s.jsnc, err = s.connect(cmp.Or(s.cfg.NATSJSURL, url), s.cfg.Instance+"-js", cmp.Or(s.cfg.NATSJSCreds, s.cfg.NATSCreds), cmp.Or(s.cfg.NATSJSNKey, s.cfg.NATSNKey)); err != nil {
		return err
	}
	js, err := jetstream.New(s.jsnc)
	if err != nil {
		return fmt.Errorf("jetstream: %w", err)
	}
	var reg *prometheus.Registry
	if s.cfg.MetricsAddr != "" {
		reg = prometheus.NewRegistry()
		reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	}
	var regr prometheus.Registerer // nil unless reg is: no typed nil
	if reg != nil {
		regr = reg
	}
	if err := s.openStore(ctx, js, regr); err != nil {
		return err
	}
	st := s.cfg.Segment
	st.Store = s.store
	st.Logger = s.log
	if reg != nil {
		st.OnFetch = fetchHistogram(reg)
	}
	if s.cfg.AutoCreateTags {
		st.AutoCreateStep = s.cfg.AutoCreateStep
	}
	if s.alloc, err = segment.New(st); err != nil {
		return err
	}
	ownerToken := strings.ToLower(rand.Text()[:16])
	ownerSubject := cmp.Or(s.cfg.Prefix, "id") + ".owner." + ownerToken
	s.owners, err = ordered.OpenLeases(ctx, js, s.alloc, ownership.Settings{
		Bucket: s.cfg.OwnersBucket, Replicas: s.cfg.OwnersReplicas, Lease: s.cfg.OwnersLease,
		Owner: s.cfg.Instance + "-" + ownerToken, Subject: ownerSubject, Logger: s.log,
	})
	if err != nil {
		return err
	}
	var sf dispenser.Snowflake
	if s.cfg.Snowflake {
		sfs := s.cfg.SnowflakeSettings
		sfs.Instance = s.cfg.Instance
		sfs.Logger = s.log
		if s.worker, err = snowflake.StartWorker(ctx, js, sfs); err != nil {
			return err // snowflake's errors say "snowflake:" themselves
		}
		sf = s.worker
		id, _ := s.worker.WorkerID()
		s.log.Info("snowflake worker ID leased", "worker_id", id, "bucket", sfs.Bucket)
		if s.leaseName, err = bucketIdentity(ctx, js, cmp.Or(sfs.Bucket, snowflake.DefaultBucket)); err != nil {
			return err
		}
		s.leaseName += " epoch " + s.worker.Epoch().Format(time.RFC3339Nano)
	}

	cfg := dispenser.Config{
		Conn:         s.nc,
		Segments:     s.alloc,
		Owners:       s.owners,
		OwnerSubject: ownerSubject,
		Snowflake:    sf,
		Prefix:       s.cfg.Prefix,
		QueueGroup:   s.cfg.QueueGroup,
		MaxBatch:     s.cfg.MaxBatch,
		Logger:       s.log,
	}
	if reg != nil {
		cfg.Registerer = reg
		cfg.MetricsTags = s.cfg.MetricsTags
	}
	cfg.Store = s.storeName
	cfg.SnowflakeLeases = s.leaseName
	cfg.PeerCheck = peerCheck
	s.svc, err = dispenser.New(cfg)
	if err != nil {
		return err
	}
	if reg != nil {
		if err := s.serveHTTP(reg); err != nil {
			return err
		}
	}
	info := s.svc.Info()
	s.log.Info("serving", "service", info.Name, "id", info.ID, "nats", url, "prefix", s.cfg.Prefix,
		"queue_group", s.cfg.QueueGroup, "store", s.storeName, "startup", time.Since(t0).Round(time.Millisecond))
	return nil
}

// openStore opens the segment store: PostgreSQL with --postgres-url (behind
// the witness unless --witness=false), else the JetStream KV bucket. reg, if
// not nil, gets the witness's rollback counter.
func (s *Server) openStore(ctx context.Context, js jetstream.JetStream, reg prometheus.Registerer) error {
	if s.cfg.PostgresURL == "" {
		st, err := kv.New(ctx, js, kv.Settings{Bucket: s.cfg.SegmentBucket, Replicas: s.cfg.SegmentReplicas, Logger: s.log})
		if err != nil {
			return err
		}
		name, err := bucketIdentity(ctx, js, cmp.Or(s.cfg.SegmentBucket, kv.DefaultBucket))
		if err != nil {
			return err
		}
		s.store, s.storeName = st, "kv:"+name
		return nil
	}
	pool, err := pgxpool.New(ctx, s.cfg.PostgresURL)
	if err != nil {
		return fmt.Errorf("postgres: %w", err)
	}
	s.pool = pool
	if s.cfg.Migrate {
		applied, err := schema.Migrate(ctx, pool)
		if err != nil {
			return err
		}
		s.log.Info("migrations applied", "versions", applied)
	}
	// A worker of this version needs every migration it knows: refuse to
	// start (with what to run) rather than fail every fetch. A database
	// that cannot be reached now is not checked: the worker starts without
	// it, as always (its fetches fail until it is back).
	if missing, err := schema.Missing(ctx, pool); err != nil {
		s.log.Warn("postgres: cannot check the schema version now; starting anyway", "err", err)
	} else if len(missing) > 0 {
		return fmt.Errorf("postgres: the database lacks migrations %v of this version: run `dispenser migrate --postgres-url …` (or serve --migrate) first", missing)
	}
	pc := pool.Config().ConnConfig
	hosts := fmt.Sprintf("%s:%d", pc.Host, pc.Port)
	for _, fb := range pc.Fallbacks {
		if a := fmt.Sprintf("%s:%d", fb.Host, fb.Port); !strings.Contains(","+hosts+",", ","+a+",") {
			hosts += "," + a
		}
	}
	pg := postgres.New(pool)
	s.store, s.storeName = pg, fmt.Sprintf("postgres:%s/%s", hosts, pc.Database)
	if s.cfg.NoWitness {
		s.log.Warn("--witness=false: a failover of PostgreSQL to a replica that missed writes, or a restored backup, can hand out IDs twice")
		return nil
	}
	rollbacks := prometheus.NewCounter(prometheus.CounterOpts{
		Name: "dispenser_segment_rollbacks_total",
		Help: "Fetches that found the segment store behind the witness (lost writes: failover, restored backup, max_id lowered by hand).",
	})
	if reg != nil {
		reg.MustRegister(rollbacks)
	}
	w, err := witness.Open(ctx, js, pg, witness.Settings{
		Bucket:     s.cfg.WitnessBucket,
		Replicas:   s.cfg.WitnessReplicas,
		Logger:     s.log,
		OnRollback: func(string, int64, int64) { rollbacks.Inc() },
	})
	if err != nil {
		return err
	}
	name, err := bucketIdentity(ctx, js, w.Bucket())
	if err != nil {
		return err
	}
	s.store, s.storeName = w, s.storeName+" witness:"+name
	return nil
}

// natsOptions returns the connection options for a credentials file, an
// NKey seed file and the TLS flags. User, password and token go in the URL.
func (c serveConfig) natsOptions(creds, nkey string) ([]nats.Option, error) {
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
	if c.NATSTLSCA != "" {
		opts = append(opts, nats.RootCAs(c.NATSTLSCA))
	}
	if (c.NATSTLSCert == "") != (c.NATSTLSKey == "") {
		return nil, errors.New("--nats-tls-cert and --nats-tls-key go together")
	}
	if c.NATSTLSCert != "" {
		opts = append(opts, nats.ClientCert(c.NATSTLSCert, c.NATSTLSKey))
	}
	return opts, nil
}

// NATSURL returns the URL of the NATS server the worker uses.
func (s *Server) NATSURL() string {
	if s.nc == nil {
		return ""
	}
	return s.nc.ConnectedUrl()
}

func (s *Server) connect(url, name, creds, nkey string) (*nats.Conn, error) {
	log := s.log.With("conn", name)
	opts, err := s.cfg.natsOptions(creds, nkey)
	if err != nil {
		return nil, err
	}
	nc, err := nats.Connect(url, append(opts,
		nats.Name(name),
		nats.MaxReconnects(-1),
		nats.ReconnectWait(250*time.Millisecond),
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
	)...)
	if err != nil {
		return nil, fmt.Errorf("connecting to nats at %s: %w", url, err)
	}
	return nc, nil
}

// Close shuts the worker down in order: the service (answering requests in
// flight), the allocator (giving segments back), then the connections.
func (s *Server) Close() error {
	ctx, cancel := context.WithTimeout(context.Background(), s.cfg.ShutdownTimeout)
	defer cancel()
	var errs []error
	if s.http != nil {
		errs = append(errs, s.http.Shutdown(ctx))
	}
	if s.owners != nil {
		// Hand ordered tags over at once: stop serving them, release the
		// leases. Requests for them from here on go to the new owners.
		s.owners.Close()
	}
	if s.svc != nil {
		errs = append(errs, s.svc.Stop(ctx))
	}
	// Giving segments back and releasing the lease only save IDs and time
	// for a successor; failing them (store or NATS down) is safe, so it is
	// logged, not a failed shutdown.
	if s.alloc != nil {
		if err := s.alloc.Close(ctx); err != nil {
			s.log.Warn("segments not given back; their unissued IDs are skipped", "err", err)
		}
	}
	if s.worker != nil {
		if err := s.worker.Close(ctx); err != nil {
			s.log.Warn("snowflake lease not released; a successor waits for it to expire", "err", err)
		}
	}
	if s.nc != nil {
		s.nc.Close()
	}
	if s.jsnc != nil {
		s.jsnc.Close()
	}
	if s.pool != nil {
		s.pool.Close()
	}
	if s.ns != nil {
		s.ns.Shutdown()
		s.ns.WaitForShutdown()
	}
	return errors.Join(errs...)
}

// embeddedOptions returns the options of an embedded nats-server with
// JetStream storing under storeDir. With syncAlways, JetStream writes every
// message to disk (fsync) before it acknowledges it: the KV buckets hold
// the only record of a tag's max_id and of a worker ID's timestamp bound,
// and JetStream's default (sync every two minutes) lets an OS crash or
// power loss roll acknowledged writes back, after which a restarted worker
// would hand out IDs again.
func embeddedOptions(name, host string, port int, storeDir string, syncAlways bool) *server.Options {
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

// startEmbeddedNATS starts a nats-server with JetStream listening on listen
// and storing under dataDir, syncing every write.
func startEmbeddedNATS(listen, dataDir string) (*server.Server, error) {
	host, portStr, err := net.SplitHostPort(listen)
	if err != nil {
		return nil, fmt.Errorf("--nats-listen %q: %w", listen, err)
	}
	port, err := strconv.Atoi(portStr)
	if err != nil {
		return nil, fmt.Errorf("--nats-listen %q: bad port: %w", listen, err)
	}
	ns, err := server.NewServer(embeddedOptions("dispenser", host, port, filepath.Join(dataDir, "jetstream"), true))
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

// serveHTTP serves /metrics, /healthz and /readyz on --metrics-addr.
func (s *Server) serveHTTP(reg *prometheus.Registry) error {
	ln, err := net.Listen("tcp", s.cfg.MetricsAddr)
	if err != nil {
		return fmt.Errorf("--metrics-addr: %w", err)
	}
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprintln(w, "ok")
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, r *http.Request) {
		if err := s.ready(r.Context()); err != nil {
			http.Error(w, "not ready: "+err.Error(), http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, "ready")
	})
	s.http = &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() {
		if err := s.http.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			s.log.Error("metrics server", "err", err)
		}
	}()
	s.log.Info("metrics and health", "addr", ln.Addr().String())
	return nil
}

// ready reports why the worker cannot serve, or nil: it must be connected
// to NATS (both connections), hold a valid snowflake lease, and its store
// must answer or its buffers hold IDs.
func (s *Server) ready(ctx context.Context) error {
	for _, nc := range []*nats.Conn{s.nc, s.jsnc} {
		if !nc.IsConnected() {
			return fmt.Errorf("nats: %s", nc.Status())
		}
	}
	if s.worker != nil {
		st, _ := s.worker.Stats().(snowflake.WorkerStats)
		if !st.Held || st.Fenced || st.ClockBehind {
			return fmt.Errorf("snowflake: lease held %v, fenced %v, clock behind %v", st.Held, st.Fenced, st.ClockBehind)
		}
	}
	if s.alloc == nil {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	pinger, ok := s.store.(interface{ Ping(context.Context) error })
	if !ok {
		return nil
	}
	err := pinger.Ping(ctx)
	if err == nil {
		return nil
	}
	if s.alloc.Totals().Remaining > 0 {
		return nil // warm buffers keep serving while the store is away
	}
	return fmt.Errorf("store unreachable and no warm buffers: %w", err)
}

// fetchHistogram registers the segment fetch latency histogram and returns
// the allocator hook that feeds it.
func fetchHistogram(reg prometheus.Registerer) func(string, time.Duration, error) {
	h := prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    "dispenser_segment_fetch_duration_seconds",
		Help:    "Latency of segment fetches from the store, by result.",
		Buckets: prometheus.ExponentialBuckets(250e-6, 2, 14),
	}, []string{"result"})
	reg.MustRegister(h)
	ok, failed := h.WithLabelValues("ok"), h.WithLabelValues("error")
	return func(_ string, d time.Duration, err error) {
		if err != nil {
			failed.Observe(d.Seconds())
			return
		}
		ok.Observe(d.Seconds())
	}
}

// bucketIdentity names a JetStream KV bucket by its name and its stream's
// creation time, so that two buckets of one name (in two JetStream domains,
// or deleted and made again) tell apart.
func bucketIdentity(ctx context.Context, js jetstream.JetStream, bucket string) (string, error) {
	kvb, err := js.KeyValue(ctx, bucket)
	if err != nil {
		return "", fmt.Errorf("bucket %q: %w", bucket, err)
	}
	st, err := kvb.Status(ctx)
	if err != nil {
		return "", fmt.Errorf("bucket %q: status: %w", bucket, err)
	}
	if bs, ok := st.(*jetstream.KeyValueBucketStatus); ok {
		return bucket + "@" + bs.StreamInfo().Created.UTC().Format(time.RFC3339Nano), nil
	}
	return bucket, nil
}

// peerCheck is how long a worker waits for the running workers to describe
// themselves before it serves (dispenser.Config.PeerCheck).
const peerCheck = 150 * time.Millisecond
