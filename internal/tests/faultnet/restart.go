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
	c.Stop(i, lameDuck)
	c.Start(tb, i)
}

// Stop stops server i (in lame-duck mode as Restart) and returns once it
// has shut down; Start starts it again.
func (c *Cluster) Stop(i int, lameDuck bool) {
	old := c.Servers[i]
	if lameDuck {
		old.LameDuckShutdown() // returns once it has shut down
	}
	old.Shutdown()
	old.WaitForShutdown()
	if c.down == nil {
		c.down = map[int]bool{}
	}
	c.down[i] = true
}

// Start starts the servers is, stopped by Stop, again with the same
// options and storage. Once every server runs, it waits until every
// server has its routes back and JetStream is healthy; while others are
// still stopped, until the running servers have routes to each other and
// one of them leads JetStream's meta group. c.Servers[i] is the new
// server i once Start returns.
func (c *Cluster) Start(tb testing.TB, is ...int) {
	tb.Helper()
	for _, i := range is {
		s, err := server.NewServer(c.opts[i].Clone())
		if err != nil {
			tb.Fatalf("faultnet: restart nats-server n%d: %v", i, err)
		}
		tb.Cleanup(func() {
			s.Shutdown()
			s.WaitForShutdown()
		})
		go s.Start()
		c.Servers[i] = s
		delete(c.down, i)
	}
	for _, i := range is {
		if !c.Servers[i].ReadyForConnections(30 * time.Second) {
			tb.Fatalf("faultnet: restarted nats-server n%d not ready within 30s", i)
		}
	}
	running := len(c.Servers) - len(c.down)
	for j := range c.Servers {
		if !c.down[j] {
			c.WaitRoutes(tb, j, running-1)
		}
	}
	if len(c.down) == 0 {
		c.WaitHealthy(tb)
		return
	}
	for deadline := time.Now().Add(60 * time.Second); c.MetaLeader() < 0; time.Sleep(50 * time.Millisecond) {
		if time.Now().After(deadline) {
			tb.Fatalf("faultnet: no JetStream meta leader among the running servers within 60s")
		}
	}
}
