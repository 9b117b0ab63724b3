package ownership

import (
	"context"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/dispenser-dev/dispenser/internal/tests/faultnet"
	"github.com/dispenser-dev/dispenser/internal/tests/wait"
	"github.com/dispenser-dev/dispenser/testenv"
)

// heldRev is the revision of tag's lease l last wrote or adopted, and the
// expiry recorded in it; 0 if l holds no lease on tag.
func heldRev(l *Leases, tag string) (uint64, time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	h := l.owned[tag]
	if h == nil {
		return 0, time.Time{}
	}
	return h.rev, h.rec.Expires
}

// ownsWatch polls Owns(tag) densely and records what it saw.
type ownsWatch struct {
	l   *Leases
	tag string
	// mu protects the fields below.
	mu sync.Mutex
	// lastTrue is the wall time just after the last Owns that was true.
	lastTrue time.Time
	// falses counts Owns that were false; firstFalse is when the first was.
	falses     int
	firstFalse time.Time
}

func (o *ownsWatch) run(ctx context.Context) {
	for ctx.Err() == nil {
		owns := o.l.Owns(o.tag)
		now := time.Now()
		o.mu.Lock()
		if owns {
			o.lastTrue = now
		} else {
			if o.falses == 0 {
				o.firstFalse = now
			}
			o.falses++
		}
		o.mu.Unlock()
		time.Sleep(time.Millisecond)
	}
}

// TestMinorityPartitionMajorityOwnerKeepsServing isolates the node that
// leads the owners bucket's stream (and, if a few step-downs get there, the
// JetStream meta leader too), with one Leases on each node and default
// leases, for a lease and a heartbeat, just before the owners' next
// heartbeat. The owner of a tag on the majority side must never stop
// owning it: its heartbeats have to ride out the leader election. The
// owner of a tag on the isolated node must stop before its tag could be
// claimed by anyone.
func TestMinorityPartitionMajorityOwnerKeepsServing(t *testing.T) {
	c := faultnet.NewCluster(t, 3, faultnet.ClusterOptions{})
	const stream = "KV_" + DefaultBucket
	open := func(i int) *Leases {
		js, err := jetstream.New(testenv.Connect(t, c.Servers[i]))
		if err != nil {
			t.Fatal(err)
		}
		name := c.Servers[i].Name()
		s := Settings{
			Replicas: 3, Owner: name, Subject: "owner." + name,
			Logger: slog.New(slog.NewTextHandler(t.Output(), nil)).With("node", i),
		}
		// A fresh 3-replica stream sometimes leaves a first request
		// unanswered; start-up is not what this test is about.
		for try := 1; ; try++ {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			l, err := Open(ctx, js, nopServing{}, s)
			cancel()
			if err == nil {
				t.Cleanup(l.Close)
				return l
			}
			if try == 3 {
				t.Fatalf("Open(%q): %v", name, err)
			}
			t.Logf("Open(%q), try %d: %v", name, try, err)
		}
	}
	// The first Leases creates the bucket; the others start once its
	// stream has a leader that every server knows.
	ls := []*Leases{open(0)}
	c.WaitHealthy(t)
	ls = append(ls, open(1), open(2))

	// The worst case: the isolated node leads both the stream and the
	// meta group, so both need an election on the majority side.
	nc := testenv.Connect(t, c.Servers[0])
	iso := c.LeadBoth(t, nc, stream)
	if iso < 0 {
		t.Fatal("no stream leader")
	}
	maj := (iso + 1) % 3
	t.Logf("isolating n%d: stream leader; meta leader is n%d; majority owner n%d", iso, c.MetaLeader(), maj)

	// One tag owned on the majority side, one on the node to be isolated.
	const majTag, isoTag = "majority", "minority"
	for _, own := range []struct {
		l   *Leases
		tag string
	}{{ls[maj], majTag}, {ls[iso], isoTag}} {
		wait.For(t, 10*time.Second, own.l.cfg.Owner+" owns "+own.tag, func() bool {
			r, err := own.l.Claim(context.Background(), own.tag)
			if err != nil {
				t.Logf("Claim(%s) on %s: %v", own.tag, own.l.cfg.Owner, err)
			}
			return r.Self
		})
	}

	// Isolate just before the majority owner's next heartbeat: its lease
	// then has the least left, Lease - Heartbeat, to ride out the
	// election.
	rev, _ := heldRev(ls[maj], majTag)
	wait.For(t, 10*time.Second, "a heartbeat", func() bool { r, _ := heldRev(ls[maj], majTag); return r > rev })
	hb := ls[maj].cfg.Heartbeat
	time.Sleep(hb - hb/8)
	rev, _ = heldRev(ls[maj], majTag)

	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	majW, isoW := &ownsWatch{l: ls[maj], tag: majTag}, &ownsWatch{l: ls[iso], tag: isoTag}
	for _, w := range []*ownsWatch{majW, isoW} {
		wg.Add(1)
		go func() { defer wg.Done(); w.run(ctx) }()
	}
	defer func() { cancel(); wg.Wait() }()

	isolated := time.Now()
	c.Isolate(iso)
	// Log (not assert) when the majority owner renews again.
	var renewed time.Duration
	// Long enough for the isolated owner's lease to run out (its last
	// write landed before the isolation); not two leases, to keep the
	// test under 30 s.
	until := isolated.Add(ls[iso].cfg.Lease + ls[iso].cfg.Heartbeat)
	for time.Now().Before(until) {
		if r, _ := heldRev(ls[maj], majTag); renewed == 0 && r > rev {
			renewed = time.Since(isolated)
		}
		time.Sleep(20 * time.Millisecond)
	}
	cancel()
	wg.Wait()
	_, isoExpires := heldRev(ls[iso], isoTag)
	isoOwnsAtEnd := ls[iso].Owns(isoTag)
	// Heal, and wait until the isolated node has its routes back, so that
	// the releases in Cleanup land (they need the majority's leaders, not
	// a healthy cluster).
	c.Heal()
	for i := range c.Servers {
		c.WaitRoutes(t, i, 2)
	}
	t.Logf("healed %v after the isolation", time.Since(isolated))
	t.Logf("the majority owner renewed its lease %v after the isolation", renewed)

	majW.mu.Lock()
	if majW.falses > 0 {
		t.Errorf("majority owner on n%d: Owns(%s) false %d times, first %v after the isolation; want always true",
			maj, majTag, majW.falses, majW.firstFalse.Sub(isolated))
	}
	majW.mu.Unlock()

	isoW.mu.Lock()
	defer isoW.mu.Unlock()
	if isoOwnsAtEnd {
		t.Errorf("isolated owner on n%d still owns %s a lease and a heartbeat after the isolation", iso, isoTag)
	}
	// The isolated owner's fence is extended only by writes that landed;
	// a claimant counts from the newest record it reads, at least the one
	// the owner knows it wrote last.
	if isoExpires.IsZero() {
		t.Logf("isolated owner on n%d dropped its lease on %s", iso, isoTag)
	} else {
		claimable := (record{LeaseMS: ls[iso].cfg.Lease.Milliseconds(), Expires: isoExpires}).terms().ClaimableAt()
		t.Logf("isolated owner on n%d: Owns(%s) last true %v after the isolation, claimable %v after",
			iso, isoTag, isoW.lastTrue.Sub(isolated), claimable.Sub(isolated))
		if !isoW.lastTrue.Before(claimable) {
			t.Errorf("isolated owner on n%d owned %s at %s, not before it was claimable at %s",
				iso, isoTag, isoW.lastTrue.Format(time.RFC3339Nano), claimable.Format(time.RFC3339Nano))
		}
	}
}
