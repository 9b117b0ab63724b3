package bench

import (
	"context"
	"fmt"
	"net"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
)

// StartupResult is how long `dispenser serve` takes from the start of its
// process to serving in zero-setup mode: no flags but a free listen address
// and a fresh data directory.
type StartupResult struct {
	ServingMS     float64 `json:"serving_ms"`      // the micro service answers a ping
	SegmentIDMS   float64 `json:"segment_id_ms"`   // first ID of a tag created on first use
	SnowflakeIDMS float64 `json:"snowflake_id_ms"` // first snowflake ID
	RSSBytes      int64   `json:"rss_bytes"`       // of the process, embedded nats-server included
}

// measureStartup starts `dispenser serve` in zero-setup mode in dir and
// times it until it serves.
func measureStartup(ctx context.Context, dir string) (*StartupResult, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	addr := ln.Addr().String()
	ln.Close()
	start := time.Now()
	c, err := startChild(ctx, "serve", "--nats-listen", addr, "--data-dir", dir, "--instance", "bench-startup", "--log-level", "warn")
	if err != nil {
		return nil, err
	}
	defer c.stop()
	deadline := start.Add(20 * time.Second)
	// wait returns an error if serve has exited or the deadline passed.
	wait := func(what string) error {
		if c.gone() {
			return fmt.Errorf("serve exited: %s", strings.TrimSpace(c.stderr.String()))
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("serve did not %s within 20s", what)
		}
		time.Sleep(time.Millisecond)
		return nil
	}
	var nc *nats.Conn
	for nc == nil {
		nc, _ = nats.Connect("nats://"+addr, nats.Timeout(100*time.Millisecond))
		if nc == nil {
			if err := wait("listen on " + addr); err != nil {
				return nil, err
			}
		}
	}
	defer nc.Close()
	r := &StartupResult{}
	for {
		// A reply of the service, an error one too, is the service
		// serving. (Not $SRV.PING: a client without credentials may not
		// ask it of the embedded server.)
		if _, err := nc.Request("id.snowflake.decode", []byte("0"), 100*time.Millisecond); err == nil {
			r.ServingMS = msSince(start)
			break
		}
		if err := wait("answer a ping"); err != nil {
			return nil, err
		}
	}
	if _, err := requestID(ctx, nc, "id.segment.startup", 5*time.Second); err != nil {
		return nil, fmt.Errorf("first segment ID: %w", err)
	}
	r.SegmentIDMS = msSince(start)
	t := time.Now()
	if _, err := requestID(ctx, nc, "id.snowflake", 5*time.Second); err != nil {
		return nil, fmt.Errorf("first snowflake ID: %w", err)
	}
	r.SnowflakeIDMS = r.SegmentIDMS + msSince(t)
	if r.RSSBytes, err = processRSS(strconv.Itoa(c.cmd.Process.Pid)); err != nil {
		return nil, err
	}
	return r, nil
}

func msSince(t time.Time) float64 { return float64(time.Since(t).Microseconds()) / 1000 }
