package worker

import (
	"cmp"
	"context"
	"fmt"
	"net"
	"net/http"
	"time"

	"golang.org/x/net/netutil"
)

// HTTPLimits bound what a client of the worker's HTTP servers (metrics
// and health on Config.MetricsAddr, Leaf's API on Config.HTTPAddr) can
// hold: a connection that sends its request slowly, or never finishes it,
// or idles between requests, is closed after a timeout, headers are
// bounded, and each server accepts at most MaxConns connections at once
// (more wait in the kernel's accept queue until one closes). Zero fields
// take the Default* values below, defined once for both servers.
type HTTPLimits struct {
	// ReadHeaderTimeout bounds reading a request's headers, ReadTimeout
	// the whole request with its body, WriteTimeout the request and its
	// response (at least the /db view's store reads, 10 s), IdleTimeout a
	// keep-alive connection's wait for its next request.
	ReadHeaderTimeout, ReadTimeout, WriteTimeout, IdleTimeout time.Duration
	// MaxHeaderBytes bounds a request's headers (and request line).
	MaxHeaderBytes int
	// MaxConns is the most connections each server holds at once
	// (--http-max-conns).
	MaxConns int
}

// The default HTTP limits: requests are small GETs, answered in
// milliseconds, by monitoring systems and ID clients that keep few
// connections. DefaultMaxConns connections of about 21 kB each while
// idle cost some 20 MB at most.
const (
	DefaultReadHeaderTimeout = 5 * time.Second
	DefaultReadTimeout       = 10 * time.Second
	DefaultWriteTimeout      = 30 * time.Second
	DefaultIdleTimeout       = time.Minute
	DefaultMaxHeaderBytes    = 16 << 10
	DefaultMaxConns          = 1000
)

// withDefaults returns l with its zero fields set to the defaults.
func (l HTTPLimits) withDefaults() HTTPLimits {
	l.ReadHeaderTimeout = cmp.Or(l.ReadHeaderTimeout, DefaultReadHeaderTimeout)
	l.ReadTimeout = cmp.Or(l.ReadTimeout, DefaultReadTimeout)
	l.WriteTimeout = cmp.Or(l.WriteTimeout, DefaultWriteTimeout)
	l.IdleTimeout = cmp.Or(l.IdleTimeout, DefaultIdleTimeout)
	l.MaxHeaderBytes = cmp.Or(l.MaxHeaderBytes, DefaultMaxHeaderBytes)
	l.MaxConns = cmp.Or(l.MaxConns, DefaultMaxConns)
	return l
}

// check refuses negative limits.
func (l HTTPLimits) check() error {
	if l.MaxConns < 0 {
		return fmt.Errorf("--http-max-conns %d: want a positive number, or 0 for the default, %d", l.MaxConns, DefaultMaxConns)
	}
	for _, f := range []struct {
		name     string
		negative bool
		value    any
	}{
		{"ReadHeaderTimeout", l.ReadHeaderTimeout < 0, l.ReadHeaderTimeout},
		{"ReadTimeout", l.ReadTimeout < 0, l.ReadTimeout},
		{"WriteTimeout", l.WriteTimeout < 0, l.WriteTimeout},
		{"IdleTimeout", l.IdleTimeout < 0, l.IdleTimeout},
		{"MaxHeaderBytes", l.MaxHeaderBytes < 0, l.MaxHeaderBytes},
	} {
		if f.negative {
			return fmt.Errorf("HTTP limit %s %v: want a positive value, or 0 for the default", f.name, f.value)
		}
	}
	return nil
}

// testListener, if not nil, wraps the listeners of the worker's HTTP
// servers below the connection cap (tests count open connections).
var testListener func(net.Listener) net.Listener

// serve returns a server of h with the limits, serving on ln capped at
// MaxConns connections, and the capped listener to pass to its Serve.
// netutil.LimitListener (golang.org/x/net, maintained by the Go team)
// makes Accept wait while MaxConns connections are open, so the cap holds
// without refusing anyone: the others wait in the accept queue.
func (l HTTPLimits) serve(ln net.Listener, h http.Handler, base context.Context) (*http.Server, net.Listener) {
	l = l.withDefaults()
	s := &http.Server{
		Handler:           h,
		ReadHeaderTimeout: l.ReadHeaderTimeout,
		ReadTimeout:       l.ReadTimeout,
		WriteTimeout:      l.WriteTimeout,
		IdleTimeout:       l.IdleTimeout,
		MaxHeaderBytes:    l.MaxHeaderBytes,
		BaseContext:       func(net.Listener) context.Context { return base },
	}
	if testListener != nil {
		ln = testListener(ln)
	}
	return s, netutil.LimitListener(ln, l.MaxConns)
}
