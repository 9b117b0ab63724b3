package faultnet

import (
	"fmt"
	"net"
	"net/url"
	"strconv"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"

	"github.com/dispenser-dev/dispenser/testenv"
)

// SuperCluster is a NATS supercluster on 127.0.0.1: one embedded
// nats-server with JetStream (sync_interval: always) per region, each a
// cluster of its own named "r0", "r1", …, joined by gateways, every
// gateway connection through a faultnet link. Links[i][j] carries the
// gateway connection that region i dials to region j.
type SuperCluster struct {
	Servers []*server.Server
	Links   [][]*Link
	Net     *Net
}

// RegionName is the cluster (and gateway) name of region i.
func RegionName(i int) string { return "r" + strconv.Itoa(i) }

// NewSuperCluster starts one server per region, gateways between all of
// them through links with latency (each way, with a tenth of it as
// jitter), waits until every gateway is up and JetStream has a meta
// leader, and shuts everything down in Cleanup. Servers ping clients and
// gateways every second, so that a cut is noticed within seconds.
func NewSuperCluster(tb testing.TB, regions int, latency time.Duration) *SuperCluster {
	tb.Helper()
	sc := &SuperCluster{Net: New(tb), Links: make([][]*Link, regions)}
	ports := make([]int, regions)
	for i := range ports {
		p, err := testenv.ServerPort()
		if err != nil {
			tb.Fatal(err)
		}
		ports[i] = p
	}
	for i := range regions {
		sc.Links[i] = make([]*Link, regions)
		for j := range regions {
			if i != j {
				l := sc.Net.Link(tb, fmt.Sprintf("gateway-%s-%s", RegionName(i), RegionName(j)), net.JoinHostPort("127.0.0.1", strconv.Itoa(ports[j])))
				if latency > 0 {
					l.Latency(Both, latency, latency/10)
				}
				sc.Links[i][j] = l
			}
		}
	}
	for i := range regions {
		opts := testenv.NATSOptions(tb.TempDir())
		opts.ServerName = RegionName(i) + "-n0"
		opts.SyncAlways = true
		opts.PingInterval, opts.MaxPingsOut = time.Second, MaxPingsOut
		// A cluster of one: JetStream in a supercluster needs configured
		// routes, so the server has one to an address where nothing
		// listens.
		opts.Cluster = server.ClusterOpts{Name: RegionName(i), Host: "127.0.0.1", Port: server.RANDOM_PORT, Advertise: deadRoute}
		opts.Routes = []*url.URL{{Scheme: "nats-route", Host: deadRoute}}
		opts.Gateway = server.GatewayOpts{
			Name:      RegionName(i),
			Host:      "127.0.0.1",
			Port:      ports[i],
			Advertise: deadRoute, // gossiped gateway URLs lead nowhere: no connection bypasses the links
		}
		for j := range regions {
			if i != j {
				opts.Gateway.Gateways = append(opts.Gateway.Gateways, &server.RemoteGatewayOpts{
					Name: RegionName(j), URLs: []*url.URL{{Scheme: "nats", Host: sc.Links[i][j].Addr()}},
				})
			}
		}
		s, err := server.NewServer(opts)
		if err != nil {
			tb.Fatalf("faultnet: nats-server of %s: %v", RegionName(i), err)
		}
		sc.Servers = append(sc.Servers, s)
		tb.Cleanup(func() {
			s.Shutdown()
			s.WaitForShutdown()
		})
	}
	tb.Cleanup(sc.Heal) // before the servers shut down (Cluster's cleanup says why)
	for _, s := range sc.Servers {
		go s.Start()
	}
	for _, s := range sc.Servers {
		if !s.ReadyForConnections(30 * time.Second) {
			tb.Fatalf("faultnet: nats-server %s not ready within 30s", s.Name())
		}
	}
	sc.WaitGateways(tb)
	deadline := time.Now().Add(60 * time.Second)
	for {
		var bad []string
		for _, s := range sc.Servers {
			if h := s.Healthz(nil); h.Status != "ok" {
				bad = append(bad, fmt.Sprintf("%s: %s %s", s.Name(), h.Status, h.Error))
			}
		}
		if len(bad) == 0 && sc.metaLeader() >= 0 {
			return sc
		}
		if time.Now().After(deadline) {
			tb.Fatalf("faultnet: supercluster not healthy within 60s: %v (meta leader %d)", bad, sc.metaLeader())
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// metaLeader returns the index of the server that leads the JetStream meta
// group, or -1.
func (sc *SuperCluster) metaLeader() int {
	for i, s := range sc.Servers {
		if s.JetStreamIsLeader() {
			return i
		}
	}
	return -1
}

// WaitGateways waits until every server has outbound and inbound gateway
// connections to every other region, at most 60 s.
func (sc *SuperCluster) WaitGateways(tb testing.TB) {
	tb.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		var bad []string
		for i, s := range sc.Servers {
			gz, err := s.Gatewayz(&server.GatewayzOptions{})
			if err != nil {
				tb.Fatalf("faultnet: gatewayz of %s: %v", RegionName(i), err)
			}
			if len(gz.OutboundGateways) != len(sc.Servers)-1 || len(gz.InboundGateways) != len(sc.Servers)-1 {
				bad = append(bad, fmt.Sprintf("%s: %d outbound, %d inbound", RegionName(i), len(gz.OutboundGateways), len(gz.InboundGateways)))
			}
		}
		if len(bad) == 0 {
			return
		}
		if time.Now().After(deadline) {
			tb.Fatalf("faultnet: gateways not all up within 60s: %v", bad)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// CutRegion black-holes every gateway link to and from region i, both
// ways: the region goes on alone.
func (sc *SuperCluster) CutRegion(i int) {
	for j := range sc.Servers {
		if j != i {
			sc.Links[i][j].BlackHole(Both)
			sc.Links[j][i].BlackHole(Both)
		}
	}
}

// HealCuts removes the black holes; latency stays. It waits until the
// gateways are up again.
func (sc *SuperCluster) HealCuts(tb testing.TB) {
	tb.Helper()
	for _, row := range sc.Links {
		for _, l := range row {
			if l != nil {
				if err := l.remove(BlackHoleFault); err != nil {
					tb.Fatal(err)
				}
			}
		}
	}
	sc.WaitGateways(tb)
}

// Heal removes every fault from every link.
func (sc *SuperCluster) Heal() {
	for _, row := range sc.Links {
		for _, l := range row {
			if l != nil {
				l.Heal()
			}
		}
	}
}
