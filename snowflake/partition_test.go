package snowflake

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/dispenser-dev/dispenser/internal/tests/faultnet"
	"github.com/dispenser-dev/dispenser/internal/tests/wait"
	"github.com/dispenser-dev/dispenser/testenv"
)

// issuer drives AppendIDs on one worker in a loop and records what it got.
type issuer struct {
	w *Node
	// mu protects the fields below.
	mu       sync.Mutex
	ids      []int64
	failures int
	firstErr error
	// lastOK is the wall time just after the last AppendIDs that issued.
	lastOK time.Time
}

func (is *issuer) run(ctx context.Context) {
	for ctx.Err() == nil {
		ids, err := is.w.AppendIDs(nil, 4)
		now := time.Now()
		is.mu.Lock()
		if err != nil {
			is.failures++
			if is.firstErr == nil {
				is.firstErr = err
			}
		} else {
			is.ids = append(is.ids, ids...)
			is.lastOK = now
		}
		is.mu.Unlock()
		time.Sleep(2 * time.Millisecond)
	}
}

// TestMinorityPartitionMajorityKeepsIssuing isolates the node that leads
// the lease bucket's stream (and, if a few step-downs get there, the
// JetStream meta leader too), with one worker on each node and default
// leases, for a lease and two heartbeats. The workers on the majority side must never be
// fenced: their heartbeats have to ride out the leader election. The
// worker on the isolated node must stop issuing before its worker ID
// could be claimed by anyone. No ID is issued twice.
func TestMinorityPartitionMajorityKeepsIssuing(t *testing.T) {
	c := faultnet.NewCluster(t, 3, faultnet.ClusterOptions{})
	const stream = "KV_" + DefaultBucket
	start := func(i int) *Node {
		js, err := jetstream.New(testenv.Connect(t, c.Servers[i]))
		if err != nil {
			t.Fatal(err)
		}
		s := NodeSettings{Replicas: 3, Instance: c.Servers[i].Name(), Settings: Settings{Logger: testLogger(t).With("node", i)}}
		// A fresh 3-replica stream sometimes leaves a first request
		// unanswered, and a cluster just up may not place one yet (no
		// suitable peers); start-up is not what this test is about, so
		// it is tried again until it succeeds, for at most 60 s.
		deadline := time.Now().Add(60 * time.Second)
		for try := 1; ; try++ {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			w, err := Start(ctx, js, s)
			cancel()
			if err == nil {
				t.Cleanup(func() {
					ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
					defer cancel()
					if err := w.Close(ctx); err != nil {
						t.Errorf("Close(%q): %v", s.Instance, err)
					}
				})
				return w
			}
			if time.Now().After(deadline) {
				t.Fatalf("Start(%q): %v", s.Instance, err)
			}
			t.Logf("Start(%q), try %d: %v", s.Instance, try, err)
			time.Sleep(200 * time.Millisecond)
		}
	}
	// The first worker creates the bucket; the others start once its
	// stream has a leader that every server knows.
	workers := []*Node{start(0)}
	c.WaitHealthy(t)
	workers = append(workers, start(1), start(2))

	// The worst case: the isolated node leads both the stream and the
	// meta group, so both need an election on the majority side.
	nc := testenv.Connect(t, c.Servers[0])
	iso := c.LeadBoth(t, nc, stream)
	if iso < 0 {
		t.Fatal("no stream leader")
	}
	t.Logf("isolating n%d: stream leader; meta leader is n%d", iso, c.MetaLeader())

	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	issuers := make([]*issuer, len(workers))
	before := make([]NodeStats, len(workers))
	for i, w := range workers {
		issuers[i] = &issuer{w: w}
		before[i] = w.stats()
		wg.Add(1)
		go func() { defer wg.Done(); issuers[i].run(ctx) }()
	}
	defer func() { cancel(); wg.Wait() }()

	// Isolate just before the next heartbeat of every worker (they were
	// started within a fraction of a second): the leases then have the
	// least left, Lease - Heartbeat, to ride out the election.
	hb := workers[(iso+1)%3].stats().Heartbeats
	wait.For(t, 30*time.Second, "a heartbeat", func() bool { return workers[(iso+1)%3].stats().Heartbeats > hb })
	time.Sleep(DefaultHeartbeat - DefaultHeartbeat/8)
	for i, w := range workers {
		before[i] = w.stats()
	}
	isolated := time.Now()
	c.Isolate(iso)
	// Log (not assert) when each majority worker renews again.
	renewed := map[int]time.Duration{}
	// Long enough for the isolated worker's lease to run out; not two
	// leases, to keep the test under 30 s.
	until := isolated.Add(DefaultLease + 2*DefaultHeartbeat)
	for time.Now().Before(until) {
		for i, w := range workers {
			if _, ok := renewed[i]; !ok && i != iso && w.stats().Heartbeats > before[i].Heartbeats {
				renewed[i] = time.Since(isolated)
			}
		}
		time.Sleep(50 * time.Millisecond)
	}
	cancel()
	wg.Wait()
	c.Heal()
	for i := range c.Servers {
		c.WaitRoutes(t, i, 2)
	}
	c.WaitHealthy(t)
	// The workers' releases in Cleanup must land: wait for the event
	// itself, a write to the lease bucket answered through every server
	// (a healthy cluster still left a release unanswered, "no response
	// from stream", right after the heal).
	for i := range c.Servers {
		js, err := jetstream.New(testenv.Connect(t, c.Servers[i]))
		if err != nil {
			t.Fatal(err)
		}
		deadline := time.Now().Add(30 * time.Second)
		for {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			kv, err := js.KeyValue(ctx, DefaultBucket)
			if err == nil {
				_, err = kv.Put(ctx, "probe", nil)
			}
			cancel()
			if err == nil {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("the lease bucket takes no write through n%d 30 s after the heal: %v", i, err)
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	for i, d := range renewed {
		t.Logf("n%d's worker renewed its lease %v after the isolation", i, d)
	}

	var all []int64
	for i, is := range issuers {
		after := workers[i].stats()
		is.mu.Lock()
		all = append(all, is.ids...)
		t.Logf("n%d: %d IDs, %d refusals (first: %v), fenced episodes %d -> %d, heartbeat failures %d -> %d",
			i, len(is.ids), is.failures, is.firstErr, before[i].FencedEpisodes, after.FencedEpisodes,
			before[i].HeartbeatFailures, after.HeartbeatFailures)
		if i != iso {
			if is.failures > 0 || after.FencedEpisodes != before[i].FencedEpisodes {
				t.Errorf("majority worker on n%d: %d AppendIDs refused (first: %v), fenced episodes %d -> %d; want none",
					i, is.failures, is.firstErr, before[i].FencedEpisodes, after.FencedEpisodes)
			}
		} else {
			if !errors.Is(is.firstErr, ErrFenced) {
				t.Errorf("minority worker on n%d: first refusal %v; want ErrFenced within a lease of isolation", i, is.firstErr)
			}
			rec := leaseRecord{LeaseMS: DefaultLease.Milliseconds(), Expires: after.LeaseExpires, Bound: after.Bound}
			if claimable := rec.claimableAt(); !is.lastOK.Before(claimable) {
				t.Errorf("minority worker on n%d issued at %s, not before its worker ID was claimable at %s",
					i, is.lastOK.Format(TimeLayout), claimable.Format(TimeLayout))
			}
		}
		is.mu.Unlock()
	}
	requireUnique(t, all)
}
