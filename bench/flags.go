package bench

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"slices"
	"strings"
	"time"

	"github.com/dispenser-dev/dispenser/tagmodel"
	"github.com/dispenser-dev/dispenser/worker"
)

// Main runs a command whose flags are parsed, with pos its positional
// arguments.
type Main func(ctx context.Context, pos []string, stdout, stderr io.Writer) error

// Flags defines the flags of `dispenser bench` on fs and returns what runs
// it once the program has parsed them (and filled what its environment
// variables give): it checks them into a Config and calls Run.
func Flags(fs *flag.FlagSet) Main {
	var c Config
	var conn worker.NATS
	var formats, modes string
	conn.AddFlags(fs, "NATS server URL(s) of a running deployment to load, starting nothing; empty starts an embedded nats-server, a baseline responder and the service under test in this process", false)
	fs.StringVar(&c.Prefix, "prefix", "id", "subject prefix of the service (with --nats-url)")
	fs.StringVar(&c.Tag, "tag", "bench", "segment tag to load; with --nats-url it must exist")
	fs.StringVar(&c.PostgresURL, "postgres-url", "", "PostgreSQL segment store of the service under test; empty: a JetStream key-value bucket in the embedded nats-server. bench creates or updates the tags TAG, bench_step100 and bench_step1m")
	fs.DurationVar(&c.Warmup, "warmup", 500*time.Millisecond, "warm-up per endpoint and run, not measured")
	fs.DurationVar(&c.Duration, "duration", 3*time.Second, "measured time per endpoint and run; the endpoints of a run are loaded in turn, 250ms each")
	fs.IntVar(&c.Inflight, "inflight", 256, "requests in flight in the pipelined, batch and step runs")
	fs.IntVar(&c.Batch, "batch", 1000, "IDs per request in the batch runs")
	fs.StringVar(&formats, "format", "range,list", "Id-Format of the batch runs: range, list or both, comma-separated")
	fs.StringVar(&modes, "modes", strings.Join(Modes, ","), "what to measure, comma-separated: "+strings.Join(Modes, ", "))
	fs.IntVar(&c.ClientRounds, "client-rounds", 5, "client run: rounds of a raw request and the Go client to a bare responder and the Go client to the service, loaded in turn (--inflight callers each)")
	fs.IntVar(&c.MemoryTags, "memory-tags", 1000, "warm tags of the idle worker whose memory is measured")
	fs.IntVar(&c.Tags, "tags", 20_000, "tags run: new tags asked for their first ID, then warm in its worker (KV: created on first use)")
	fs.IntVar(&c.TagsStore, "tags-store", 1_000_000, "tags run with --postgres-url: tags in the PostgreSQL store, created in bulk where missing (at least --tags)")
	fs.DurationVar(&c.TagsSettle, "tags-settle", 0, "tags run: wait up to this long for the idle worker to settle (two garbage collections, then RSS falling by less than 1% over three minutes) before measuring its memory with warm tags; 0: measure at once")
	fs.BoolVar(&c.JSON, "json", false, "print the report as JSON")
	fs.BoolVar(&c.Smoke, "smoke", false, "a few seconds of every run, checking every ID; fails on errors or duplicates, never on speed")
	fs.BoolVar(&c.SyncAlways, "sync-always", true, "the embedded nats-server writes every JetStream message to disk before acknowledging it, as dispenser serve's does; false measures JetStream's default periodic sync for comparison")
	fs.StringVar(&c.CPUProfile, "cpuprofile", "", "write a CPU profile of this process (service, nats-server, baseline) during the runs to this file, and one of each load generator (the clients) to this file with .load-N appended")
	return func(ctx context.Context, pos []string, stdout, stderr io.Writer) error {
		if len(pos) > 0 {
			return fmt.Errorf("bench: unexpected argument %q", pos[0])
		}
		resolved, err := conn.Resolve() // the context may give the URL
		if err != nil {
			return fmt.Errorf("bench: %w", err)
		}
		c.URL = resolved.URL
		set := map[string]bool{}
		fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
		if c.Smoke {
			if !set["warmup"] {
				c.Warmup = 100 * time.Millisecond
			}
			if !set["duration"] {
				c.Duration = 300 * time.Millisecond
			}
			if !set["client-rounds"] {
				c.ClientRounds = 2
			}
			if !set["memory-tags"] {
				c.MemoryTags = 50
			}
			if !set["tags"] {
				c.Tags = 200
			}
			if !set["tags-store"] {
				c.TagsStore = 1000
			}
		}
		c.Modes = map[string]bool{}
		for m := range strings.SplitSeq(modes, ",") {
			if m = strings.TrimSpace(m); !slices.Contains(Modes, m) {
				return fmt.Errorf("bench: --modes: unknown mode %q: want %s", m, strings.Join(Modes, ", "))
			}
			c.Modes[m] = true
		}
		for f := range strings.SplitSeq(formats, ",") {
			if f = strings.TrimSpace(f); f != "range" && f != "list" {
				return fmt.Errorf("bench: --format %q: want range, list or both", f)
			}
			if !slices.Contains(c.Formats, f) {
				c.Formats = append(c.Formats, f)
			}
		}
		switch {
		case c.Inflight < 1 || c.Inflight > 100_000:
			return fmt.Errorf("bench: --inflight %d: want 1..100000", c.Inflight)
		case c.Batch < 1 || c.Batch > 10_000:
			return fmt.Errorf("bench: --batch %d: want 1..10000 (the service's default --max-batch)", c.Batch)
		case c.Warmup < 0 || c.Duration <= 0:
			return fmt.Errorf("bench: --warmup %v, --duration %v: want a positive duration", c.Warmup, c.Duration)
		case c.ClientRounds < 1 || c.ClientRounds > 100:
			return fmt.Errorf("bench: --client-rounds %d: want 1..100", c.ClientRounds)
		case c.MemoryTags < 1 || c.MemoryTags > 10_000:
			return fmt.Errorf("bench: --memory-tags %d: want 1..10000", c.MemoryTags)
		case c.Tags < 4 || c.Tags > 1_000_000:
			return fmt.Errorf("bench: --tags %d: want 4..1000000", c.Tags)
		case c.TagsSettle < 0 || c.TagsSettle > 10*time.Minute:
			return fmt.Errorf("bench: --tags-settle %v: want 0..10m", c.TagsSettle)
		case c.TagsStore > 10_000_000:
			return fmt.Errorf("bench: --tags-store %d: want at most 10000000", c.TagsStore)
		}
		c.TagsStore = max(c.TagsStore, c.Tags)
		if !tagmodel.ValidTag(c.Tag) {
			return fmt.Errorf("bench: --tag %q: want 1-128 characters of [A-Za-z0-9_-]", c.Tag)
		}
		if c.URL != "" && c.PostgresURL != "" {
			return errors.New("bench: --postgres-url configures the local service; it does nothing with --nats-url")
		}
		if c.NATSOptions, err = conn.Options(false); err != nil {
			return fmt.Errorf("bench: %w", err)
		}
		c.ChildArgs = conn.Args()
		return Run(ctx, c, stdout, stderr)
	}
}

// LoadSynopsis is the usage line of LoadCommand.
const LoadSynopsis = "dispenser " + LoadCommand + " --subject SUBJECT... [flags]"

// LoadFlags defines the flags of the hidden LoadCommand on fs and returns
// what runs it once they are parsed: one load run, its results as a JSON
// array on stdout, one per --subject, and progress lines on stderr.
func LoadFlags(fs *flag.FlagSet) Main {
	var c LoadConfig
	var conn worker.NATS
	c.AddFlags(fs)
	conn.AddFlags(fs, "", false)
	return func(ctx context.Context, pos []string, stdout, stderr io.Writer) error {
		if len(pos) > 0 || len(c.Subjects) == 0 {
			return errors.New(LoadCommand + ": want --subject and no arguments")
		}
		var err error
		if c.NATSOptions, err = conn.Options(false); err != nil {
			return fmt.Errorf("%s: %w", LoadCommand, err)
		}
		return ServeLoad(ctx, c, stdout, stderr)
	}
}
