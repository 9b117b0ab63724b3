package faultnet

import (
	"testing"
	"time"

	"github.com/nats-io/nats.go"
)

// StreamLeader returns the index of the server leading stream (of the
// global account), or -1 while it has none.
func (c *Cluster) StreamLeader(stream string) int {
	for i, s := range c.Servers {
		if s.JetStreamIsStreamLeader("$G", stream) {
			return i
		}
	}
	return -1
}

// MetaLeader returns the index of the JetStream meta leader, or -1.
func (c *Cluster) MetaLeader() int {
	for i, s := range c.Servers {
		if s.JetStreamIsLeader() {
			return i
		}
	}
	return -1
}

// LeadBoth steps stream's leader down, a few times at most, until one
// server leads both the stream and the meta group (the worst node to
// isolate: both need an election on the majority side), and returns the
// stream's leader, which may not lead the meta group if the step-downs did
// not get there. nc is a connection to the cluster.
func (c *Cluster) LeadBoth(tb testing.TB, nc *nats.Conn, stream string) int {
	tb.Helper()
	waitLeader := func() {
		tb.Helper()
		for deadline := time.Now().Add(30 * time.Second); c.StreamLeader(stream) < 0; time.Sleep(5 * time.Millisecond) {
			if time.Now().After(deadline) {
				tb.Fatalf("faultnet: stream %s has no leader within 30s", stream)
			}
		}
	}
	waitLeader()
	for try := 0; try < 6 && c.StreamLeader(stream) != c.MetaLeader(); try++ {
		if _, err := nc.Request("$JS.API.STREAM.LEADER.STEPDOWN."+stream, nil, 5*time.Second); err != nil {
			tb.Logf("faultnet: stream leader step-down: %v", err)
		}
		waitLeader()
	}
	return c.StreamLeader(stream)
}
