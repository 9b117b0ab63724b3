package testenv

import (
	"errors"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
)

// NATSServer is an embedded nats-server with JetStream that can be stopped
// and started again on the same port with the same store, as a real server
// restarts: its clients reconnect to the address they know. It logs to a
// file, which Start quotes when the server does not come up.
type NATSServer struct {
	// Opts are the server's options; Start uses a copy (a server may
	// change the options it is given). Change them before Start.
	Opts *server.Options
	srv  *server.Server // nil while stopped
	log  *serverLog
}

// NewNATSServer returns a stopped server on a fixed loopback port (see
// ServerPort) storing under a directory of tb's own; Start starts it and
// Cleanup stops it.
func NewNATSServer(tb testing.TB) *NATSServer {
	tb.Helper()
	dir := tb.TempDir()
	opts := NATSOptions(filepath.Join(dir, "jetstream"))
	port, err := ServerPort()
	if err != nil {
		tb.Fatal(err)
	}
	opts.Port = port
	opts.NoLog = false
	n := &NATSServer{Opts: opts, log: &serverLog{name: filepath.Join(dir, "nats-server.log")}}
	tb.Cleanup(n.Stop)
	return n
}

// StartNATSServer starts a NATSServer and fails tb if it does not come up.
func StartNATSServer(tb testing.TB) *NATSServer {
	tb.Helper()
	n := NewNATSServer(tb)
	if err := n.Start(); err != nil {
		tb.Fatal(err)
	}
	return n
}

// URL returns the server's client URL; it stays the same across restarts.
func (n *NATSServer) URL() string { return fmt.Sprintf("nats://127.0.0.1:%d", n.Opts.Port) }

// Server returns the running server, nil while it is stopped.
func (n *NATSServer) Server() *server.Server { return n.srv }

// Start starts the server with a copy of its options and waits until it
// accepts connections.
func (n *NATSServer) Start() error {
	o := *n.Opts
	s, err := server.NewServer(&o)
	if err != nil {
		return fmt.Errorf("nats-server: %w", err)
	}
	s.SetLogger(n.log, false, false)
	s.Start()
	if !s.ReadyForConnections(30 * time.Second) {
		s.Shutdown()
		return fmt.Errorf("nats-server on port %d not ready within 30s; its log:\n%s", n.Opts.Port, tail(n.log.name, 4096))
	}
	n.srv = s
	return nil
}

// Stop shuts the server down and waits until it is down.
func (n *NATSServer) Stop() {
	if n.srv != nil {
		n.srv.Shutdown()
		n.srv.WaitForShutdown()
		n.srv = nil
	}
}

// serverLog is a server.Logger appending to a file.
type serverLog struct {
	name string
	mu   sync.Mutex // serializes the appends
}

func (l *serverLog) logf(level, format string, v ...any) {
	l.mu.Lock()
	defer l.mu.Unlock()
	f, err := os.OpenFile(l.name, os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644)
	if err != nil {
		return
	}
	fmt.Fprintf(f, "%s [%s] %s\n", time.Now().Format("15:04:05.000"), level, fmt.Sprintf(format, v...))
	f.Close()
}

func (l *serverLog) Noticef(format string, v ...any) { l.logf("INF", format, v...) }
func (l *serverLog) Warnf(format string, v ...any)   { l.logf("WRN", format, v...) }
func (l *serverLog) Fatalf(format string, v ...any)  { l.logf("FTL", format, v...) }
func (l *serverLog) Errorf(format string, v ...any)  { l.logf("ERR", format, v...) }
func (l *serverLog) Debugf(format string, v ...any)  { l.logf("DBG", format, v...) }
func (l *serverLog) Tracef(format string, v ...any)  { l.logf("TRC", format, v...) }

// NATSCluster is NATSServers with JetStream clustered on loopback, routed
// to each other directly; each can be stopped and started again. (A
// cluster whose routes go through fault links is faultnet.Cluster.)
type NATSCluster struct {
	Nodes []*NATSServer // server i is named n<i>
}

// StartNATSCluster starts n clustered servers and waits until they are
// healthy.
func StartNATSCluster(tb testing.TB, n int) *NATSCluster {
	tb.Helper()
	c := &NATSCluster{}
	var routes []*url.URL
	for i := range n {
		s := NewNATSServer(tb)
		port, err := ServerPort()
		if err != nil {
			tb.Fatal(err)
		}
		s.Opts.ServerName = fmt.Sprintf("n%d", i)
		s.Opts.Cluster = server.ClusterOpts{Name: "testenv", Host: "127.0.0.1", Port: port}
		routes = append(routes, &url.URL{Scheme: "nats-route", Host: fmt.Sprintf("127.0.0.1:%d", port)})
		c.Nodes = append(c.Nodes, s)
	}
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i, s := range c.Nodes {
		s.Opts.Routes = routes
		wg.Go(func() { errs[i] = s.Start() })
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		tb.Fatal(err)
	}
	c.WaitHealthy(tb)
	return c
}

// URLs returns the client URLs of all servers, comma-separated.
func (c *NATSCluster) URLs() string {
	var urls []string
	for _, s := range c.Nodes {
		urls = append(urls, s.URL())
	}
	return strings.Join(urls, ",")
}

// WaitHealthy waits until every running server reports healthy: JetStream
// meta group and all streams current; it fails tb after a minute.
func (c *NATSCluster) WaitHealthy(tb testing.TB) {
	tb.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		var bad []string
		for _, s := range c.Nodes {
			if s.srv == nil {
				continue
			}
			if h := s.srv.Healthz(nil); h.Status != "ok" {
				bad = append(bad, fmt.Sprintf("%s: %s %s", s.Opts.ServerName, h.Status, h.Error))
			}
		}
		if len(bad) == 0 {
			return
		}
		if time.Now().After(deadline) {
			tb.Fatalf("nats cluster not healthy within 60s: %v", bad)
		}
		time.Sleep(100 * time.Millisecond)
	}
}
