package faultnet

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"net"
	"net/url"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/dispenser-dev/dispenser/testenv"
)

// ClusterOptions configures Cluster. The zero value means the defaults.
type ClusterOptions struct {
	// RoutePingInterval is how often a server pings its routes; a route
	// whose peer misses two pings is closed. Default 1 s, so that a black
	// hole takes a route down within seconds (nats-server's default is
	// 2 min: an idle route through a black hole would stay up for
	// minutes, as it does in a real partition).
	RoutePingInterval time.Duration
	// ClientPingInterval is how often a server pings its clients; a
	// client that leaves two pings unanswered is closed and its
	// subscriptions dropped. Default 1 s, as for routes: a client behind a
	// black hole (a worker cut from its server) leaves the queue groups
	// within ClientDetect, 3 s, instead of taking its share of requests
	// into the black hole for nats-server's default of minutes (ping
	// every 2 min).
	ClientPingInterval time.Duration
	// NoAdvertise: the servers advertise no client URLs of the others
	// (cluster no_advertise), so that a client knows only the URLs it was
	// given, for example one link to one server, and does not reconnect
	// around a fault by a direct address.
	NoAdvertise bool
}

// MaxPingsOut is how many pings a server of a Cluster leaves unanswered,
// on routes and on client connections, before it closes the connection.
const MaxPingsOut = 2

// RouteDetect and ClientDetect are the longest a server of a Cluster with
// the default ping intervals keeps a route, or a client's subscriptions,
// after its peer went silent: the ping interval times (MaxPingsOut+1).
const (
	RouteDetect  = time.Second * (MaxPingsOut + 1)
	ClientDetect = time.Second * (MaxPingsOut + 1)
)

// Cluster is embedded nats-servers with JetStream (sync_interval: always)
// clustered on 127.0.0.1, every route through a faultnet link.
// Links[i][j] carries the routes that server i dials to server j; routes
// between i and j may use either link, so a cut between two servers
// covers both.
type Cluster struct {
	Servers []*server.Server
	Links   [][]*Link
	Net     *Net
	opts    []*server.Options // each server's options before it started (Restart)
	down    map[int]bool      // servers stopped by Stop and not started again
}

// deadRoute is the cluster address every server advertises: nothing
// listens there. Gossiped (implicit) routes dial it and fail, so no route
// bypasses the links.
const deadRoute = "127.0.0.1:1"

// NewCluster starts n servers, each dialing every other through its own
// link, waits until every server has routes to all others and JetStream
// is healthy, and shuts them down in Cleanup.
func NewCluster(tb testing.TB, n int, o ClusterOptions) *Cluster {
	tb.Helper()
	if o.RoutePingInterval == 0 {
		o.RoutePingInterval = time.Second
	}
	if o.ClientPingInterval == 0 {
		o.ClientPingInterval = time.Second
	}
	c := &Cluster{Net: New(tb), Links: make([][]*Link, n)}
	ports := make([]int, n)
	for i := range ports {
		p, err := testenv.ServerPort()
		if err != nil {
			tb.Fatal(err)
		}
		ports[i] = p
	}
	for i := range n {
		c.Links[i] = make([]*Link, n)
		for j := range n {
			if i != j {
				c.Links[i][j] = c.Net.Link(tb, fmt.Sprintf("route-n%d-n%d", i, j), net.JoinHostPort("127.0.0.1", strconv.Itoa(ports[j])))
			}
		}
	}
	for i := range n {
		opts := testenv.NATSOptions(tb.TempDir())
		opts.ServerName = fmt.Sprintf("n%d", i)
		opts.SyncAlways = true
		opts.Cluster = server.ClusterOpts{
			Name:         "faultnet",
			Host:         "127.0.0.1",
			Port:         ports[i],
			Advertise:    deadRoute,
			PingInterval: o.RoutePingInterval,
			MaxPingsOut:  MaxPingsOut,
			NoAdvertise:  o.NoAdvertise,
		}
		opts.PingInterval, opts.MaxPingsOut = o.ClientPingInterval, MaxPingsOut
		for j := range n {
			if i != j {
				opts.Routes = append(opts.Routes, &url.URL{Scheme: "nats-route", Host: c.Links[i][j].Addr()})
			}
		}
		// Lame-duck mode (Restart) spreads closing clients over 2 s,
		// after a grace period, as the NATS Helm chart's preStop does
		// over its longer defaults.
		opts.LameDuckDuration, opts.LameDuckGracePeriod = 2*time.Second, 500*time.Millisecond
		c.opts = append(c.opts, opts.Clone())
		s, err := server.NewServer(opts)
		if err != nil {
			tb.Fatalf("faultnet: nats-server n%d: %v", i, err)
		}
		c.Servers = append(c.Servers, s)
		tb.Cleanup(func() {
			s.Shutdown()
			s.WaitForShutdown()
		})
	}
	// Heal before the servers shut down (cleanups run last-registered
	// first): removing a latency toxic that holds a chunk for a
	// connection whose server is gone never returns (toxiproxy's writer
	// waits for the lock the removal holds).
	tb.Cleanup(c.Heal)
	for _, s := range c.Servers {
		go s.Start()
	}
	for _, s := range c.Servers {
		if !s.ReadyForConnections(30 * time.Second) {
			tb.Fatalf("faultnet: nats-server %s not ready within 30s", s.Name())
		}
	}
	for i := range n {
		c.WaitRoutes(tb, i, n-1)
	}
	c.WaitHealthy(tb)
	return c
}

