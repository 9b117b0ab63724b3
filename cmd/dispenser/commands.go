package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/dispenser-dev/dispenser/ownership"
	"github.com/dispenser-dev/dispenser/schema"
	"github.com/dispenser-dev/dispenser/segment"
	"github.com/dispenser-dev/dispenser/segment/kv"
	"github.com/dispenser-dev/dispenser/segment/postgres"
	"github.com/dispenser-dev/dispenser/segment/witness"
	"github.com/dispenser-dev/dispenser/snowflake"
)

func defaultInstance() string {
	host, err := os.Hostname()
	if err != nil || host == "" {
		host = "dispenser"
	}
	var b [3]byte
	rand.Read(b[:])
	return host + "-" + hex.EncodeToString(b[:])
}

func serve(ctx context.Context, args []string, stderr io.Writer) error {
	fs := newFlagSet("serve", "dispenser [serve] [flags]", stderr)
	var c serveConfig
	var logLevel, logFormat string
	fs.StringVar(&c.NATSURL, "nats-url", "", "NATS server URL(s), comma-separated; empty starts an embedded nats-server with JetStream")
	fs.StringVar(&c.NATSListen, "nats-listen", "127.0.0.1:4222", "address of the embedded nats-server (when --nats-url is empty)")
	fs.StringVar(&c.DataDir, "data-dir", "./dispenser-data", "data directory of the embedded nats-server")
	fs.StringVar(&c.Instance, "instance", "", "this worker's name, used as NATS connection name (default host name plus a random suffix)")
	fs.StringVar(&c.NATSCreds, "nats-creds", "", "NATS credentials file (JWT and seed); user/password or token go in --nats-url")
	fs.StringVar(&c.NATSNKey, "nats-nkey", "", "NATS NKey seed file")
	fs.StringVar(&c.NATSJSURL, "nats-js-url", "", "NATS URL(s) of the second connection, which carries JetStream (KV store, witness, leases) and answers no requests; empty: --nats-url. Put a second user in it (nats://user:pass@host) to keep JetStream rights away from the connection that answers requests")
	fs.StringVar(&c.NATSJSCreds, "nats-js-creds", "", "credentials file of the JetStream connection; empty: --nats-creds")
	fs.StringVar(&c.NATSJSNKey, "nats-js-nkey", "", "NKey seed file of the JetStream connection; empty: --nats-nkey")
	fs.StringVar(&c.NATSTLSCA, "nats-tls-ca", "", "CA certificate file to verify the NATS server")
	fs.StringVar(&c.NATSTLSCert, "nats-tls-cert", "", "client certificate file for NATS TLS")
	fs.StringVar(&c.NATSTLSKey, "nats-tls-key", "", "client key file for NATS TLS")
	fs.Func("metrics-tags", "comma-separated tags whose requests and buffers get metric series of their own (all others are counted together, so scrapes stay small)", func(v string) error {
		c.MetricsTags = nil
		for t := range strings.SplitSeq(v, ",") {
			if t = strings.TrimSpace(t); t != "" {
				if err := segment.CheckTag(t); err != nil {
					return err
				}
				c.MetricsTags = append(c.MetricsTags, t)
			}
		}
		return nil
	})
	fs.StringVar(&c.MetricsAddr, "metrics-addr", "", "address for /metrics, /healthz and /readyz (off when empty), e.g. 127.0.0.1:9090")
	fs.StringVar(&c.PostgresURL, "postgres-url", "", "PostgreSQL URL of the segment store (table leaf_alloc); empty keeps segments in a JetStream KV bucket")
	fs.BoolVar(&c.Migrate, "migrate", false, "apply the database migrations before serving (PostgreSQL)")
	fs.StringVar(&c.SegmentBucket, "segment-bucket", kv.DefaultBucket, "JetStream KV bucket of the segment store (without --postgres-url)")
	fs.IntVar(&c.SegmentReplicas, "segment-replicas", 1, "replicas of the segment bucket when it is created; an existing bucket with fewer is refused")
	witnessOn := fs.Bool("witness", true, "with --postgres-url: record every segment in a JetStream KV witness before serving it, so that a failover to a replica that missed writes (or a restored backup) never hands out IDs twice")
	fs.StringVar(&c.WitnessBucket, "witness-bucket", witness.DefaultBucket, "JetStream KV bucket of the witness marks")
	fs.IntVar(&c.WitnessReplicas, "witness-replicas", 1, "replicas of the witness bucket when it is created; an existing bucket with fewer is refused")
	fs.StringVar(&c.OwnersBucket, "ordered-bucket", ownership.DefaultBucket, "JetStream KV bucket of the owners of ordered tags")
	fs.IntVar(&c.OwnersReplicas, "ordered-replicas", 1, "replicas of that bucket when it is created; an existing bucket with fewer is refused")
	fs.DurationVar(&c.OwnersLease, "ordered-lease", ownership.DefaultLease, "lease of an ordered tag's owner (at most 5m): one that could not renew for this long stops serving the tag, and another takes it over a lease later")
	fs.BoolVar(&c.AutoCreateTags, "auto-create-tags", false, "create an unknown tag on first use (default on in zero-setup mode: no --nats-url and no --postgres-url)")
	fs.Int64Var(&c.AutoCreateStep, "auto-create-step", 1000, "step of tags created on first use")
	fs.IntVar(&c.Segment.AutoCreateMax, "auto-create-max", segment.DefaultAutoCreateMax, "most tags one worker creates on first use over its life (requests for random names cannot fill the store); beyond it an unknown tag is 404; -1: no bound")
	fs.BoolVar(&c.Snowflake, "snowflake", true, "serve snowflake IDs (needs JetStream for worker-ID leases)")
	fs.StringVar(&c.SnowflakeBucket, "snowflake-bucket", snowflake.DefaultBucket, "JetStream KV bucket of the worker-ID leases")
	fs.IntVar(&c.SnowflakeSettings.Replicas, "snowflake-replicas", 1, "replicas of the lease bucket when it is created; an existing bucket with fewer is refused")
	fs.StringVar(&c.SnowflakeEpoch, "snowflake-epoch", snowflake.DefaultEpoch.Format(time.RFC3339), "epoch of snowflake timestamps (RFC 3339); every worker of a bucket must use the same")
	fs.DurationVar(&c.SnowflakeSettings.Lease, "snowflake-lease", snowflake.DefaultLease, "worker-ID lease: a worker that could not renew for this long stops issuing")
	fs.DurationVar(&c.SnowflakeSettings.Heartbeat, "snowflake-heartbeat", 0, "interval of lease renewals, below --snowflake-lease (default 3s, or a third of the lease if that is shorter)")
	fs.BoolVar(&c.SnowflakeSettings.RandomSequence, "snowflake-random-sequence", false, "start each millisecond's sequence at a small random offset (even id % n sharding)")
	fs.StringVar(&c.Prefix, "prefix", "id", "subject prefix: endpoints are PREFIX.segment.<tag> and PREFIX.snowflake")
	fs.StringVar(&c.QueueGroup, "queue-group", "dispenser", "queue group of the endpoints; workers in one group share the load")
	fs.IntVar(&c.MaxBatch, "max-batch", 10000, "most IDs one request may ask for")
	fs.DurationVar(&c.Segment.MaxWait, "max-wait", 100*time.Millisecond, "how long a request waits for a segment when both buffers are empty, before 503")
	fs.Float64Var(&c.Segment.PrefetchRatio, "prefetch-ratio", 0.1, "fetch the next segment once this fraction of the current one is used")
	fs.DurationVar(&c.Segment.FetchTimeout, "fetch-timeout", 2*time.Second, "timeout of one store call")
	fs.DurationVar(&c.Segment.RefreshInterval, "refresh-interval", time.Minute, "how often the tag list is reloaded")
	fs.DurationVar(&c.Segment.IdleTimeout, "idle-timeout", time.Hour, "a tag without requests for this long gives its unused IDs back and drops its buffers (0 or less: never)")
	fs.DurationVar(&c.Segment.NegativeTTL, "unknown-tag-ttl", 2*time.Second, "how long an unknown tag is answered from cache before the store is asked again")
	fs.Int64Var(&c.Segment.MaxStep, "max-step", 1_000_000, "cap of the dynamic step; a value below a tag's step pins that tag's step")
	fs.DurationVar(&c.ShutdownTimeout, "shutdown-timeout", 10*time.Second, "how long a graceful shutdown may take")
	fs.StringVar(&logLevel, "log-level", "info", "log level: debug, info, warn or error")
	fs.StringVar(&logFormat, "log-format", "text", "log format: text or json")
	pos, err := parse(fs, args)
	if err != nil {
		return err
	}
	if len(pos) > 0 {
		return fmt.Errorf("serve: unexpected argument %q", pos[0])
	}
	log, err := newLogger(stderr, logLevel, logFormat)
	if err != nil {
		return err
	}
	if c.Instance == "" {
		c.Instance = defaultInstance()
	}
	given := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { given[f.Name] = true })
	if !given["auto-create-tags"] && os.Getenv(envName("auto-create-tags")) == "" {
		c.AutoCreateTags = c.NATSURL == "" && c.PostgresURL == ""
	}
	epoch, err := time.Parse(time.RFC3339, c.SnowflakeEpoch)
	if err != nil {
		return fmt.Errorf("--snowflake-epoch %q: %w", c.SnowflakeEpoch, err)
	}
	c.SnowflakeSettings.Epoch = epoch
	c.NoWitness = !*witnessOn
	if c.Segment.AutoCreateMax < -1 || c.Segment.AutoCreateMax == 0 {
		return fmt.Errorf("--auto-create-max %d: want a positive number, or -1 for no bound", c.Segment.AutoCreateMax)
	}
	if c.Segment.IdleTimeout <= 0 {
		c.Segment.IdleTimeout = -1 // never
	}
	if err := c.validate(); err != nil {
		return err
	}
	c.SnowflakeSettings.Bucket = c.SnowflakeBucket
	return NewServer(c, log).Run(ctx)
}

