package chaos

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/dispenser-dev/dispenser/internal/tests/wait"
	"github.com/dispenser-dev/dispenser/testenv"
)

// Lease settings of the chaos workers: short, so that a SIGSTOP outlives a
// lease within seconds.
const (
	chaosLease     = 2 * time.Second
	chaosHeartbeat = 500 * time.Millisecond
	orderedLease   = 2 * time.Second // --ordered-lease
	chaosMaxStep   = 2000            // --max-step: small segments, many fetches and switches
)

// orderedTag is the chaos test's ordered tag; orderedClients concurrent
// clients drive it.
const (
	orderedTag     = "ordered"
	orderedClients = 4
)

// chaosSeed returns the seed of the fault schedule: DISPENSER_CHAOS_SEED or
// the clock. It logs it so that a failed run can be replayed.
func chaosSeed(tb testing.TB) uint64 {
	tb.Helper()
	seed := uint64(time.Now().UnixNano())
	if v := os.Getenv("DISPENSER_CHAOS_SEED"); v != "" {
		s, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			tb.Fatalf("DISPENSER_CHAOS_SEED=%q: %v", v, err)
		}
		seed = s
	}
	tb.Logf("chaos seed: %d (replay: DISPENSER_CHAOS_SEED=%d)", seed, seed)
	return seed
}

// chaos is the state of TestChaos: the servers, the workers and the load.
type chaos struct {
	t       *testing.T
	rng     *rand.Rand
	pg      *testenv.PostgresCluster // the primary; nil with the KV store
	replica *testenv.PostgresCluster // its streaming replica; nil once promoted, and with the KV store
	db      string                   // the database's name on both
	nats    *testenv.NATSServer
	fleet   *fleet
	nc      *nats.Conn // the test's own connection, for stats
	slots   []*proc    // the current process of each instance
	load    *load
	spender *client   // the test's own requests of tag small, to force fetches
	faults  []fault   // the faults that apply
	log     *faultLog // the faults injected
}

// A fault breaks something, waits until the system should have recovered
// and records its window in c.log.
type fault struct {
	name string
	run  func(c *chaos, name string)
}

var allFaults = []fault{
	{"sigkill", (*chaos).sigkill},
	{"sigterm", (*chaos).sigterm},
	{"sigstop", (*chaos).sigstop},
	{"sigstop-takeover", (*chaos).sigstopTakeover},
	{"pg-restart", (*chaos).pgRestart},
	{"pg-stop", (*chaos).pgStop},
	{natsRestartFault, (*chaos).natsRestart},
	{"sigkill-owner", (*chaos).sigkillOwner},
	{"sigterm-owner", (*chaos).sigtermOwner},
	{"sigstop-owner", (*chaos).sigstopOwner},
	{"pg-failover", (*chaos).pgFailover}, // once per run: it removes itself from c.faults
}

// TestChaos runs three workers against one nats-server and one PostgreSQL
// under load on three tags and snowflake, and breaks them on a seeded
// random schedule: every fault once in short mode, random faults for
// DISPENSER_CHAOS_DURATION in long mode. Then no ID may have been returned
// twice, every reply must have been IDs or 503 (500 would be a bug), IDs of
// one worker must increase per client, and after the last fault every
// worker must serve every request again, by itself. Long mode adds a run
// with the segments in JetStream KV instead of PostgreSQL (seed + 1).
func TestChaos(t *testing.T) {
	t.Parallel()
	seed := chaosSeed(t)
	t.Run("postgres", func(t *testing.T) { runChaos(t, seed, "postgres") })
	if longMode() {
		t.Run("kv", func(t *testing.T) { runChaos(t, seed+1, "kv") })
	}
}

