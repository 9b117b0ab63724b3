package faultnet_test

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/dispenser-dev/dispenser/internal/faultnet"
	"github.com/dispenser-dev/dispenser/testenv"
)

// TestClusterIsolateStreamLeader isolates the node leading a 3-replica KV
// bucket's stream: the isolated node's routes go down, the majority
// elects a leader and accepts a revision-checked update that the isolated
// replica does not see, and after the heal the isolated replica catches
// up.
func TestClusterIsolateStreamLeader(t *testing.T) {
	c := faultnet.NewCluster(t, 3, faultnet.ClusterOptions{})
	ctx := context.Background()
	js, err := jetstream.New(testenv.Connect(t, c.Servers[0]))
	if err != nil {
		t.Fatal(err)
	}
	testenv.CreateKeyValue(t, js, jetstream.KeyValueConfig{Bucket: "faultnet", Replicas: 3})
	const stream = "KV_faultnet"
	info, err := js.Stream(ctx, stream)
	if err != nil {
		t.Fatal(err)
	}
	names := []string{c.Servers[0].Name(), c.Servers[1].Name(), c.Servers[2].Name()}
	iso := slices.Index(names, info.CachedInfo().Cluster.Leader)
	if iso < 0 {
		t.Fatalf("stream leader %q is none of %v", info.CachedInfo().Cluster.Leader, names)
	}
	major := (iso + 1) % 3
	mjs, err := jetstream.New(testenv.Connect(t, c.Servers[major]))
	if err != nil {
		t.Fatal(err)
	}
	kv, err := mjs.KeyValue(ctx, "faultnet")
	if err != nil {
		t.Fatal(err)
	}
	rev, err := kv.Put(ctx, "k", []byte("v1"))
	if err != nil {
		t.Fatal(err)
	}

	start := time.Now()
	c.Isolate(iso)
	// The majority elects a new leader and takes a revision-checked update.
	var newRev uint64
	for deadline := start.Add(30 * time.Second); ; {
		uctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		newRev, err = kv.Update(uctx, "k", []byte("v2"), rev)
		cancel()
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("update on the majority (n%d) with n%d isolated: still failing after 30s: %v", major, iso, err)
		}
	}
	t.Logf("n%d (stream leader) isolated: first update on the majority after %v", iso, time.Since(start))
	c.WaitRoutes(t, iso, 0)
	t.Logf("n%d reports no routes after %v", iso, time.Since(start))
	if seq, ok := c.StreamLastSeq(t, iso, stream); !ok || seq >= newRev {
		t.Fatalf("isolated n%d's replica: last seq %d (replica %v); want one below the majority's update (%d)", iso, seq, ok, newRev)
	}

	healed := time.Now()
	c.Heal()
	for i := range c.Servers {
		c.WaitRoutes(t, i, 2)
	}
	t.Logf("routes back on every node %v after the heal", time.Since(healed))
	for deadline := healed.Add(30 * time.Second); ; {
		if seq, _ := c.StreamLastSeq(t, iso, stream); seq >= newRev {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("n%d's replica did not catch up to seq %d within 30s of the heal", iso, newRev)
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Logf("n%d's replica caught up %v after the heal", iso, time.Since(healed))
	ijs, err := jetstream.New(testenv.Connect(t, c.Servers[iso]))
	if err != nil {
		t.Fatal(err)
	}
	ikv, err := ijs.KeyValue(ctx, "faultnet")
	if err != nil {
		t.Fatal(err)
	}
	e, err := ikv.Get(ctx, "k")
	if err != nil || string(e.Value()) != "v2" || e.Revision() != newRev {
		t.Fatalf("read through n%d after the heal: %v; want v2 at revision %d", iso, err, newRev)
	}
}
