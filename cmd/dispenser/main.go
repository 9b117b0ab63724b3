// Command dispenser serves unique 64-bit IDs over NATS and administers
// its store. Run `dispenser help` for the commands.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"slices"
	"syscall"
	// The IANA time zone database, so that tags with a reset period in a
	// named zone work where the system has none (a static container image).
	_ "time/tzdata"

	"github.com/dispenser-dev/dispenser/bench"
	"github.com/dispenser-dev/dispenser/internal/buildinfo"
	"github.com/dispenser-dev/dispenser/protocol"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	err := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	if errors.Is(err, flag.ErrHelp) {
		os.Exit(0)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "dispenser:", protocol.Describe(err))
		os.Exit(1)
	}
}

const usage = `dispenser hands out unique 64-bit IDs over NATS.

usage:
  dispenser [serve] [flags]          run a worker (the default command); with no
                                     flags: embedded NATS, segments in JetStream KV
  dispenser migrate [flags]          apply the database migrations
  dispenser tags list [flags]        list tags
  dispenser tags create TAG --step N [--start M] [--description D] [--ordered]
                                     [--reset day|month|year --time-zone Z --format T]
  dispenser tags update TAG [--step N] [--description D] [...]
  dispenser decode ID                print a snowflake ID's time, worker and sequence
  dispenser bench [flags]            measure throughput and latency against a baseline
  dispenser version                  print the version and the VCS revision built from
                                     (also --version)
  dispenser help [command]           show a command's flags

serve's flags can also be set with environment variables (--nats-url is
DISPENSER_NATS_URL), and so can the NATS connection, store, bucket and
region flags of the other commands; a command's own settings (--step,
--ordered, --format, …) cannot. Run "dispenser COMMAND --help" for a
command's flags and their variables.
`

// run runs the command line args.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	cmd := "serve"
	if len(args) > 0 && (args[0] == "--version" || args[0] == "-version") {
		args[0] = "version"
	}
	if len(args) > 0 && len(args[0]) > 0 && args[0][0] != '-' {
		cmd, args = args[0], args[1:]
	}
	switch cmd {
	case "serve":
		if slices.ContainsFunc(args, func(a string) bool { return a == "-h" || a == "--help" || a == "-help" }) {
			fmt.Fprint(stderr, usage+"\n") // the commands, then serve's flags
		}
		return serve(ctx, args, stderr)
	case "version":
		return version(stdout)
	case "migrate":
		return migrate(ctx, args, stdout, stderr)
	case "tags":
		return tags(ctx, args, stdout, stderr)
	case "decode":
		return decode(args, stdout, stderr)
	case "bench":
		return runBench(ctx, args, stdout, stderr)
	case bench.LoadCommand: // hidden: bench's load generator process
		return benchLoad(ctx, args, stdout, stderr)
	case "help", "-h", "--help":
		if len(args) > 0 {
			return run(ctx, []string{args[0], "--help"}, stdout, stderr)
		}
		fmt.Fprint(stdout, usage)
		return nil
	default:
		return fmt.Errorf("unknown command %q\nrun 'dispenser help' for the commands", cmd)
	}
}

// version prints the binary's version (package internal/buildinfo: the
// one the micro service reports and the status page shows), the Go
// version and the VCS revision built from, as the Go toolchain recorded it.
func version(w io.Writer) error {
	bi := buildinfo.Get()
	fmt.Fprintf(w, "dispenser %s %s", bi.Version, bi.GoVersion)
	if bi.Revision != "" {
		fmt.Fprintf(w, " revision %s", bi.Revision)
		if bi.Time != "" {
			fmt.Fprintf(w, " (%s)", bi.Time)
		}
		if bi.Modified {
			fmt.Fprint(w, " modified")
		}
	}
	fmt.Fprintln(w)
	return nil
}

// newLogger returns the process logger for --log-level and --log-format.
func newLogger(w io.Writer, level, format string) (*slog.Logger, error) {
	var l slog.Level
	if err := l.UnmarshalText([]byte(level)); err != nil {
		return nil, fmt.Errorf("--log-level %q: want debug, info, warn or error", level)
	}
	opts := &slog.HandlerOptions{Level: l}
	switch format {
	case "text":
		return slog.New(slog.NewTextHandler(w, opts)), nil
	case "json":
		// A duration as the text handler writes it ("312ms"), not as
		// nanoseconds without a unit (slog's JSON default).
		opts.ReplaceAttr = func(_ []string, a slog.Attr) slog.Attr {
			if a.Value.Kind() == slog.KindDuration {
				a.Value = slog.StringValue(a.Value.Duration().String())
			}
			return a
		}
		return slog.New(slog.NewJSONHandler(w, opts)), nil
	}
	return nil, fmt.Errorf("--log-format %q: want text or json", format)
}
