package main

import (
	"errors"
	"flag"
	"runtime"
	"strings"
	"testing"
)

// TestVersion: `dispenser version` prints the module's version and the Go
// version (and, in a binary built in a checkout, the VCS revision).
func TestVersion(t *testing.T) {
	out, err := runCmd(t, "version")
	if err != nil {
		t.Fatalf("version: %v", err)
	}
	if !strings.HasPrefix(out, "dispenser ") || !strings.Contains(out, runtime.Version()) {
		t.Errorf("version printed %q, want dispenser, a version and %s", out, runtime.Version())
	}
}

// TestHelpListsCommands: `dispenser --help` shows the commands, then
// serve's flags, each default once.
func TestHelpListsCommands(t *testing.T) {
	out, err := runCmd(t, "--help")
	if err != nil && !errors.Is(err, flag.ErrHelp) {
		t.Fatalf("--help: %v", err)
	}
	for _, want := range []string{"dispenser migrate", "dispenser tags create", "dispenser version", "--nats-url", "--snowflake-heartbeat"} {
		if !strings.Contains(out, want) {
			t.Errorf("--help lacks %q:\n%s", want, out)
		}
	}
	if strings.Contains(out, "(default 0s)") {
		t.Errorf("--help shows a zero duration as a default:\n%s", out)
	}
}
