package worker

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dispenser-dev/dispenser/testenv"
)

// TestHTTPLimits: on both HTTP servers (metrics and Leaf's API), thousands
// of idle keep-alive connections and of requests that announce a body and
// never send it are closed by the server (each client reads until EOF; a
// deadline only bounds a hang), and neither server ever holds more than
// MaxConns connections at once.
func TestHTTPLimits(t *testing.T) {
	const maxConns, perKind = 200, 1000
	var mu sync.Mutex // protects open and peak
	open, peak := map[string]int{}, map[string]int{}
	testListener = func(ln net.Listener) net.Listener {
		return &countingListener{Listener: ln, opened: func(addr string, d int) {
			mu.Lock()
			defer mu.Unlock()
			open[addr] += d
			peak[addr] = max(peak[addr], open[addr])
		}}
	}
	t.Cleanup(func() { testListener = nil })
	const timeout = 200 * time.Millisecond
	w := httpWorker(t, HTTPLimits{ReadHeaderTimeout: timeout, ReadTimeout: timeout, IdleTimeout: timeout, MaxConns: maxConns})
	for _, srv := range httpServers(w) {
		t.Run(srv.name, func(t *testing.T) {
			var wg sync.WaitGroup
			var held, answered atomic.Int64
			var firstErr atomic.Value
			// fail counts a connection the server did not close: the
			// client's deadline ended its wait. Any other end (EOF, a
			// reset, a response cut short by the server's timeout) is the
			// server closing it.
			fail := func(err error) {
				var ne net.Error
				if errors.As(err, &ne) && ne.Timeout() {
					held.Add(1)
					firstErr.CompareAndSwap(nil, err)
				}
			}
			for i := range 2 * perKind {
				idle := i%2 == 0
				wg.Go(func() {
					c, err := net.Dial("tcp", srv.addr)
					if err != nil {
						fail(err)
						return
					}
					defer c.Close()
					// Bounds a hang only: the server must close first.
					c.SetDeadline(time.Now().Add(2 * time.Minute))
					if idle {
						// A keep-alive request answered, then nothing.
						fmt.Fprintf(c, "GET %s HTTP/1.1\r\nHost: x\r\n\r\n", srv.path)
						resp, err := http.ReadResponse(bufio.NewReader(c), nil)
						if err != nil {
							fail(fmt.Errorf("idle connection: reading the response: %w", err))
							return
						}
						answered.Add(1)
						io.Copy(io.Discard, resp.Body)
						resp.Body.Close()
					} else {
						// A body announced and never sent.
						fmt.Fprintf(c, "POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n", srv.path)
					}
					if _, err := io.Copy(io.Discard, c); err != nil { // until the server closes
						fail(fmt.Errorf("idle %v: waiting for the server to close: %w", idle, err))
					}
				})
			}
			wg.Wait()
			if n := held.Load(); n > 0 {
				t.Fatalf("%d of %d connections not closed by the server (first: %v)", n, 2*perKind, firstErr.Load())
			}
			if answered.Load() == 0 {
				t.Fatal("no idle connection got its response")
			}
			mu.Lock()
			defer mu.Unlock()
			if p := peak[srv.addr]; p > maxConns || p == 0 {
				t.Fatalf("the server held up to %d connections at once, want 1..%d", p, maxConns)
			}
		})
	}
}

// countingListener reports each connection it accepts (+1) and its first
// Close (-1) to opened, with the listener's address.
type countingListener struct {
	net.Listener
	opened func(addr string, delta int)
}

func (l *countingListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	addr := l.Addr().String()
	l.opened(addr, 1)
	return &countedConn{Conn: c, done: func() { l.opened(addr, -1) }}, nil
}

type countedConn struct {
	net.Conn
	once sync.Once
	done func()
}

func (c *countedConn) Close() error {
	err := c.Conn.Close()
	c.once.Do(c.done)
	return err
}

