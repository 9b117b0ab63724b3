// Package faultnet is a fault network for tests: every link between test
// processes goes through a fault proxy on 127.0.0.1 that the test controls.
// The proxies are Shopify's toxiproxy, run in-process; a Link is one
// toxiproxy proxy, and each fault is a toxic on it.
//
// What each fault does underneath:
//   - BlackHole: the proxy stops reading in that direction (faultnet's own
//     "stall" toxic, registered with toxiproxy). The sender's socket
//     buffers fill and its writes block; nothing is dropped, closed or
//     reset, as in a real partition where TCP retransmits unanswered. On
//     Heal the held bytes flow on, like retransmissions after a partition
//     heals. toxiproxy's own black hole (the timeout toxic with timeout 0)
//     is not used: it reads and discards the bytes, so the sender never
//     stalls, and removing it closes every connection through the proxy.
//   - Reset: toxiproxy's reset_peer toxic (timeout 0) on both directions.
//     A connection accepted while it is in place is reset (RST, SO_LINGER
//     0) at its first byte in either direction. A connection open before
//     Reset is closed at its next byte; toxiproxy sets SO_LINGER only when
//     it accepts a connection, so that close is a FIN, not an RST.
//   - Latency: toxiproxy's latency toxic: each chunk is delayed by the
//     latency plus a uniform jitter in [-jitter, +jitter].
//   - Bandwidth: toxiproxy's bandwidth toxic: at most the given kilobytes
//     per second.
//
// A new connection to a link is accepted by the proxy, which dials the
// upstream at once, whatever faults are in place: in a black hole the
// TCP handshake succeeds and the first bytes stall, where a real partition
// would let the connect time out.
package faultnet

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	toxiproxy "github.com/Shopify/toxiproxy/v2"
	"github.com/Shopify/toxiproxy/v2/toxics"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"
)

// Direction is the direction of a link a fault applies to.
type Direction int

const (
	// Both is client to server and server to client.
	Both Direction = iota
	// Up is client to server: from the side that dials the link to its
	// upstream.
	Up
	// Down is server to client.
	Down
)

func (d Direction) String() string {
	switch d {
	case Both:
		return "both"
	case Up:
		return "up"
	case Down:
		return "down"
	}
	return fmt.Sprintf("Direction(%d)", int(d))
}

// streams returns toxiproxy's names of the streams d covers.
func (d Direction) streams() ([]string, error) {
	switch d {
	case Both:
		return []string{"upstream", "downstream"}, nil
	case Up:
		return []string{"upstream"}, nil
	case Down:
		return []string{"downstream"}, nil
	}
	return nil, fmt.Errorf("%w: %d", ErrDirection, int(d))
}

// Fault is a kind of fault on a link, for Link.Remove.
type Fault string

// The faults of a link.
const (
	BlackHoleFault Fault = "blackhole"
	ResetFault     Fault = "reset"
	LatencyFault   Fault = "latency"
	BandwidthFault Fault = "bandwidth"
)

// Errors of package faultnet.
var (
	// ErrDirection is a Direction other than Both, Up and Down.
	ErrDirection = errors.New("faultnet: unknown direction")
)

// stallToxic holds every byte in its direction until it is removed: the
// proxy stops reading, so the sender's buffers fill and it blocks.
type stallToxic struct{}

// Pipe does not read its input; it returns when the toxic is removed
// (toxiproxy then passes the held bytes on) or interrupted to change the
// chain.
func (stallToxic) Pipe(stub *toxics.ToxicStub) { <-stub.Interrupt }

const stallType = "faultnet_stall"

func init() { toxics.Register(stallType, new(stallToxic)) }

// Net is a set of fault proxies on 127.0.0.1.
type Net struct {
	api *toxiproxy.ApiServer

	// mu protects links.
	mu    sync.Mutex
	links []*Link
}

// New returns an empty fault network; Cleanup heals and stops its links.
func New(tb testing.TB) *Net {
	tb.Helper()
	// toxiproxy's toxics log through zerolog's global logger (the
	// bandwidth toxic traces every interruption to stderr): silence it.
	zerolog.SetGlobalLevel(zerolog.Disabled)
	n := &Net{api: toxiproxy.NewServer(toxiproxy.NewMetricsContainer(prometheus.NewRegistry()), zerolog.Nop())}
	tb.Cleanup(n.close)
	return n
}

func (n *Net) close() {
	n.mu.Lock()
	defer n.mu.Unlock()
	// All links at once: healing one whose connections died may take
	// seconds (see Link.Remove).
	var wg sync.WaitGroup
	for _, l := range n.links {
		wg.Go(func() {
			// Heal first: a stalled connection's goroutines end only
			// when its stall is removed.
			l.heal()
			l.proxy.Stop()
		})
	}
	wg.Wait()
	n.links = nil
}

