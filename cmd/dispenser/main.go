// Command dispenser serves unique 64-bit IDs over NATS and administers
// its store. Run `dispenser help` for the commands.
package main

import (
	"cmp"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"runtime/debug"
	"slices"
	"syscall"
	// The IANA time zone database, so that tags with a reset period in a
	// named zone work where the system has none (a static container image).
	_ "time/tzdata"

	"github.com/dispenser-dev/dispenser/internal/bench"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	err := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	if errors.Is(err, flag.ErrHelp) {
		os.Exit(0)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "dispenser:", err)
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
  dispenser help [command]           show a command's flags

Every flag can also be set with an environment variable: --nats-url is
DISPENSER_NATS_URL. Run "dispenser COMMAND --help" for a command's flags.
`

// run runs the command line args.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	cmd := "serve"
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
		fmt.Fprint(stderr, usage)
		return fmt.Errorf("unknown command %q", cmd)
	}
}

// version prints the module's version and the VCS revision the binary
// was built from, as the Go toolchain recorded them.
func version(w io.Writer) error {
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return errors.New("version: the binary carries no build information")
	}
	settings := map[string]string{}
	for _, s := range bi.Settings {
		settings[s.Key] = s.Value
	}
	fmt.Fprintf(w, "dispenser %s %s", cmp.Or(bi.Main.Version, "(devel)"), bi.GoVersion)
	if rev := settings["vcs.revision"]; rev != "" {
		fmt.Fprintf(w, " revision %s", rev)
		if t := settings["vcs.time"]; t != "" {
			fmt.Fprintf(w, " (%s)", t)
		}
		if settings["vcs.modified"] == "true" {
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
		return slog.New(slog.NewJSONHandler(w, opts)), nil
	}
	return nil, fmt.Errorf("--log-format %q: want text or json", format)
}