// TestHTTPHeaderLimit: on both HTTP servers, a request whose headers pass
// DefaultMaxHeaderBytes (net/http allows 4 kB of slack) is refused with
// 431 before it reaches a handler; one of a few kB is answered.
func TestHTTPHeaderLimit(t *testing.T) {
	w := httpWorker(t, HTTPLimits{})
	for _, srv := range httpServers(w) {
		for _, tt := range []struct {
			name        string
			headerBytes int
			refused     bool
		}{
			{"small header", 4 << 10, false},
			{"twice the limit", 2 * DefaultMaxHeaderBytes, true},
		} {
			t.Run(srv.name+"/"+tt.name, func(t *testing.T) {
				c, err := net.Dial("tcp", srv.addr)
				if err != nil {
					t.Fatal(err)
				}
				defer c.Close()
				c.SetDeadline(time.Now().Add(time.Minute)) // bounds a hang only
				fmt.Fprintf(c, "GET %s HTTP/1.1\r\nHost: x\r\nX-Big: %s\r\n\r\n", srv.path, strings.Repeat("a", tt.headerBytes))
				resp, err := http.ReadResponse(bufio.NewReader(c), nil)
				if err != nil {
					t.Fatalf("reading the response: %v", err)
				}
				resp.Body.Close()
				if got := resp.StatusCode == http.StatusRequestHeaderFieldsTooLarge; got != tt.refused {
					t.Errorf("%d bytes of header: status %d; want refused with 431: %v", tt.headerBytes, resp.StatusCode, tt.refused)
				}
			})
		}
	}
}

// TestHTTPLimitsNameTheBadOne: a negative HTTP limit is refused with its
// own name (only MaxConns is a flag, --http-max-conns). Seen failing with
// the old check, which named --http-max-conns for any of them:
// "ReadHeaderTimeout: error \"--http-max-conns 0: want a positive number
// (HTTP limits must not be negative)\", want it to name ReadHeaderTimeout".
func TestHTTPLimitsNameTheBadOne(t *testing.T) {
	for _, tt := range []struct {
		name  string
		set   func(*HTTPLimits)
		names string
	}{
		{"ReadHeaderTimeout", func(l *HTTPLimits) { l.ReadHeaderTimeout = -time.Second }, "ReadHeaderTimeout"},
		{"ReadTimeout", func(l *HTTPLimits) { l.ReadTimeout = -time.Second }, "ReadTimeout"},
		{"WriteTimeout", func(l *HTTPLimits) { l.WriteTimeout = -time.Second }, "WriteTimeout"},
		{"IdleTimeout", func(l *HTTPLimits) { l.IdleTimeout = -time.Second }, "IdleTimeout"},
		{"MaxHeaderBytes", func(l *HTTPLimits) { l.MaxHeaderBytes = -1 }, "MaxHeaderBytes"},
		{"MaxConns", func(l *HTTPLimits) { l.MaxConns = -1 }, "--http-max-conns"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			var l HTTPLimits
			tt.set(&l)
			err := l.check()
			if err == nil || !strings.Contains(err.Error(), tt.names) {
				t.Fatalf("%s: error %q, want it to name %s", tt.name, err, tt.names)
			}
		})
	}
	if err := (HTTPLimits{}).check(); err != nil {
		t.Fatalf("the zero HTTPLimits (defaults): %v", err)
	}
}

// httpWorker starts a worker with both HTTP servers (metrics and Leaf's
// API) under limits, on a nats-server of its own.
func httpWorker(tb testing.TB, limits HTTPLimits) *Worker {
	tb.Helper()
	ns := testenv.StartNATS(tb, testenv.NATSOptions(tb.TempDir()))
	tb.Cleanup(ns.Shutdown)
	w, err := New(context.Background(), Config{NATS: NATS{URL: ns.ClientURL()}, Logger: (&testenv.LogBuffer{}).Logger(),
		NoSnowflake: true, MetricsAddr: "127.0.0.1:0", HTTPAddr: "127.0.0.1:0", ShutdownTimeout: 2 * time.Second, HTTP: limits})
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { w.Close() })
	return w
}

// httpServers are w's two HTTP servers, each with a path to ask.
func httpServers(w *Worker) []struct{ name, addr, path string } {
	return []struct{ name, addr, path string }{
		{"metrics", w.httpAddr, "/healthz"},
		{"leaf", w.leafAddr, "/api/segment/get/nope"},
	}
}
