package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"

	"github.com/dispenser-dev/dispenser/worker"
)

// natscliVersion is the NATS CLI (github.com/nats-io/natscli) the README's
// `nats …` examples are run with: the tool a reader types them into.
const natscliVersion = "v0.5.0"

var (
	binOnce sync.Once
	binPath string
	binErr  error
	binDir  string // removed by testMain
)

// dispenserBinary builds ./cmd/dispenser once per test binary with `go
// build`, as `go run ./cmd/dispenser` and the Dockerfile's build do (so
// the binary carries the module version and VCS revision the toolchain
// stamps), and returns its path.
func dispenserBinary(tb testing.TB) string {
	tb.Helper()
	binOnce.Do(func() {
		if binDir, binErr = os.MkdirTemp("", "dispenser-bin-"); binErr != nil {
			return
		}
		binPath = filepath.Join(binDir, "dispenser")
		out, err := exec.Command("go", "build", "-buildvcs=auto", "-o", binPath, ".").CombinedOutput()
		if err != nil {
			binErr = fmt.Errorf("go build: %v\n%s", err, out)
		}
	})
	if binErr != nil {
		tb.Fatal(binErr)
	}
	return binPath
}

var (
	natsOnce sync.Once
	natsPath string
	natsErr  error
)

// natsCLI returns the path of the NATS CLI at natscliVersion, installed
// with `go install` (from the Go module proxy, once per machine) into the
// user's cache directory.
func natsCLI(tb testing.TB) string {
	tb.Helper()
	natsOnce.Do(func() {
		cache, err := os.UserCacheDir()
		if err != nil {
			natsErr = err
			return
		}
		dir := filepath.Join(cache, "dispenser-test-tools", "natscli-"+natscliVersion)
		natsPath = filepath.Join(dir, "nats")
		if _, err := os.Stat(natsPath); err == nil {
			return
		}
		cmd := exec.Command("go", "install", "github.com/nats-io/natscli/nats@"+natscliVersion)
		cmd.Env = append(os.Environ(), "GOBIN="+dir, "GOFLAGS=")
		if out, err := cmd.CombinedOutput(); err != nil {
			natsErr = fmt.Errorf("installing the NATS CLI (go install github.com/nats-io/natscli/nats@%s, needs the Go module proxy once): %v\n%s",
				natscliVersion, err, out)
		}
	})
	if natsErr != nil {
		tb.Fatal(natsErr)
	}
	return natsPath
}

// process is a dispenser binary running until the test ends.
type process struct {
	cmd  *exec.Cmd
	logs *syncBuffer
	done chan error
}

// startBinary starts the dispenser binary with args in dir and stops it
// with SIGTERM when the test ends, failing the test if it then exits with
// an error.
func startBinary(t *testing.T, dir string, args ...string) *process {
	t.Helper()
	p := &process{cmd: exec.Command(dispenserBinary(t), args...), logs: &syncBuffer{}, done: make(chan error, 1)}
	p.cmd.Dir = dir
	p.cmd.Stdout, p.cmd.Stderr = p.logs, p.logs
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { p.done <- p.cmd.Wait() }()
	t.Cleanup(func() {
		_ = p.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case err := <-p.done:
			if err != nil {
				t.Errorf("dispenser %v: %v; logs:\n%s", args, err, p.logs.String())
			}
		case <-time.After(30 * time.Second):
			_ = p.cmd.Process.Kill()
			t.Errorf("dispenser %v did not stop within 30 s of SIGTERM; logs:\n%s", args, p.logs.String())
		}
	})
	return p
}

// serviceInfo waits until a dispenser worker on the NATS server at url
// has registered its micro service with every endpoint in want, and
// returns the service's $SRV.INFO reply. It fails if the process exits
// first.
func (p *process) serviceInfo(t *testing.T, url string, want ...string) micro.Info {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	var nc *nats.Conn
	defer func() {
		if nc != nil {
			nc.Close()
		}
	}()
	for {
		// A worker with an embedded nats-server answers $SRV only to its
		// own key (worker.KeyFile in its data directory), which it writes
		// once its server is up: connect with it once it is there.
		if nc == nil {
			opts := []nats.Option{nats.RetryOnFailedConnect(true), nats.MaxReconnects(-1), nats.ReconnectWait(20 * time.Millisecond)}
			key, embedded := p.keyFile()
			if _, err := os.Stat(key); embedded && err != nil {
				time.Sleep(50 * time.Millisecond)
				continue
			} else if embedded {
				opt, err := nats.NkeyOptionFromSeed(key)
				if err != nil {
					t.Fatal(err)
				}
				opts = append(opts, opt)
			}
			var err error
			if nc, err = nats.Connect(url, opts...); err != nil {
				t.Fatal(err)
			}
		}
		select {
		case err := <-p.done:
			p.done <- err
			t.Fatalf("dispenser exited (%v) before it served; logs:\n%s", err, p.logs.String())
		default:
		}
		if msg, err := nc.Request("$SRV.INFO.dispenser", nil, time.Second); err == nil {
			var info micro.Info
			if err := json.Unmarshal(msg.Data, &info); err != nil {
				t.Fatalf("$SRV.INFO reply %q: %v", msg.Data, err)
			}
			var have []string
			for _, e := range info.Endpoints {
				have = append(have, e.Name)
			}
			if !slices.ContainsFunc(want, func(w string) bool { return !slices.Contains(have, w) }) {
				return info
			}
		} else if !errors.Is(err, nats.ErrNoResponders) && !errors.Is(err, nats.ErrTimeout) && !errors.Is(err, nats.ErrConnectionClosed) && nc.IsConnected() {
			t.Fatalf("$SRV.INFO: %v", err)
		}
		if time.Now().After(deadline) {
			t.Fatalf("no dispenser service with endpoints %v on %s within 60 s; logs:\n%s", want, url, p.logs.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// keyFile returns where the worker writes its embedded nats-server's key
// (its --data-dir, default ./dispenser-data, in its directory), and
// whether it runs one (no --nats-url).
func (p *process) keyFile() (string, bool) {
	dir, embedded := worker.DefaultDataDir, true
	args := p.cmd.Args[1:]
	for i, a := range args {
		name, value, ok := strings.Cut(strings.TrimLeft(a, "-"), "=")
		if !ok && i+1 < len(args) {
			value = args[i+1]
		}
		switch {
		case !strings.HasPrefix(a, "-"):
		case name == "data-dir":
			dir = value
		case name == "nats-url" && value != "":
			embedded = false
		}
	}
	if !filepath.IsAbs(dir) {
		dir = filepath.Join(p.cmd.Dir, dir)
	}
	return filepath.Join(dir, worker.KeyFile), embedded
}

// runBinary runs a command line of a tool (the dispenser binary or the
// NATS CLI) to its end and returns its standard output and error.
func runBinary(t *testing.T, env []string, path string, args ...string) (stdout, stderr string, err error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, path, args...)
	cmd.Env = append(os.Environ(), env...)
	var o, e bytes.Buffer
	cmd.Stdout, cmd.Stderr = &o, &e
	err = cmd.Run()
	return o.String(), e.String(), err
}