// Link starts a fault proxy on a random port of 127.0.0.1 forwarding to
// upstream (host:port). Dial Link.Addr instead of upstream.
func (n *Net) Link(tb testing.TB, name, upstream string) *Link {
	tb.Helper()
	p := toxiproxy.NewProxy(n.api, name, "127.0.0.1:0", upstream)
	if err := p.Start(); err != nil {
		tb.Fatalf("faultnet: link %s to %s: %v", name, upstream, err)
	}
	l := &Link{tb: tb, name: name, proxy: p}
	n.mu.Lock()
	n.links = append(n.links, l)
	n.mu.Unlock()
	return l
}

// Link is one fault proxy. Its methods fail the test (tb.Fatal) on an
// error, so call them from the test's goroutine.
type Link struct {
	tb    testing.TB
	name  string
	proxy *toxiproxy.Proxy
}

// Addr is the address the link listens on (host:port).
func (l *Link) Addr() string { return l.proxy.Listen }

// Name is the link's name.
func (l *Link) Name() string { return l.name }

// BlackHole stalls the link in dir: bytes stop flowing, no connection is
// closed or reset. New connections are accepted and stall too.
func (l *Link) BlackHole(dir Direction) {
	l.tb.Helper()
	l.add(BlackHoleFault, stallType, dir, struct{}{})
}

// Reset resets connections: every new connection at its first byte, an
// open one at its next byte (see the package comment), until Heal.
func (l *Link) Reset() {
	l.tb.Helper()
	l.add(ResetFault, "reset_peer", Both, map[string]int64{"timeout": 0})
}

// Latency delays every chunk in dir by d plus a uniform jitter in
// [-jitter, +jitter] (millisecond resolution).
func (l *Link) Latency(dir Direction, d, jitter time.Duration) {
	l.tb.Helper()
	l.add(LatencyFault, "latency", dir, map[string]int64{"latency": d.Milliseconds(), "jitter": jitter.Milliseconds()})
}

// Bandwidth limits dir to kbPerSecond kilobytes per second (toxiproxy's
// unit).
func (l *Link) Bandwidth(dir Direction, kbPerSecond int64) {
	l.tb.Helper()
	l.add(BandwidthFault, "bandwidth", dir, map[string]int64{"rate": kbPerSecond})
}

// Heal removes every fault from the link. Bytes held by a black hole flow
// on; open connections stay open.
func (l *Link) Heal() {
	l.heal()
}

// heal is Heal on any goroutine. The black hole goes first: a latency
// toxic holding a chunk in front of one does not return until the hole
// takes it, so removing the latency first (toxiproxy's ResetToxics alone
// does, in the order the faults were added) never returns.
func (l *Link) heal() {
	l.remove(BlackHoleFault) // an error (a fault gone meanwhile) leaves it to ResetToxics
	l.proxy.Toxics.ResetToxics(context.Background())
}

// Remove removes the faults of one kind from the link, in both
// directions, and leaves the others. Remove(BlackHoleFault) lets held
// bytes flow on, as Heal does.
//
// Removing a black hole from a link that also has a latency can take
// 5 s per direction: toxiproxy passes each held chunk on with a 5 s
// timeout, and a connection that was closed while it stalled (a server
// gave up on a silent route or client and dialed again) has no writer
// left to take the chunk that the interrupted latency toxic holds. Heal
// cuts first, latency after; a latency cannot be removed first, as a
// latency toxic that holds a chunk in front of a black hole does not
// return until the hole takes it.
func (l *Link) Remove(kind Fault) {
	l.tb.Helper()
	if err := l.remove(kind); err != nil {
		l.tb.Fatal(err)
	}
}

// remove is Remove, returning its error: it may run on any goroutine.
func (l *Link) remove(kind Fault) error {
	for _, stream := range []string{"upstream", "downstream"} {
		name := string(kind) + "_" + stream
		if l.proxy.Toxics.GetToxic(name) == nil {
			continue
		}
		if err := l.proxy.Toxics.RemoveToxic(context.Background(), name); err != nil {
			return fmt.Errorf("faultnet: link %s: remove %s: %w", l.name, name, err)
		}
	}
	return nil
}

// add puts a toxic of toxicType named kind_stream on each stream of dir,
// replacing one of the same name.
func (l *Link) add(kind Fault, toxicType string, dir Direction, attrs any) {
	l.tb.Helper()
	streams, err := dir.streams()
	if err != nil {
		l.tb.Fatalf("faultnet: link %s: %s: %v", l.name, kind, err)
	}
	for _, stream := range streams {
		name := string(kind) + "_" + stream
		if l.proxy.Toxics.GetToxic(name) != nil {
			if err := l.proxy.Toxics.RemoveToxic(context.Background(), name); err != nil {
				l.tb.Fatalf("faultnet: link %s: replace %s: %v", l.name, name, err)
			}
		}
		body, err := json.Marshal(map[string]any{
			"name": name, "type": toxicType, "stream": stream, "toxicity": 1.0, "attributes": attrs,
		})
		if err != nil {
			l.tb.Fatalf("faultnet: link %s: %s: %v", l.name, name, err)
		}
		if _, err := l.proxy.Toxics.AddToxicJson(bytes.NewReader(body)); err != nil {
			l.tb.Fatalf("faultnet: link %s: add %s: %v", l.name, name, err)
		}
	}
}
