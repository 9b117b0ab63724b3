package bench

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"runtime/pprof"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
)

// args returns the command line of a child that runs c: LoadCommand, the
// flags that AddFlags defines, and ChildArgs.
func (c LoadConfig) args() []string {
	a := []string{LoadCommand,
		"--nats-url", c.URL,
		"--inflight", strconv.Itoa(c.Inflight),
		"--batch", strconv.Itoa(c.Batch),
		"--format", c.Format,
		"--warmup", c.Warmup.String(),
		"--duration", c.Duration.String(),
		"--slice", c.Slice.String(),
		"--drain", c.Drain.String(),
	}
	for _, s := range c.Subjects {
		a = append(a, "--subject", s)
	}
	if c.Verify {
		a = append(a, "--verify")
	}
	if c.CPUProfile != "" {
		a = append(a, "--cpuprofile", c.CPUProfile)
	}
	return append(a, c.ChildArgs...)
}

// LoadCommand is the program's hidden command that runs a load generator
// child: it defines its flags with LoadConfig.AddFlags, sets NATSOptions
// from the flags in ChildArgs and calls ServeLoad.
const LoadCommand = "bench-load"

// AddFlags defines on fs the flags of a load child, which args writes: all
// of c but NATSOptions and ChildArgs, whose flags are the program's.
func (c *LoadConfig) AddFlags(fs *flag.FlagSet) {
	fs.StringVar(&c.URL, "nats-url", nats.DefaultURL, "NATS server URL(s)")
	fs.Func("subject", "subject to request IDs from; repeat it to load several in turn", func(s string) error {
		if s = strings.TrimSpace(s); s == "" {
			return errors.New("empty subject")
		}
		c.Subjects = append(c.Subjects, s)
		return nil
	})
	fs.IntVar(&c.Inflight, "inflight", 256, "requests in flight")
	fs.IntVar(&c.Batch, "batch", 1, "IDs per request")
	fs.StringVar(&c.Format, "format", "list", "Id-Format: list or range")
	fs.DurationVar(&c.Warmup, "warmup", 500*time.Millisecond, "warm-up per subject")
	fs.DurationVar(&c.Duration, "duration", 3*time.Second, "measured time per subject")
	fs.DurationVar(&c.Slice, "slice", 250*time.Millisecond, "how long one subject is loaded before the next")
	fs.DurationVar(&c.Drain, "drain", 2*time.Second, "how long to wait for the replies still out")
	fs.BoolVar(&c.Verify, "verify", false, "parse every ID and count duplicates")
	fs.StringVar(&c.CPUProfile, "cpuprofile", "", "write a CPU profile of the load generator to this file")
}

// ServeLoad is a load child's side of the protocol: it runs c, writing
// progress lines to stderr, then writes the results to stdout as a JSON
// array, one per subject.
func ServeLoad(ctx context.Context, c LoadConfig, stdout, stderr io.Writer) error {
	if c.CPUProfile != "" {
		f, err := os.Create(c.CPUProfile)
		if err != nil {
			return fmt.Errorf("load: CPU profile: %w", err)
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return fmt.Errorf("load: CPU profile: %w", err)
		}
		defer pprof.StopCPUProfile()
	}
	r, err := RunLoad(ctx, c, stderr)
	if err != nil {
		return err
	}
	if err := json.NewEncoder(stdout).Encode(r); err != nil {
		return fmt.Errorf("load: writing the results: %w", err)
	}
	return nil
}