// runChaos runs the chaos test with the segment store "postgres" or "kv".
func runChaos(t *testing.T, seed uint64, store string) {
	c := &chaos{t: t, rng: rand.New(rand.NewPCG(seed, 0xc4a05))}
	tags := map[string]int64{"small": 100, "medium": 500, "large": 2000, orderedTag: 100}
	c.nats = testenv.StartNATSServer(t)
	storeFlags := []string{"--segment-bucket", "chaos_segments"}
	if store == "postgres" {
		// A primary and its streaming replica behind one multi-host URL
		// with target_session_attrs=read-write, for pg-failover.
		c.pg, c.replica, c.db = postgresPair(t, tags, orderedTag)
		storeFlags = []string{"--postgres-url", testenv.MultiHostURL(c.db, c.pg, c.replica)}
	} else {
		createKVTags(t, c.nats.URL(), "chaos_segments", 1, tags, orderedTag)
	}
	c.fleet = newFleet(t, append(storeFlags,
		"--nats-url", c.nats.URL(),
		"--snowflake-lease", chaosLease.String(),
		"--snowflake-heartbeat", chaosHeartbeat.String(),
		"--ordered-lease", orderedLease.String(),
		"--max-step", strconv.Itoa(chaosMaxStep),
		"--shutdown-timeout", "5s",
		"--log-level", "debug", // give-backs are logged at debug
	)...)
	for i := range 3 {
		c.slots = append(c.slots, c.fleet.start(fmt.Sprintf("chaos-%d", i)))
	}
	c.nc = connect(t, c.nats.URL(), "chaos-stats")
	// Requests time out after 2 s, so that a busy machine does not fail
	// them in the quiet period; a failure counts to a fault up to the
	// timeout and a little more after it ended.
	spec := loadSpec{clients: 2, rate: 100, maxCount: 5, timeout: 2 * time.Second, seed: seed}
	for _, tag := range sortedKeys(tags) {
		if tag == orderedTag {
			spec.targets = append(spec.targets, orderedTarget(tag, orderedClients))
		} else {
			spec.targets = append(spec.targets, segmentTarget(tag))
		}
	}
	spec.targets = append(spec.targets, snowflakeTarget)
	c.load = startLoad(t, connect(t, c.nats.URL(), "chaos-load"), spec)
	c.log = &faultLog{l: c.load, grace: spec.timeout + 500*time.Millisecond}
	c.spender = c.load.newClient(segmentTarget("small"), seed+7)
	for _, f := range allFaults {
		if c.pg != nil || !strings.HasPrefix(f.name, "pg-") {
			c.faults = append(c.faults, f)
		}
	}
	time.Sleep(time.Second)

	if longMode() {
		d := 5 * time.Minute
		if v := os.Getenv("DISPENSER_CHAOS_DURATION"); v != "" {
			var err error
			if d, err = time.ParseDuration(v); err != nil {
				t.Fatalf("DISPENSER_CHAOS_DURATION=%q: %v", v, err)
			}
		}
		for end := time.Now().Add(d); time.Now().Before(end); {
			f := c.faults[c.rng.IntN(len(c.faults))]
			f.run(c, f.name)
			c.pause(500*time.Millisecond, 3*time.Second)
		}
	} else {
		faults := slices.Clone(c.faults) // pg-failover removes itself from c.faults
		for _, i := range c.rng.Perm(len(faults)) {
			f := faults[i]
			f.run(c, f.name)
			c.pause(500*time.Millisecond, 1500*time.Millisecond)
		}
	}

	// The last fault is over: after a grace period every request must
	// succeed and every worker must answer every target.
	time.Sleep(c.log.grace)
	quiet := c.load.now()
	time.Sleep(3 * time.Second)
	c.load.stop()

	table, fails := c.log.report()
	requests, ok, ids := c.load.totals()
	t.Logf("seed %d: %d requests, %d answered, %d IDs; failed requests by fault:\n%s", seed, requests, ok, ids, table)
	orderedTable, _ := c.log.reportOf(func(cl *client) bool { return cl.target.ordered })
	t.Logf("ordered tag %q (%d concurrent clients): requests and failed requests by fault:\n%s", orderedTag, orderedClients, orderedTable)
	var outside []string // the ordered tag's failures outside the faults' windows
	for _, cl := range c.load.clients {
		for _, f := range cl.fails {
			if cl.target.ordered && c.log.attribute(f.got) == "none" && len(outside) < 5 {
				outside = append(outside, fmt.Sprintf("%s sent at %.3fs, failed at %.3fs: %s", f.kind, float64(f.sent)/1e9, float64(f.got)/1e9, f.err))
			}
		}
	}
	if len(outside) > 0 {
		t.Logf("ordered tag: failures outside the faults' windows, e.g.:\n%s", strings.Join(outside, "\n"))
	}
	t.Logf("example errors: %v", c.load.firstErrors())
	c.logWorkers()
	c.log.checkEffects(t)
	c.load.check(t, c.fleet.describe)
	c.log.checkOrderedFailures(t)
	if len(fails) > 0 {
		t.Logf("failures by fault and kind: %v", fails)
	}
	if late := c.load.failuresSince(quiet); len(late) > 0 {
		t.Errorf("%d requests failed in the quiet period after the last fault, e.g. %+v", len(late), late[0])
	}
	answered := c.load.answeredSince(quiet)
	for _, tg := range spec.targets {
		if tg.ordered {
			// Only the owner answers an ordered tag (the others forward).
			if len(answered[tg.name]) == 0 {
				t.Errorf("no worker answered a %s request after the last fault", tg.name)
			}
			continue
		}
		for _, p := range c.slots {
			if !answered[tg.name][p.id] {
				t.Errorf("worker %v answered no %s request after the last fault", p, tg.name)
			}
		}
	}
}

