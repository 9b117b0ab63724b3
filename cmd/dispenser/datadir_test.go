package main

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
)

// child is `dispenser` run from this test binary in a process of its own.
type child struct {
	cmd  *exec.Cmd
	out  *syncBuffer
	done chan struct{} // closed when the process has exited
	err  error         // its exit; read after done
}

// startChild starts `dispenser args…` as a process of its own (the test
// binary with benchChildEnv set: testMain runs the command line), killed
// when the test ends.
func startChild(t *testing.T, args ...string) *child {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	c := &child{cmd: exec.Command(exe, args...), out: &syncBuffer{}, done: make(chan struct{})}
	c.cmd.Env = append(os.Environ(), benchChildEnv+"=1")
	c.cmd.Stdout, c.cmd.Stderr = c.out, c.out
	if err := c.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		c.err = c.cmd.Wait()
		close(c.done)
	}()
	t.Cleanup(func() {
		c.cmd.Process.Kill()
		<-c.done
	})
	return c
}

// serving waits until the worker of c answers id.snowflake on addr, or
// until c exits (false). A deadline bounds a hang.
func (c *child) serving(t *testing.T, addr string) bool {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for time.Now().Before(deadline) {
		select {
		case <-c.done:
			return false
		default:
		}
		if nc, err := nats.Connect("nats://"+addr, nats.Timeout(time.Second)); err == nil {
			resp, err := nc.Request("id.snowflake", nil, time.Second)
			nc.Close()
			if err == nil && len(resp.Header) == 0 {
				return true
			}
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatalf("%v neither serves on %s nor exits; output:\n%s", c.cmd.Args[1:], addr, c.out.String())
	return false
}

// TestDataDirOneProcess: two processes on one --data-dir would open one
// JetStream store and hand out the same IDs (issue 34). The second
// refuses to start, naming the directory and the holder; after the first
// is killed (SIGKILL: nothing cleaned up) a new worker starts on the
// directory and goes on where the first stopped.
func TestDataDirOneProcess(t *testing.T) {
	t.Parallel()
	dir := filepath.Join(t.TempDir(), "data")
	addr1, addr2, addr3 := freeAddr(t), freeAddr(t), freeAddr(t)
	first := startChild(t, "serve", "--nats-listen", addr1, "--data-dir", dir, "--instance", "first")
	if !first.serving(t, addr1) {
		t.Fatalf("the first worker exited: %v; output:\n%s", first.err, first.out.String())
	}
	nc1 := connect(t, addr1)
	if got := waitForID(t, nc1, "id.segment.fresh1", first.out); got != "1" {
		t.Fatalf("first worker: fresh1 = %s, want 1", got)
	}

	second := startChild(t, "serve", "--nats-listen", addr2, "--data-dir", dir, "--instance", "second")
	if second.serving(t, addr2) {
		nc2 := connect(t, addr2)
		t.Fatalf("a second worker serves on the first's data directory: fresh1 = %s there; output:\n%s",
			waitForID(t, nc2, "id.segment.fresh1", second.out), second.out.String())
	}
	if second.err == nil {
		t.Fatalf("the second worker exited 0; output:\n%s", second.out.String())
	}
	for _, want := range []string{dir, "held by another process", "--data-dir"} {
		if !strings.Contains(second.out.String(), want) {
			t.Errorf("the second worker's refusal does not say %q:\n%s", want, second.out.String())
		}
	}
	if got := waitForID(t, nc1, "id.segment.fresh1", first.out); got != "2" {
		t.Fatalf("first worker after the refused second: fresh1 = %s, want 2", got)
	}
	nc1.Close()

	if err := first.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	<-first.done
	third := startChild(t, "serve", "--nats-listen", addr3, "--data-dir", dir, "--instance", "third")
	if !third.serving(t, addr3) {
		t.Fatalf("no worker starts on the data directory after its holder was killed: %v; output:\n%s", third.err, third.out.String())
	}
	// The first's segment [1, 1001) is spent: the third goes on after it.
	if got := waitForID(t, connect(t, addr3), "id.segment.fresh1", third.out); got != "1001" {
		t.Fatalf("after the crash: fresh1 = %s, want 1001", got)
	}
}

// TestListenAddressTaken: a --nats-listen address another process holds
// fails at once with "address already in use", naming the address and the
// way out, and the data directory is released again.
func TestListenAddressTaken(t *testing.T) {
	addr := freeAddr(t)
	holder := startChild(t, "serve", "--nats-listen", addr, "--data-dir", t.TempDir(), "--instance", "holder")
	if !holder.serving(t, addr) {
		t.Fatalf("the first worker exited: %v; output:\n%s", holder.err, holder.out.String())
	}
	dir := t.TempDir()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	out, err := runCmdCtx(ctx, "serve", "--nats-listen", addr, "--data-dir", dir)
	if err == nil {
		t.Fatalf("serve on a taken address: no error; output:\n%s", out)
	}
	for _, want := range []string{addr, "address already in use", "--nats-listen", "--nats-url nats://" + addr} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not say %q", err, want)
		}
	}
}

// connect connects to the NATS server at addr without credentials, as a
// requester; a server not listening yet is waited for.
func connect(t *testing.T, addr string) *nats.Conn {
	t.Helper()
	nc, err := nats.Connect("nats://"+addr, nats.RetryOnFailedConnect(true), nats.MaxReconnects(-1), nats.ReconnectWait(10*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	return nc
}
