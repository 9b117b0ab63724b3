package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/dispenser-dev/dispenser/ownership"
	"github.com/dispenser-dev/dispenser/segment"
	"github.com/dispenser-dev/dispenser/segment/kv"
	"github.com/dispenser-dev/dispenser/segment/witness"
	"github.com/dispenser-dev/dispenser/snowflake"
	"github.com/dispenser-dev/dispenser/tagmodel"
	"github.com/dispenser-dev/dispenser/worker"
	"github.com/dispenser-dev/dispenser/worker/mysqlstore"
	"github.com/dispenser-dev/dispenser/worker/pgstore"
)

// serve is `dispenser serve`: its flags make a worker.Config, the worker
// package validates it, starts the worker and runs it until ctx ends.
func serve(ctx context.Context, args []string, stderr io.Writer) error {
	fs := newFlagSet("serve", "dispenser [serve] [flags]", stderr)
	var c worker.Config
	var kvs worker.KV
	var pg pgstore.Postgres
	var my mysqlstore.MySQL
	var logLevel, logFormat string
	c.NATS.AddFlags(fs, "NATS server URL(s), comma-separated; empty starts an embedded nats-server with JetStream", true)
	inboxFlag(fs, &c.InboxPrefix)
	fs.StringVar(&c.JSInboxPrefix, "nats-js-inbox-prefix", "", "inbox prefix of the JetStream connection; empty: --nats-inbox-prefix")
	fs.StringVar(&c.Embedded.Listen, "nats-listen", worker.DefaultListen, "address of the embedded nats-server (when --nats-url is empty)")
	fs.StringVar(&c.Embedded.DataDir, "data-dir", worker.DefaultDataDir, "data directory of the embedded nats-server")
	fs.StringVar(&c.Instance, "instance", "", "this worker's name, used as NATS connection name (default host name plus a random suffix)")
	fs.Func("metrics-tags", "comma-separated tags whose requests and buffers get metric series of their own (all others are counted together, so scrapes stay small)", func(v string) error {
		c.MetricsTags = nil
		for t := range strings.SplitSeq(v, ",") {
			if t = strings.TrimSpace(t); t != "" {
				if err := tagmodel.CheckTag(t); err != nil {
					return err
				}
				c.MetricsTags = append(c.MetricsTags, t)
			}
		}
		return nil
	})
	fs.StringVar(&c.MetricsAddr, "metrics-addr", "", "address for /metrics, /healthz, /readyz and the status page /status (off when empty), e.g. 127.0.0.1:9090")
	fs.StringVar(&c.HTTPAddr, "http-addr", "", "address for Meituan Leaf's HTTP API: /api/segment/get/{key}, /api/snowflake/get/{key}, /decodeSnowflakeId, /cache, /db (off when empty), e.g. 127.0.0.1:8080")
	fs.IntVar(&c.HTTP.MaxConns, "http-max-conns", worker.DefaultMaxConns, "most connections each HTTP server (--metrics-addr, --http-addr) holds at once; more wait until one closes. Timeouts: headers 5s, request 10s, response 30s, idle 1m")
	fs.StringVar(&pg.URL, "postgres-url", "", "PostgreSQL URL of the segment store (table leaf_alloc); empty keeps segments in a JetStream KV bucket")
	fs.StringVar(&my.DSN, "mysql-url", "", "MySQL/MariaDB DSN of the segment store, as go-sql-driver writes it (user:password@tcp(host:3306)/dbname), on Leaf's own table leaf_alloc, which Leaf servers may keep using; not with --postgres-url")
	urlFileFlag(fs, &pg.URL, "postgres-url", "the PostgreSQL URL")
	urlFileFlag(fs, &my.DSN, "mysql-url", "the MySQL/MariaDB DSN")
	fs.BoolVar(&pg.Migrate, "migrate", false, "apply the database migrations before serving (PostgreSQL; MySQL: create the missing tables)")
	fs.StringVar(&kvs.Bucket, "segment-bucket", kv.DefaultBucket, "JetStream KV bucket of the segment store (without --postgres-url)")
	fs.IntVar(&kvs.Replicas, "segment-replicas", 1, "replicas of the segment bucket when it is created; an existing bucket with fewer is refused")
	witnessOn := fs.Bool("witness", true, "with --postgres-url or --mysql-url: record every segment in a JetStream KV witness before serving it, so that a failover to a replica that missed writes (or a restored backup) never hands out IDs twice")
	fs.StringVar(&pg.WitnessBucket, "witness-bucket", witness.DefaultBucket, "JetStream KV bucket of the witness marks")
	fs.IntVar(&pg.WitnessReplicas, "witness-replicas", 1, "replicas of the witness bucket when it is created; an existing bucket with fewer is refused")
	fs.StringVar(&c.Owners.Bucket, "ordered-bucket", ownership.DefaultBucket, "JetStream KV bucket of the owners of ordered tags")
	fs.IntVar(&c.Owners.Replicas, "ordered-replicas", 1, "replicas of that bucket when it is created; an existing bucket with fewer is refused")
	fs.DurationVar(&c.Owners.Lease, "ordered-lease", ownership.DefaultLease, "lease of an ordered tag's owner (at most 5m; heartbeats every 2s, or a third of it if shorter): one that could not renew for this long stops serving the tag, and another takes it over a lease later (after a crash about two leases; a graceful shutdown releases at once)")
	autoCreate := fs.Bool("auto-create-tags", false, "create an unknown tag on first use (default on in zero-setup mode: no --nats-url, no --postgres-url and no --mysql-url)")
	autoCreateStep := fs.Int64("auto-create-step", 1000, "step of tags created on first use")
	fs.IntVar(&c.Segment.AutoCreateMax, "auto-create-max", segment.DefaultAutoCreateMax, "most tags one worker creates on first use over its life (requests for random names cannot fill the store); beyond it an unknown tag is 404; -1: no bound")
	snowflakeOn := fs.Bool("snowflake", true, "serve snowflake IDs (needs JetStream for worker-ID leases)")
	fs.StringVar(&c.Snowflake.Bucket, "snowflake-bucket", snowflake.DefaultBucket, "JetStream KV bucket of the worker-ID leases")
	fs.IntVar(&c.Snowflake.Replicas, "snowflake-replicas", 1, "replicas of the lease bucket when it is created; an existing bucket with fewer is refused")
	epoch := fs.String("snowflake-epoch", snowflake.DefaultEpoch.Format(time.RFC3339), "epoch of snowflake timestamps (RFC 3339); every worker of a bucket must use the same")
	fs.Func("snowflake-layout", `bit layout of snowflake IDs: "default" (41 bits of ms, 10 of worker ID, 12 of sequence) or "js" (41+5+7: IDs below 2^53, safe as JavaScript numbers; 32 workers, 128,000 IDs/s each); recorded in the lease bucket when it is created, and every worker of a bucket must use the same`, func(v string) (err error) {
		c.Snowflake.Layout, err = snowflake.ParseLayout(v)
		return err
	})
	fs.IntVar(&c.Region.N, "region", 0, "this worker's region, 0-based, with --region-bits or --regions: region-local buckets get the suffix _rN and are created in the worker's NATS cluster (docs/regions.md)")
	fs.IntVar(&c.Region.Bits, "region-bits", 0, "bits of the 10 snowflake worker bits that name the region: each region leases worker IDs from its own bucket; every region must use the same (0: one lease bucket for all)")
	fs.IntVar(&c.Region.Count, "regions", 0, "number of regions with segment stores of their own (per-region mode): region N hands out the values v of its store as IDs v×regions+N; every region must use the same (0 or 1: one store for all regions)")
	fs.DurationVar(&c.Snowflake.Lease, "snowflake-lease", snowflake.DefaultLease, "worker-ID lease: a worker that could not renew for this long stops issuing")
	fs.DurationVar(&c.Snowflake.Heartbeat, "snowflake-heartbeat", 0, "interval of lease renewals, below --snowflake-lease (default 2s, or a third of the lease if that is shorter)")
	fs.BoolVar(&c.Snowflake.RandomSequence, "snowflake-random-sequence", false, "start each millisecond's sequence at a small random offset (even id % n sharding)")
	fs.StringVar(&c.Prefix, "prefix", worker.DefaultPrefix, "subject prefix: endpoints are PREFIX.segment.<tag> and PREFIX.snowflake")
	fs.StringVar(&c.QueueGroup, "queue-group", worker.DefaultQueueGroup, "queue group of the endpoints; workers in one group share the load")
	fs.IntVar(&c.MaxBatch, "max-batch", worker.DefaultMaxBatch, "most IDs one request may ask for")
	fs.DurationVar(&c.Segment.MaxWait, "max-wait", 100*time.Millisecond, "how long a request waits for a segment when both buffers are empty, before 503")
	fs.DurationVar(&c.Segment.ColdWait, "cold-wait", time.Second, "how long the requests for a tag with no segment in memory yet wait for its first segment (a store far away must not fail a cold tag's first request); at least --max-wait")
	fs.DurationVar(&c.Segment.BufferTime, "buffer-time", 0, "size buffers in time: each fetch takes at least this long's worth of IDs at the tag's recent rate (within --max-depth), so that a region cut off from a shared store keeps serving for about that long; a crash skips up to about twice as many (0: off)")
	fs.Float64Var(&c.Segment.PrefetchRatio, "prefetch-ratio", 0.1, "fetch the next segment once this fraction of the current one is used")
	fs.DurationVar(&c.Segment.FetchTimeout, "fetch-timeout", 2*time.Second, "timeout of one store call")
	fs.DurationVar(&c.Segment.RefreshInterval, "refresh-interval", time.Minute, "how often the tag list is reloaded")
	fs.DurationVar(&c.Segment.IdleTimeout, "idle-timeout", time.Hour, "a tag without requests for this long gives its unused IDs back and drops its buffers (0 or less: never)")
	fs.DurationVar(&c.Segment.NegativeTTL, "unknown-tag-ttl", 2*time.Second, "how long an unknown tag is answered from cache before the store is asked again")
	fs.Int64Var(&c.Segment.MaxStep, "max-step", 1_000_000, "cap of the dynamic step; a value below a tag's step pins that tag's step")
	fs.Int64Var(&c.Segment.MaxDepth, "max-depth", segment.DefaultMaxDepth, "most steps one fetch takes while a tag's requests outrun its fetches (1: one step per fetch); a crash loses at most 2 x this x the step of a tag's IDs per worker")
	fs.DurationVar(&c.ShutdownTimeout, "shutdown-timeout", worker.DefaultShutdownTimeout, "how long a graceful shutdown may take")
	fs.StringVar(&logLevel, "log-level", "info", "log level: debug, info, warn or error")
	fs.StringVar(&logFormat, "log-format", "text", "log format: text or json")
	pos, err := parse(fs, args)
	if err != nil {
		return err
	}
	if len(pos) > 0 {
		return fmt.Errorf("serve: unexpected argument %q", pos[0])
	}
	if err := checkURLFiles(fs, "postgres-url", "mysql-url"); err != nil {
		return err
	}
	if c.Logger, err = newLogger(stderr, logLevel, logFormat); err != nil {
		return err
	}
	// The context may give the URL: resolve it before an empty URL means
	// zero-setup mode.
	if c.NATS, err = c.NATS.Resolve(); err != nil {
		return err
	}
	given := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { given[f.Name] = true })
	if !given["auto-create-tags"] && os.Getenv(envName("auto-create-tags")) == "" {
		*autoCreate = c.NATS.URL == "" && pg.URL == "" && my.DSN == ""
	}
	if *autoCreateStep < 1 || *autoCreateStep > tagmodel.MaxStepLimit {
		return fmt.Errorf("--auto-create-step %d: want 1..%d", *autoCreateStep, tagmodel.MaxStepLimit)
	}
	if *autoCreate {
		c.Segment.AutoCreateStep = *autoCreateStep
	}
	if c.Segment.AutoCreateMax < -1 || c.Segment.AutoCreateMax == 0 {
		return fmt.Errorf("--auto-create-max %d: want a positive number, or -1 for no bound", c.Segment.AutoCreateMax)
	}
	if c.Segment.IdleTimeout <= 0 {
		c.Segment.IdleTimeout = -1 // never
	}
	if c.Snowflake.Epoch, err = snowflake.ParseEpoch(*epoch); err != nil {
		return fmt.Errorf("--snowflake-epoch %q: %w", *epoch, err)
	}
	c.NoSnowflake = !*snowflakeOn
	c.Store = kvs
	if pg.URL != "" {
		pg.NoWitness = !*witnessOn
		c.Store = pg
	}
	if my.DSN != "" {
		if pg.URL != "" {
			return errors.New("--postgres-url and --mysql-url: give one segment store")
		}
		my.Migrate, my.NoWitness, my.WitnessBucket, my.WitnessReplicas = pg.Migrate, !*witnessOn, pg.WitnessBucket, pg.WitnessReplicas
		c.Store = my
	}
	if err := checkFlags(c, pg); err != nil {
		return err
	}
	w, err := worker.New(ctx, c)
	if err != nil {
		return err
	}
	return w.Run(ctx)
}

