package faultnet

import (
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
)

// Restart stops server i, in lame-duck mode if lameDuck is set (it stops
// accepting clients, hands its JetStream leaderships over, then closes its
// clients over LameDuckDuration, as the NATS Helm chart's preStop hook
// does), starts it again with the same options and storage, and waits
// until every server has its routes back and JetStream is healthy.
func (c *Cluster) Restart(tb testing.TB, i int, lameDuck bool) {
	tb.Helper()
	old := c.Servers[i]
	if lameDuck {
		old.LameDuckShutdown() // returns once it has shut down
	}
	old.Shutdown()
	old.WaitForShutdown()
	s, err := server.NewServer(c.opts[i].Clone())
	if err != nil {
		tb.Fatalf("faultnet: restart nats-server n%d: %v", i, err)
	}
	tb.Cleanup(func() {
		s.Shutdown()
		s.WaitForShutdown()
	})
	go s.Start()
	if !s.ReadyForConnections(30 * time.Second) {
		tb.Fatalf("faultnet: restarted nats-server n%d not ready within 30s", i)
	}
	c.Servers[i] = s
	for j := range c.Servers {
		c.WaitRoutes(tb, j, len(c.Servers)-1)
	}
	c.WaitHealthy(tb)
}