// Isolate cuts server i from every other in both directions (black hole).
func (c *Cluster) Isolate(i int) {
	for j := range c.Servers {
		if j != i {
			c.Links[i][j].BlackHole(Both)
			c.Links[j][i].BlackHole(Both)
		}
	}
}

// Cut black-holes what server from sends to server to, whichever of
// them dialed the route; to's traffic to from still flows.
func (c *Cluster) Cut(from, to int) {
	c.Links[from][to].BlackHole(Up)
	c.Links[to][from].BlackHole(Down)
}

// HealCuts removes the black holes of Isolate and Cut from every route
// link, all links at once; other faults (latency, bandwidth) stay. Under
// a latency it may take 5 s per direction of a link (see Link.Remove).
func (c *Cluster) HealCuts(tb testing.TB) {
	tb.Helper()
	var wg sync.WaitGroup
	var links []*Link
	for _, row := range c.Links {
		for _, l := range row {
			if l != nil {
				links = append(links, l)
			}
		}
	}
	errs := make([]error, len(links))
	for i, l := range links {
		wg.Go(func() { errs[i] = l.remove(BlackHoleFault) })
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		tb.Fatal(err)
	}
}

// ClientLink starts a link to server i's client port as it listens now
// (a restarted server listens on a new port): a client or worker that
// dials it reaches server i only through faults the test controls.
func (c *Cluster) ClientLink(tb testing.TB, name string, i int) *Link {
	tb.Helper()
	u, err := url.Parse(c.Servers[i].ClientURL())
	if err != nil {
		tb.Fatalf("faultnet: client URL of n%d: %v", i, err)
	}
	return c.Net.Link(tb, name, u.Host)
}

// Heal removes every fault from every link.
func (c *Cluster) Heal() {
	for _, row := range c.Links {
		for _, l := range row {
			if l != nil {
				l.Heal()
			}
		}
	}
}

// Peers returns the names of the servers server i has a route to, from
// its monitoring (Routez).
func (c *Cluster) Peers(tb testing.TB, i int) map[string]bool {
	tb.Helper()
	rz, err := c.Servers[i].Routez(nil)
	if err != nil {
		tb.Fatalf("faultnet: routez of n%d: %v", i, err)
	}
	peers := map[string]bool{}
	for _, r := range rz.Routes {
		peers[r.RemoteName] = true
	}
	return peers
}