// validate rejects settings that cannot work before anything starts, so
// that a typo changes nothing (no server started, no lease claimed).
func (c serveConfig) validate() error {
	switch {
	case c.MaxBatch < 1 || c.MaxBatch > 1_000_000:
		return fmt.Errorf("--max-batch %d: want 1..1000000 (and a reply of 20 bytes per ID must fit the NATS max payload)", c.MaxBatch)
	case !(c.Segment.PrefetchRatio > 0 && c.Segment.PrefetchRatio <= 1):
		return fmt.Errorf("--prefetch-ratio %v: want more than 0, at most 1", c.Segment.PrefetchRatio)
	case c.Segment.MaxStep < 1 || c.Segment.MaxStep > segment.MaxStepLimit:
		return fmt.Errorf("--max-step %d: want 1..%d", c.Segment.MaxStep, segment.MaxStepLimit)
	case c.AutoCreateStep < 1 || c.AutoCreateStep > segment.MaxStepLimit:
		return fmt.Errorf("--auto-create-step %d: want 1..%d", c.AutoCreateStep, segment.MaxStepLimit)
	case c.Segment.MaxWait <= 0 || c.Segment.FetchTimeout <= 0 || c.Segment.RefreshInterval <= 0 || c.Segment.NegativeTTL <= 0 || c.ShutdownTimeout <= 0:
		return errors.New("--max-wait, --fetch-timeout, --refresh-interval, --unknown-tag-ttl and --shutdown-timeout must be positive")
	case c.WitnessReplicas < 1 || c.WitnessReplicas > 5:
		return fmt.Errorf("--witness-replicas %d: want 1..5", c.WitnessReplicas)
	case c.OwnersReplicas < 1 || c.OwnersReplicas > 5:
		return fmt.Errorf("--ordered-replicas %d: want 1..5", c.OwnersReplicas)
	case c.OwnersLease < 10*time.Millisecond || c.OwnersLease > ownership.MaxLease:
		return fmt.Errorf("--ordered-lease %v: want 10ms..%v", c.OwnersLease, ownership.MaxLease)
	case c.SnowflakeSettings.Lease < 0 || c.SnowflakeSettings.Heartbeat < 0:
		return errors.New("--snowflake-lease and --snowflake-heartbeat must not be negative")
	case c.SnowflakeSettings.Lease > 0 && c.SnowflakeSettings.Heartbeat >= c.SnowflakeSettings.Lease:
		return fmt.Errorf("--snowflake-heartbeat %v must be below --snowflake-lease %v", c.SnowflakeSettings.Heartbeat, c.SnowflakeSettings.Lease)
	case !c.SnowflakeSettings.Epoch.Before(time.Now()):
		return fmt.Errorf("--snowflake-epoch %v is in the future", c.SnowflakeSettings.Epoch)
	}
	return nil
}

