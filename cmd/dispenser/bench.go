package main

import (
	"context"
	"io"

	"github.com/dispenser-dev/dispenser/bench"
)

// `dispenser bench` and its hidden load generator command: the flags are
// defined and checked by package bench (bench.Flags, bench.LoadFlags),
// the harness, which starts the workers of its local set-up with package
// worker, as serve does; parsed here, as every command's.

// benchChildEnv marks the processes that `dispenser bench` starts from
// os.Executable(); a test binary's TestMain runs their command line
// instead of the tests.
const benchChildEnv = bench.ChildEnv

func runBench(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("bench", "dispenser bench [flags]", stderr)
	run := bench.Flags(fs)
	pos, err := parse(fs, args)
	if err != nil {
		return err
	}
	return run(ctx, pos, stdout, stderr)
}

// benchLoad is the hidden `dispenser bench-load` (bench.LoadCommand): one
// load run, its results as a JSON array on stdout, one per --subject, and
// progress lines on stderr.
func benchLoad(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet(bench.LoadCommand, bench.LoadSynopsis, stderr)
	run := bench.LoadFlags(fs)
	pos, err := parse(fs, args)
	if err != nil {
		return err
	}
	return run(ctx, pos, stdout, stderr)
}