// checkFlags refuses flags given as zero where the flag has a default of
// its own (worker.Config reads a zero as "the default"; an operator's 0 is
// a mistake), and --witness-replicas out of range also without
// --postgres-url. The worker validates the rest before it starts.
func checkFlags(c worker.Config, pg pgstore.Postgres) error {
	switch s := c.Segment; {
	case c.MaxBatch == 0:
		return fmt.Errorf("--max-batch 0: want 1..1000000")
	case s.PrefetchRatio == 0:
		return fmt.Errorf("--prefetch-ratio 0: want more than 0, at most 1")
	case s.MaxStep == 0:
		return fmt.Errorf("--max-step 0: want 1..%d", tagmodel.MaxStepLimit)
	case s.MaxDepth == 0:
		return fmt.Errorf("--max-depth 0: want 1..%d", segment.MaxDepthLimit)
	case s.MaxWait == 0 || s.FetchTimeout == 0 || s.RefreshInterval == 0 || s.NegativeTTL == 0 || c.ShutdownTimeout == 0:
		return errors.New("--max-wait, --fetch-timeout, --refresh-interval, --unknown-tag-ttl and --shutdown-timeout must be positive")
	case pg.WitnessReplicas < 1 || pg.WitnessReplicas > 5:
		return fmt.Errorf("--witness-replicas %d: want 1..5", pg.WitnessReplicas)
	case c.HTTP.MaxConns <= 0:
		return fmt.Errorf("--http-max-conns %d: want a positive number", c.HTTP.MaxConns)
	case c.Owners.Replicas == 0:
		return errors.New("--ordered-replicas 0: want 1..5")
	case c.Owners.Lease == 0:
		return fmt.Errorf("--ordered-lease 0s: want 10ms..%v", ownership.MaxLease)
	}
	return nil
}