// storeFlags are the flags that select the store of admin commands.
type storeFlags struct {
	postgresURL   string
	natsURL       string
	bucket        string
	witnessBucket string
	conn          serveConfig // NATS security flags
}

func addStoreFlags(fs *flag.FlagSet) *storeFlags {
	f := &storeFlags{}
	fs.StringVar(&f.postgresURL, "postgres-url", "", "PostgreSQL URL of the segment store")
	fs.StringVar(&f.natsURL, "nats-url", "", "NATS URL, for the JetStream KV segment store (when --postgres-url is empty); with --postgres-url, tags list shows the witness marks")
	fs.StringVar(&f.bucket, "segment-bucket", kv.DefaultBucket, "JetStream KV bucket of the segment store")
	fs.StringVar(&f.witnessBucket, "witness-bucket", witness.DefaultBucket, "JetStream KV bucket of the witness marks (with --postgres-url and --nats-url)")
	fs.StringVar(&f.conn.NATSCreds, "nats-creds", "", "NATS credentials file")
	fs.StringVar(&f.conn.NATSNKey, "nats-nkey", "", "NATS NKey seed file")
	fs.StringVar(&f.conn.NATSTLSCA, "nats-tls-ca", "", "CA certificate file to verify the NATS server")
	fs.StringVar(&f.conn.NATSTLSCert, "nats-tls-cert", "", "client certificate file for NATS TLS")
	fs.StringVar(&f.conn.NATSTLSKey, "nats-tls-key", "", "client key file for NATS TLS")
	return f
}