// WaitRoutes waits until server i has routes to exactly want other
// servers, at most 60 s.
func (c *Cluster) WaitRoutes(tb testing.TB, i, want int) {
	tb.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		peers := c.Peers(tb, i)
		if len(peers) == want {
			return
		}
		if time.Now().After(deadline) {
			tb.Fatalf("faultnet: n%d has routes to %v, want %d servers, after 60s", i, peers, want)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// WaitHealthy waits until every server reports healthy (JetStream meta
// group and all streams current) and the meta leader sees every other
// server online and current, so that a replicated stream can be placed;
// at most 60 s.
func (c *Cluster) WaitHealthy(tb testing.TB) {
	tb.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		var bad []string
		for _, s := range c.Servers {
			if h := s.Healthz(nil); h.Status != "ok" {
				bad = append(bad, fmt.Sprintf("%s: %s %s", s.Name(), h.Status, h.Error))
			}
		}
		// Healthy servers are not enough to place a replicated stream:
		// the meta leader must also see every other peer online and
		// current ("no suitable peers for placement" otherwise).
		if len(bad) == 0 {
			bad = c.metaPeersBehind()
		}
		// Even then the meta leader may still count a peer offline for a
		// moment ("no suitable peers for placement, peer offline", seen
		// right after start): wait until a stream with a replica on every
		// server can be placed.
		if len(bad) == 0 {
			if err := c.placeProbe(); err != nil {
				bad = append(bad, err.Error())
			}
		}
		if len(bad) == 0 {
			return
		}
		if time.Now().After(deadline) {
			tb.Fatalf("faultnet: cluster not healthy within 60s: %v", bad)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// StreamLastSeq returns the last sequence of stream in server i's own
// replica, from its monitoring (Jsz), and whether i holds a replica.
func (c *Cluster) StreamLastSeq(tb testing.TB, i int, stream string) (uint64, bool) {
	tb.Helper()
	jsz, err := c.Servers[i].Jsz(&server.JSzOptions{Accounts: true, Streams: true})
	if err != nil {
		tb.Fatalf("faultnet: jsz of n%d: %v", i, err)
	}
	for _, a := range jsz.AccountDetails {
		for _, s := range a.Streams {
			if s.Name == stream {
				return s.State.LastSeq, true
			}
		}
	}
	return 0, false
}

// metaPeersBehind returns why the JetStream meta leader cannot place a
// stream on every server yet: no leader, or peers it does not see online
// and current; nil when it can.
func (c *Cluster) metaPeersBehind() []string {
	leader := c.MetaLeader()
	if leader < 0 {
		return []string{"no meta leader"}
	}
	jsz, err := c.Servers[leader].Jsz(nil)
	if err != nil || jsz.Meta == nil {
		return []string{fmt.Sprintf("meta leader %s: no meta information (%v)", c.Servers[leader].Name(), err)}
	}
	var bad []string
	if len(jsz.Meta.Replicas) != len(c.Servers)-1 {
		bad = append(bad, fmt.Sprintf("meta leader %s sees %d peers, want %d", c.Servers[leader].Name(), len(jsz.Meta.Replicas), len(c.Servers)-1))
	}
	for _, p := range jsz.Meta.Replicas {
		if p.Offline || !p.Current {
			bad = append(bad, fmt.Sprintf("meta peer %s: current %v, offline %v", p.Name, p.Current, p.Offline))
		}
	}
	return bad
}

// placeProbe creates a memory stream with a replica on every server and
// deletes it again: an error says the cluster cannot place one yet.
func (c *Cluster) placeProbe() error {
	nc, err := nats.Connect(c.Servers[0].ClientURL())
	if err != nil {
		return fmt.Errorf("probe connection: %w", err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	name := "FAULTNET_PROBE_" + rand.Text() // a new name each time: re-creating one name right after deleting it can fail
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: name, Subjects: []string{"faultnet.probe." + name},
		Storage: jetstream.MemoryStorage, Replicas: len(c.Servers)}); err != nil {
		return fmt.Errorf("placing a stream with %d replicas: %w", len(c.Servers), err)
	}
	if err := js.DeleteStream(ctx, name); err != nil {
		return fmt.Errorf("deleting the probe stream: %w", err)
	}
	return nil
}