// pick returns the index of a random worker slot.
func (c *chaos) pick() int { return c.rng.IntN(len(c.slots)) }

// pause sleeps a random duration in [lo, hi].
func (c *chaos) pause(lo, hi time.Duration) {
	time.Sleep(lo + time.Duration(c.rng.Int64N(int64(hi-lo)+1)))
}

func (c *chaos) logf(format string, args ...any) {
	c.t.Logf("%7.3fs "+format, append([]any{float64(c.load.now()) / 1e9}, args...)...)
}

// sigkill kills a worker and starts it again.
func (c *chaos) sigkill(name string) {
	i := c.pick()
	p := c.slots[i]
	w := c.log.begin(name)
	p.signal(c.t, syscall.SIGKILL)
	if !p.wait(10 * time.Second) {
		c.t.Fatalf("worker %v still runs 10s after SIGKILL", p)
	}
	if ws, ok := p.state.Sys().(syscall.WaitStatus); ok && ws.Signaled() && ws.Signal() == syscall.SIGKILL {
		c.log.observed(w, "%v killed by SIGKILL", p)
	}
	c.pause(200*time.Millisecond, 1500*time.Millisecond)
	c.slots[i] = c.fleet.start(p.instance)
	c.log.end(w)
	c.logf("%s: %v, restarted as %v", name, p, c.slots[i])
}

// sigterm stops a worker gracefully, checks that it exited cleanly after
// giving its segments and its worker ID back, and starts it again.
func (c *chaos) sigterm(name string) {
	i := c.pick()
	p := c.slots[i]
	w := c.log.begin(name)
	if effect := c.terminate(p); effect != "" {
		c.log.observed(w, "%s", effect)
	}
	c.pause(200*time.Millisecond, time.Second)
	c.slots[i] = c.fleet.start(p.instance)
	c.log.end(w)
	c.logf("%s: %v, restarted as %v", name, p, c.slots[i])
}

// terminate sends SIGTERM and checks the graceful shutdown: exit status 0,
// segments given back, lease released. It returns a description of that
// effect, or "" if it was not all observed.
func (c *chaos) terminate(p *proc) string {
	c.t.Helper()
	p.signal(c.t, syscall.SIGTERM)
	if !p.wait(20 * time.Second) {
		c.t.Fatalf("worker %v still runs 20s after SIGTERM", p)
	}
	ok := true
	if !p.state.Success() {
		ok = false
		c.t.Errorf("worker %v: %v after SIGTERM, want exit status 0; log:\n%s", p, p.state, tail(p.log, 4096))
	}
	gave := p.logged("segment: give back")
	if len(gave) == 0 {
		ok = false
		c.t.Errorf("worker %v gave no segment back on SIGTERM", p)
	}
	if len(p.logged("snowflake: released worker ID")) == 0 {
		ok = false
		c.t.Errorf("worker %v did not release its snowflake worker ID on SIGTERM", p)
	}
	done := 0
	for _, l := range gave {
		if l["done"] == true {
			done++
		}
	}
	c.logf("worker %v gave back %d segments (%d taken by the store)", p, len(gave), done)
	if !ok {
		return ""
	}
	return fmt.Sprintf("%v exited 0, gave back %d segments (%d taken), released its worker ID", p, len(gave), done)
}

