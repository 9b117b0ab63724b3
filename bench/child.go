package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/dispenser-dev/dispenser/segment/kv"
)

// ChildEnv is set (to 1) in the environment of the processes that Run
// starts from os.Executable(). The program needs no marker: the command
// line says what to do. A test binary's TestMain sees it and runs the
// command line instead of the tests.
const ChildEnv = "DISPENSER_BENCH_CHILD"

// childCommand returns a command that runs this program with args, with the
// DISPENSER_* variables removed from its environment so that only args
// configure it.
func childCommand(ctx context.Context, args ...string) (*exec.Cmd, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, fmt.Errorf("finding this program to start a child: %w", err)
	}
	cmd := exec.CommandContext(ctx, exe, args...)
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "DISPENSER_") {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	cmd.Env = append(cmd.Env, ChildEnv+"=1")
	if os.Getenv("GORACE") == "" {
		// A race-enabled binary (go test -race) otherwise sleeps a second
		// when it exits with status 0.
		cmd.Env = append(cmd.Env, "GORACE=atexit_sleep_ms=0")
	}
	cmd.WaitDelay = 5 * time.Second
	return cmd, nil
}

// MemoryResult is the resident size of an idle worker with warm tags.
type MemoryResult struct {
	Tags        int     `json:"tags"`
	Store       string  `json:"store"`
	RSSBytes    int64   `json:"rss_bytes"`
	WarmSeconds float64 `json:"warm_seconds"`
}

// child is a running child process whose output is kept.
type child struct {
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	stdout tailBuffer
	stderr tailBuffer
	exited chan struct{} // closed once the process has exited
}

// startChild starts this program with args (see childCommand).
func startChild(ctx context.Context, args ...string) (*child, error) {
	cmd, err := childCommand(ctx, args...)
	if err != nil {
		return nil, err
	}
	c := &child{cmd: cmd, exited: make(chan struct{})}
	if c.stdin, err = cmd.StdinPipe(); err != nil {
		return nil, err
	}
	cmd.Stdout, cmd.Stderr = &c.stdout, &c.stderr
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("starting %s: %w", args[0], err)
	}
	go func() { cmd.Wait(); close(c.exited) }()
	return c, nil
}

func (c *child) gone() bool {
	select {
	case <-c.exited:
		return true
	default:
		return false
	}
}

// stop closes the child's stdin and sends it an interrupt, and kills it
// if it has not exited after 10 s.
func (c *child) stop() {
	c.stdin.Close()
	c.cmd.Process.Signal(os.Interrupt)
	select {
	case <-c.exited:
	case <-time.After(10 * time.Second):
		c.cmd.Process.Kill()
		<-c.exited
	}
}

// measureMemory starts `dispenser serve` as an idle worker on the KV
// bucket memBucket with n tags, takes an ID of every tag, waits a
// second and returns the worker process's resident size. It forces no GC:
// a worker in production gets none either.
func (e *env) measureMemory(ctx context.Context, n int) (*MemoryResult, error) {
	store, err := kv.New(ctx, e.js, kv.Settings{Bucket: memBucket})
	if err != nil {
		return nil, err
	}
	tags := make([]string, n)
	for i := range tags {
		tags[i] = fmt.Sprintf("mem_%04d", i)
	}
	if err := parallel(ctx, tags, 16, func(tag string) error { return ensureTag(ctx, store, tag, 1000) }); err != nil {
		return nil, err
	}
	c, err := startChild(ctx, "serve", "--nats-url", e.url, "--segment-bucket", memBucket,
		"--prefix", memPrefix, "--queue-group", memPrefix, "--instance", "bench-memory", "--log-level", "warn")
	if err != nil {
		return nil, err
	}
	defer c.stop()
	start := time.Now()
	err = parallel(ctx, tags, 32, func(tag string) error {
		_, err := requestID(ctx, e.ctlNC, memPrefix+".segment."+tag, 30*time.Second)
		return err
	})
	if err != nil {
		if c.gone() {
			err = fmt.Errorf("the worker exited: %s", strings.TrimSpace(c.stderr.String()))
		}
		return nil, fmt.Errorf("warming the worker's tags: %w", err)
	}
	warm := time.Since(start)
	time.Sleep(time.Second)
	rss, err := processRSS(strconv.Itoa(c.cmd.Process.Pid))
	if err != nil {
		return nil, err
	}
	return &MemoryResult{Tags: n, Store: "kv", RSSBytes: rss, WarmSeconds: round(warm.Seconds(), 3)}, nil
}

// processRSS reads the resident set size of a process from /proc (Linux).
func processRSS(pid string) (int64, error) {
	b, err := os.ReadFile("/proc/" + pid + "/status")
	if err != nil {
		return 0, err
	}
	for line := range strings.SplitSeq(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(rest), "kB")), 10, 64)
			return kb << 10, err
		}
	}
	return 0, errors.New("no VmRSS in /proc/" + pid + "/status")
}

// tailBuffer keeps the last 4 KiB written to it; it is safe for concurrent
// use.
type tailBuffer struct {
	mu sync.Mutex
	b  []byte
}

func (t *tailBuffer) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.b = append(t.b, p...)
	if len(t.b) > 4096 {
		t.b = append(t.b[:0], t.b[len(t.b)-4096:]...)
	}
	return len(p), nil
}

func (t *tailBuffer) String() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return string(t.b)
}