// adminStore is a store that tags commands can read and change.
type adminStore interface {
	segment.Store
	segment.Admin
}

// marker reads the witness marks of tags.
type marker interface {
	Mark(ctx context.Context, tag string) (mark int64, ok bool, err error)
}

// open opens the selected store, and with PostgreSQL and --nats-url the
// witness (w, else nil); close releases them.
func (f *storeFlags) open(ctx context.Context) (st adminStore, w marker, close func(), err error) {
	if f.postgresURL != "" {
		pool, err := openPostgres(ctx, f.postgresURL)
		if err != nil {
			return nil, nil, nil, err
		}
		pg := postgres.New(pool)
		if f.natsURL == "" {
			return pg, nil, pool.Close, nil
		}
		nc, js, err := f.connect()
		if err != nil {
			pool.Close()
			return nil, nil, nil, err
		}
		kvb, err := js.KeyValue(ctx, f.witnessBucket)
		if err != nil {
			nc.Close()
			pool.Close()
			return nil, nil, nil, fmt.Errorf("witness bucket %q: %w", f.witnessBucket, err)
		}
		return pg, witness.New(kvb, pg, witness.Settings{}), func() { nc.Close(); pool.Close() }, nil
	}
	if f.natsURL == "" {
		return nil, nil, nil, errors.New("set --postgres-url (PostgreSQL store) or --nats-url (JetStream KV store)")
	}
	nc, js, err := f.connect()
	if err != nil {
		return nil, nil, nil, err
	}
	if st, err = kv.New(ctx, js, kv.Settings{Bucket: f.bucket}); err != nil {
		nc.Close()
		return nil, nil, nil, err
	}
	return st, nil, nc.Close, nil
}