// sigstop freezes a worker for longer than its lease, then thaws it; the
// worker must recover by itself.
//
// The effect to observe: the worker's lease expired in the bucket while it
// was frozen, and on waking the worker either refused requests until a
// heartbeat renewed it (a fenced episode: the requests that reached it
// wait in its socket) or renewed it before it issued again; which of the
// two comes first on waking is a race between its goroutines.
func (c *chaos) sigstop(name string) {
	p := c.slots[c.pick()]
	before := c.stats(p)
	w := c.log.begin(name)
	p.signal(c.t, syscall.SIGSTOP)
	c.pause(chaosLease+500*time.Millisecond, chaosLease+1500*time.Millisecond)
	lease, leaseErr := c.lease(before.Snowflake.WorkerID)
	p.signal(c.t, syscall.SIGCONT)
	var after *workerStats
	err := wait.Until(20*time.Second, func() error {
		st, err := statsOf(c.nc, p.id)
		if err != nil {
			return err
		}
		after = st
		if !st.Snowflake.Held || st.Snowflake.Fenced {
			return fmt.Errorf("snowflake lease: held %v, fenced %v", st.Snowflake.Held, st.Snowflake.Fenced)
		}
		return nil
	})
	c.log.end(w)
	if err != nil {
		c.t.Errorf("worker %v did not recover within 20s of SIGCONT: %v", p, err)
	}
	expired := leaseErr == nil && !lease.Released && time.Now().After(lease.Expires)
	switch {
	case !expired:
		c.t.Errorf("worker %v frozen beyond its lease, but its lease in the bucket: %+v, %v", p, lease, leaseErr)
	case after == nil:
	case after.Snowflake.FencedEpisodes > before.Snowflake.FencedEpisodes:
		c.log.observed(w, "%v: lease expired in the bucket while frozen (%v); fenced (episodes %d -> %d), then renewed", p,
			lease.Expires.Format("15:04:05.000"), before.Snowflake.FencedEpisodes, after.Snowflake.FencedEpisodes)
	case after.Snowflake.WorkerID == before.Snowflake.WorkerID && after.Snowflake.LostLeases == before.Snowflake.LostLeases:
		c.log.observed(w, "%v: lease expired in the bucket while frozen (%v); renewed it on waking before issuing", p,
			lease.Expires.Format("15:04:05.000"))
	}
	c.logf("%s: %v", name, p)
}

// leaseRecord is the part of a worker-ID lease value (see package
// snowflake) that the test reads.
type leaseRecord struct {
	Instance string    `json:"instance"`
	Expires  time.Time `json:"expires"`
	Released bool      `json:"released"`
}

// lease reads the lease of worker ID id from the bucket dispenser_workers.
func (c *chaos) lease(id int) (leaseRecord, error) {
	var rec leaseRecord
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	js, err := jetstream.New(c.nc)
	if err != nil {
		return rec, err
	}
	bucket, err := js.KeyValue(ctx, "dispenser_workers")
	if err != nil {
		return rec, err
	}
	e, err := bucket.Get(ctx, fmt.Sprintf("worker.%04d", id))
	if err != nil {
		return rec, err
	}
	return rec, json.Unmarshal(e.Value(), &rec)
}

// stats returns p's stats and fails the test if it cannot.
func (c *chaos) stats(p *proc) *workerStats {
	c.t.Helper()
	var st *workerStats
	err := wait.Until(10*time.Second, func() (err error) {
		st, err = statsOf(c.nc, p.id)
		return err
	})
	if err != nil {
		c.t.Fatalf("worker %v: %v", p, err)
	}
	return st
}

