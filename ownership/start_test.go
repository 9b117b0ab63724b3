package ownership

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/dispenser-dev/dispenser/internal/kvbucket"
	"github.com/dispenser-dev/dispenser/internal/tests/faultnet"
	"github.com/dispenser-dev/dispenser/internal/tests/wait"
	"github.com/dispenser-dev/dispenser/testenv"
)

// TestOpenWaitsForMetaLeader starts Leases while JetStream has no meta
// leader, as a worker restarted during a fault did (chaos TestPartitions:
// "bucket dispenser_owners: watch: context deadline exceeded"): the owners
// bucket (one replica) and its server answer, so opening and reading it
// work, but its watch needs a consumer, which cannot be created until two
// of the three servers run again. Open logs that it waits for the watch
// and returns once the servers are back.
func TestOpenWaitsForMetaLeader(t *testing.T) {
	c := faultnet.NewCluster(t, 3, faultnet.ClusterOptions{})
	js0, err := jetstream.New(testenv.Connect(t, c.Servers[0]))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := kvbucket.Open(context.Background(), js0, jetstream.KeyValueConfig{Bucket: DefaultBucket, History: 1}, nil); err != nil {
		t.Fatal(err)
	}
	leader := -1
	wait.For(t, 30*time.Second, "a leader of the owners' stream", func() bool {
		leader = c.StreamLeader("KV_" + DefaultBucket)
		return leader >= 0
	})
	var others []int
	for i := range c.Servers {
		if i != leader {
			others = append(others, i)
			c.Stop(i, false)
		}
	}
	js, err := jetstream.New(testenv.Connect(t, c.Servers[leader]))
	if err != nil {
		t.Fatal(err)
	}
	logs := &testenv.LogBuffer{}
	type result struct {
		l   *Leases
		err error
	}
	done := make(chan result, 1)
	go func() {
		l, err := Open(context.Background(), js, nopServing{}, Settings{Owner: "w", Subject: "owner.w", Logger: logs.Logger()})
		done <- result{l, err}
	}()
	wait.For(t, 60*time.Second, "a logged wait for the watch", func() bool {
		select {
		case r := <-done:
			t.Fatalf("Open returned before waiting for JetStream: %v", r.err)
		default:
		}
		for line := range strings.Lines(logs.String()) {
			if strings.Contains(line, "JetStream not ready; waiting") && strings.Contains(line, `for="bucket \"dispenser_owners\": watch"`) {
				return true
			}
		}
		return false
	})
	c.Start(t, others...)
	select {
	case r := <-done:
		if r.err != nil {
			t.Fatalf("Open after the servers came back: %v\nlog:\n%s", r.err, logs)
		}
		r.l.Close()
	case <-time.After(5 * time.Minute):
		t.Fatal("Open did not return")
	}
}