// connect connects to --nats-url.
func (f *storeFlags) connect() (*nats.Conn, jetstream.JetStream, error) {
	opts, err := f.conn.natsOptions(f.conn.NATSCreds, f.conn.NATSNKey)
	if err != nil {
		return nil, nil, err
	}
	nc, err := nats.Connect(f.natsURL, append(opts, nats.Name("dispenser-admin"))...)
	if err != nil {
		return nil, nil, fmt.Errorf("connecting to nats at %s: %w", f.natsURL, err)
	}
	js, err := jetstream.New(nc)
	if err != nil {
		nc.Close()
		return nil, nil, err
	}
	return nc, js, nil
}

// openPostgres connects to url and checks that the server answers.
func openPostgres(ctx context.Context, url string) (*pgxpool.Pool, error) {
	if url == "" {
		return nil, errors.New("set --postgres-url (env DISPENSER_POSTGRES_URL)")
	}
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		return nil, fmt.Errorf("postgres: %w", err)
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		return nil, fmt.Errorf("postgres: %w", err)
	}
	return pool, nil
}

func migrate(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("migrate", "dispenser migrate [--postgres-url URL]", stderr)
	url := fs.String("postgres-url", "", "PostgreSQL URL of the segment store")
	if _, err := parse(fs, args); err != nil {
		return err
	}
	pool, err := openPostgres(ctx, *url)
	if err != nil {
		return err
	}
	defer pool.Close()
	applied, err := schema.Migrate(ctx, pool)
	if err != nil {
		return err
	}
	if len(applied) == 0 {
		fmt.Fprintln(stdout, "schema is up to date")
	}
	for _, v := range applied {
		fmt.Fprintln(stdout, "applied", v)
	}
	return nil
}

const tagsUsage = `dispenser tags list [store flags]
dispenser tags create TAG --step N [--start M] [--description D] [--ordered] [store flags]
dispenser tags update TAG [--step N] [--description D] [--ordered=true|false] [store flags]
store flags: --postgres-url URL, or --nats-url URL [--segment-bucket B] for the JetStream KV store`

func tags(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) > 0 && (args[0] == "--help" || args[0] == "-h" || args[0] == "help") {
		fmt.Fprintln(stdout, "usage:\n"+tagsUsage)
		return nil
	}
	if len(args) == 0 {
		fmt.Fprintln(stderr, "usage:\n"+tagsUsage)
		return errors.New("tags: missing subcommand")
	}
	sub, args := args[0], args[1:]
	fs := newFlagSet("tags "+sub, tagsUsage, stderr)
	sf := addStoreFlags(fs)
	var step, start int64
	var desc string
	var ordered bool
	switch sub {
	case "list":
	case "create":
		fs.Int64Var(&step, "step", 0, "IDs per segment (required)")
		fs.Int64Var(&start, "start", 1, "first ID of the tag")
		fs.StringVar(&desc, "description", "", "free text, at most 256 characters")
		fs.BoolVar(&ordered, "ordered", false, "an ordered tag: its IDs increase across all workers, not only within each")
	case "update":
		fs.Int64Var(&step, "step", 0, "new step (0 leaves it)")
		fs.StringVar(&desc, "description", "", "new description")
		fs.BoolVar(&ordered, "ordered", false, "--ordered=true makes the tag ordered (IDs increase across all workers), --ordered=false plain")
	default:
		fmt.Fprintln(stderr, "usage:\n"+tagsUsage)
		return fmt.Errorf("tags: unknown subcommand %q", sub)
	}
	pos, err := parse(fs, args)
	if err != nil {
		return err
	}
	wantArgs := 1
	if sub == "list" {
		wantArgs = 0
	}
	if len(pos) != wantArgs {
		if sub != "list" && slices.ContainsFunc(pos[1:], func(a string) bool { _, err := strconv.ParseBool(a); return err == nil }) {
			// "--ordered false" sets the flag and leaves "false" behind.
			return fmt.Errorf("tags %s: want 1 argument, got %d: write a boolean flag with =, e.g. --ordered=false\nusage:\n%s", sub, len(pos), tagsUsage)
		}
		return fmt.Errorf("tags %s: want %d argument(s), got %d\nusage:\n%s", sub, wantArgs, len(pos), tagsUsage)
	}
	given := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { given[f.Name] = true })
	st, marks, closeStore, err := sf.open(ctx)
	if err != nil {
		return err
	}
	defer closeStore()

	switch sub {
	case "list":
		return listTags(ctx, st, marks, stdout)
	case "create":
		if !given["step"] {
			return errors.New("tags create: --step is required")
		}
		if err := st.CreateTag(ctx, segment.Tag{Name: pos[0], Step: step, MaxID: start, Description: desc, Ordered: ordered}); err != nil {
			return err
		}
		fmt.Fprintf(stdout, "created tag %s: first ID %d, step %d, ordered %s\n", pos[0], start, step, yesNo(ordered))
		return nil
	default: // update
		var u segment.TagUpdate
		var changes []string
		if given["step"] {
			u.Step = &step
			changes = append(changes, fmt.Sprintf("step %d", step))
		}
		if given["description"] {
			u.Description = &desc
			changes = append(changes, fmt.Sprintf("description %q", desc))
		}
		if given["ordered"] {
			u.Ordered = &ordered
			changes = append(changes, "ordered "+yesNo(ordered))
		}
		if len(changes) == 0 {
			return errors.New("tags update: nothing to change: give --step, --description and/or --ordered=true|false")
		}
		if err := st.UpdateTag(ctx, pos[0], u); err != nil {
			return err
		}
		fmt.Fprintf(stdout, "updated tag %s: %s\n", pos[0], strings.Join(changes, ", "))
		return nil
	}
}