// sigstopTakeover freezes a worker until its worker ID may be claimed,
// starts a replacement with the same instance name, which takes over that
// worker ID, then thaws the old process: it must stop using the worker ID
// at once. The old process is then terminated; the replacement stays.
//
// A claimant prefers the lowest claimable worker ID last held by its
// instance name, so the victim is a worker whose ID is its instance's
// lowest so far; if there is none (long mode), the takeover is not
// checked.
func (c *chaos) sigstopTakeover(name string) {
	var cands []int
	old := map[int]int{} // slot -> its worker ID
	for i, p := range c.slots {
		st, err := statsOf(c.nc, p.id)
		if err != nil {
			c.t.Fatalf("worker %v: %v", p, err)
		}
		old[i] = st.Snowflake.WorkerID
		if ids := c.fleet.claimed(p.instance); len(ids) > 0 && slices.Min(ids) == old[i] {
			cands = append(cands, i)
		}
	}
	i, check := c.pick(), len(cands) > 0
	if check {
		i = cands[c.rng.IntN(len(cands))]
	}
	p := c.slots[i]
	before := c.stats(p)
	w := c.log.begin(name)
	p.signal(c.t, syscall.SIGSTOP)
	// A lease is claimable when both its expiry and its bound plus a lease
	// have passed: about two leases after the last heartbeat.
	c.pause(2*chaosLease+1500*time.Millisecond, 2*chaosLease+2500*time.Millisecond)
	np := c.fleet.start(p.instance)
	c.slots[i] = np
	switch {
	case !check:
		c.logf("%s: no worker holds its instance's lowest worker ID; takeover not checked", name)
	case np.workerID != old[i]:
		c.t.Errorf("replacement %v of frozen worker %v did not take over its worker ID %d (the instance held %v)",
			np, p, old[i], c.fleet.claimed(p.instance))
	}
	p.signal(c.t, syscall.SIGCONT)
	// The thawed worker must stop using the worker ID taken over and, at
	// its next heartbeat, find its key rewritten: a lost lease. Without a
	// takeover, it must at least have been fenced.
	tookOver := np.workerID == old[i]
	var after *workerStats
	err := wait.Until(20*time.Second, func() error {
		st, err := statsOf(c.nc, p.id)
		if err != nil {
			return err
		}
		after = st
		sf, was := st.Snowflake, before.Snowflake
		switch {
		case tookOver && sf.WorkerID == old[i] && !sf.Fenced:
			return fmt.Errorf("still issues as worker ID %d", old[i])
		case tookOver && sf.LostLeases == was.LostLeases:
			return fmt.Errorf("lost leases still %d: has not noticed the takeover of worker ID %d", sf.LostLeases, old[i])
		case !tookOver && sf.FencedEpisodes == was.FencedEpisodes:
			return fmt.Errorf("fenced episodes still %d", sf.FencedEpisodes)
		}
		return nil
	})
	if err != nil {
		c.t.Errorf("thawed worker %v: %v", p, err)
	} else if tookOver {
		c.log.observed(w, "%v took over worker ID %d; thawed %v lost its lease (lost leases %d -> %d, now worker ID %d)",
			np, old[i], p, before.Snowflake.LostLeases, after.Snowflake.LostLeases, after.Snowflake.WorkerID)
	} else {
		c.log.observed(w, "no takeover; thawed %v was fenced (episodes %d -> %d)",
			p, before.Snowflake.FencedEpisodes, after.Snowflake.FencedEpisodes)
	}
	c.pause(500*time.Millisecond, 1500*time.Millisecond) // both serve meanwhile
	c.terminate(p)
	c.log.end(w)
	c.logf("%s: %v replaced by %v", name, p, np)
}

