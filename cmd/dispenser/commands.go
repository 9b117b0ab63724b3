package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/dispenser-dev/dispenser/schema"
	"github.com/dispenser-dev/dispenser/segment"
	"github.com/dispenser-dev/dispenser/segment/postgres"
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
	fs.StringVar(&c.NATSTLSCA, "nats-tls-ca", "", "CA certificate file to verify the NATS server")
	fs.StringVar(&c.NATSTLSCert, "nats-tls-cert", "", "client certificate file for NATS TLS")
	fs.StringVar(&c.NATSTLSKey, "nats-tls-key", "", "client key file for NATS TLS")
	fs.StringVar(&c.MetricsAddr, "metrics-addr", "", "address for /metrics, /healthz and /readyz (off when empty), e.g. 127.0.0.1:9090")
	fs.StringVar(&c.PostgresURL, "postgres-url", "", "PostgreSQL URL of the segment store (table leaf_alloc)")
	fs.BoolVar(&c.Migrate, "migrate", false, "apply the database migrations before serving")
	fs.StringVar(&c.Prefix, "prefix", "id", "subject prefix: endpoints are PREFIX.segment.<tag> and PREFIX.snowflake")
	fs.StringVar(&c.QueueGroup, "queue-group", "dispenser", "queue group of the endpoints; workers in one group share the load")
	fs.IntVar(&c.MaxBatch, "max-batch", 10000, "most IDs one request may ask for")
	fs.DurationVar(&c.Segment.MaxWait, "max-wait", 100*time.Millisecond, "how long a request waits for a segment when both buffers are empty, before 503")
	fs.Float64Var(&c.Segment.PrefetchRatio, "prefetch-ratio", 0.1, "fetch the next segment once this fraction of the current one is used")
	fs.DurationVar(&c.Segment.FetchTimeout, "fetch-timeout", 2*time.Second, "timeout of one store call")
	fs.DurationVar(&c.Segment.RefreshInterval, "refresh-interval", time.Minute, "how often the tag list is reloaded")
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
	return NewServer(c, log).Run(ctx)
}

// storeFlags adds the flags that select the store of admin commands.
func storeFlags(fs *flag.FlagSet) *string {
	return fs.String("postgres-url", "", "PostgreSQL URL of the segment store")
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
	url := storeFlags(fs)
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

const tagsUsage = `dispenser tags list
dispenser tags create TAG --step N [--start M] [--description D]
dispenser tags update TAG [--step N] [--description D]`

func tags(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) == 0 {
		fmt.Fprintln(stderr, "usage:\n"+tagsUsage)
		return errors.New("tags: missing subcommand")
	}
	sub, args := args[0], args[1:]
	fs := newFlagSet("tags "+sub, tagsUsage, stderr)
	url := storeFlags(fs)
	var step, start int64
	var desc string
	switch sub {
	case "list":
	case "create":
		fs.Int64Var(&step, "step", 0, "IDs per segment (required)")
		fs.Int64Var(&start, "start", 1, "first ID of the tag")
		fs.StringVar(&desc, "description", "", "free text, at most 256 characters")
	case "update":
		fs.Int64Var(&step, "step", 0, "new step (0 leaves it)")
		fs.StringVar(&desc, "description", "", "new description")
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
		return fmt.Errorf("tags %s: want %d argument(s), got %d\nusage:\n%s", sub, wantArgs, len(pos), tagsUsage)
	}
	given := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { given[f.Name] = true })
	pool, err := openPostgres(ctx, *url)
	if err != nil {
		return err
	}
	defer pool.Close()
	st := postgres.New(pool)

	switch sub {
	case "list":
		return listTags(ctx, st, stdout)
	case "create":
		if !given["step"] {
			return errors.New("tags create: --step is required")
		}
		if err := st.CreateTag(ctx, pos[0], step, start, desc); err != nil {
			return err
		}
		fmt.Fprintf(stdout, "created tag %s: first ID %d, step %d\n", pos[0], start, step)
		return nil
	default: // update
		var sp *int64
		var dp *string
		if given["step"] {
			sp = &step
		}
		if given["description"] {
			dp = &desc
		}
		if sp == nil && dp == nil {
			return errors.New("tags update: nothing to change: give --step and/or --description")
		}
		if err := st.UpdateTag(ctx, pos[0], sp, dp); err != nil {
			return err
		}
		fmt.Fprintf(stdout, "updated tag %s\n", pos[0])
		return nil
	}
}

func listTags(ctx context.Context, st segment.Store, stdout io.Writer) error {
	names, err := st.Tags(ctx)
	if err != nil {
		return err
	}
	w := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(w, "TAG\tNEXT ID\tSTEP\tUPDATED\tDESCRIPTION")
	for _, name := range names {
		t, err := st.Tag(ctx, name)
		if errors.Is(err, segment.ErrUnknownTag) {
			continue // removed meanwhile
		}
		if err != nil {
			return err
		}
		fmt.Fprintf(w, "%s\t%d\t%d\t%s\t%s\n", t.Name, t.MaxID, t.Step, t.UpdateTime.UTC().Format(time.RFC3339), t.Description)
	}
	return w.Flush()
}