// listTags prints the tags; with marks, a WITNESS column shows a tag's
// witness mark where it differs from the next ID (the store lost writes, or
// a fetch is in flight), "none" where the tag has no mark yet. ORDERED is
// yes for an ordered tag, no for a plain one.
func listTags(ctx context.Context, st segment.Store, marks marker, stdout io.Writer) error {
	names, err := st.Tags(ctx)
	if err != nil {
		return err
	}
	w := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	if marks != nil {
		fmt.Fprintln(w, "TAG\tNEXT ID\tWITNESS\tSTEP\tORDERED\tUPDATED\tDESCRIPTION")
	} else {
		fmt.Fprintln(w, "TAG\tNEXT ID\tSTEP\tORDERED\tUPDATED\tDESCRIPTION")
	}
	for _, name := range names {
		t, err := st.Tag(ctx, name)
		if errors.Is(err, segment.ErrUnknownTag) {
			continue // removed meanwhile
		}
		if err != nil {
			return err
		}
		fmt.Fprintf(w, "%s\t%d\t", t.Name, t.MaxID)
		if marks != nil {
			m, ok, err := marks.Mark(ctx, name)
			switch {
			case err != nil:
				return err
			case !ok:
				fmt.Fprint(w, "none")
			case m != t.MaxID:
				fmt.Fprint(w, m)
			}
			fmt.Fprint(w, "\t")
		}
		fmt.Fprintf(w, "%d\t%s\t%s\t%s\n", t.Step, yesNo(t.Ordered), t.UpdateTime.UTC().Format(time.RFC3339), t.Description)
	}
	return w.Flush()
}

// yesNo shows a flag in tags' output.
func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "no"
}

func decode(args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("decode", "dispenser decode ID [--snowflake-epoch T]", stderr)
	epoch := fs.String("snowflake-epoch", snowflake.DefaultEpoch.Format(time.RFC3339), "epoch of snowflake timestamps (RFC 3339)")
	pos, err := parse(fs, args)
	if err != nil {
		return err
	}
	if len(pos) != 1 {
		return errors.New("decode: want one snowflake ID")
	}
	e, err := time.Parse(time.RFC3339, *epoch)
	if err != nil {
		return fmt.Errorf("--snowflake-epoch %q: %w", *epoch, err)
	}
	id, err := strconv.ParseInt(pos[0], 10, 64)
	if err != nil || id < 0 {
		return fmt.Errorf("decode: %q is not a snowflake ID (a non-negative decimal int64)", pos[0])
	}
	out, err := json.Marshal(snowflake.Decode(id, e))
	if err != nil {
		return err
	}
	fmt.Fprintln(stdout, string(out))
	return nil
}