// pgRestart crashes PostgreSQL (pg_ctl stop -m immediate: no shutdown
// checkpoint, crash recovery at start) and starts it again once a worker
// has seen a fetch fail. An immediate restart alone is over before any
// worker notices (the pool pings connections that idled and opens new
// ones), so the test spends segments until a fetch is made, and fails,
// while the server is down.
func (c *chaos) pgRestart(name string) {
	w := c.log.begin(name)
	if err := c.pg.Stop("immediate"); err != nil {
		c.t.Fatal(err)
	}
	c.awaitFetchFailure(w)
	if err := c.pg.Start(); err != nil {
		c.t.Fatal(err)
	}
	c.log.end(w)
	c.logf("%s", name)
}

// pgStop stops PostgreSQL for a few seconds; a worker must see a fetch
// fail meanwhile.
func (c *chaos) pgStop(name string) {
	w := c.log.begin(name)
	if err := c.pg.Stop("fast"); err != nil {
		c.t.Fatal(err)
	}
	up := time.Now().Add(3*time.Second + time.Duration(c.rng.Int64N(int64(3*time.Second))))
	c.awaitFetchFailure(w)
	time.Sleep(time.Until(up))
	if err := c.pg.Start(); err != nil {
		c.t.Fatal(err)
	}
	c.log.end(w)
	c.logf("%s", name)
}

// awaitFetchFailure takes batches of tag small (so that workers spend
// segments and fetch) until a worker reports a failed fetch, and records
// that as fault w's effect. It gives up after 30 s.
func (c *chaos) awaitFetchFailure(w int) {
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		for _, p := range c.slots {
			st, err := statsOf(c.nc, p.id)
			if err != nil {
				continue
			}
			for _, tag := range sortedKeys(st.Tags) {
				if e := st.Tags[tag].LastError; e != "" {
					c.log.observed(w, "%v: fetch of %s failed: %s", p, tag, e)
					return
				}
			}
		}
		c.spender.request(500)
	}
}

// natsRestart restarts the nats-server with the same port and store; the
// workers must reconnect by themselves.
//
// The effect to observe: every worker logs that it reconnected.
func (c *chaos) natsRestart(name string) {
	reconnects := func(p *proc) int { return len(p.logged("nats reconnected")) }
	before := map[*proc]int{}
	for _, p := range c.slots {
		before[p] = reconnects(p)
	}
	w := c.log.begin(name)
	c.nats.Stop()
	c.pause(200*time.Millisecond, 1500*time.Millisecond)
	if err := c.nats.Start(); err != nil {
		c.t.Fatal(err)
	}
	err := wait.Until(20*time.Second, func() error {
		for _, p := range c.slots {
			if _, err := statsOf(c.nc, p.id); err != nil {
				return err
			}
			if reconnects(p) == before[p] {
				return fmt.Errorf("worker %v has not logged a reconnect", p)
			}
		}
		return nil
	})
	c.log.end(w)
	if err != nil {
		c.t.Errorf("workers not back within 20s of a nats-server restart: %v", err)
	} else {
		c.log.observed(w, "all %d workers reconnected", len(c.slots))
	}
	c.logf("%s", name)
}

// logWorkers logs the state of the live workers.
func (c *chaos) logWorkers() {
	var b strings.Builder
	for _, p := range c.slots {
		st, err := statsOf(c.nc, p.id)
		if err != nil {
			fmt.Fprintf(&b, "\n%v: %v", p, err)
			continue
		}
		sf := st.Snowflake
		fmt.Fprintf(&b, "\n%v: snowflake worker %d, fenced episodes %d, lost leases %d, claims %d;", p,
			sf.WorkerID, sf.FencedEpisodes, sf.LostLeases, sf.Claims)
		for _, tag := range sortedKeys(st.Tags) {
			ts := st.Tags[tag]
			fmt.Fprintf(&b, " %s: %d fetches, step %d, %d wait timeouts;", tag, ts.Fetches, ts.Step, ts.WaitTimeouts)
		}
		o := st.Ordered
		fmt.Fprintf(&b, " ordered: owns %v, claims %d, handovers %d, losses %d, fenced refusals %d;",
			o.Owned, o.Claims, o.Handovers, o.Losses, o.FencedRefusals)
	}
	c.t.Logf("live workers:%s", b.String())
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}
