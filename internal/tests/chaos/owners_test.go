package chaos

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/dispenser-dev/dispenser/internal/tests/check"
	"github.com/dispenser-dev/dispenser/internal/tests/wait"
	"github.com/dispenser-dev/dispenser/protocol"
	"github.com/dispenser-dev/dispenser/segment/kv"
	"github.com/dispenser-dev/dispenser/tagmodel"
	"github.com/dispenser-dev/dispenser/testenv"
)

// TestOrderedOwnerChanges is the chaos mode of ordered tags: short leases,
// owners changing every second or two under load, and a tag switched from
// plain to ordered and back while its clients run. TestChaos missed the
// window in which a worker that has just claimed a tag already counts as
// its owner but has not yet dropped what it held of the tag: its ordered
// tag is ordered from the start (so no worker ever holds a plain segment
// of it), its owner changes three times a run, twice by killing the owner
// (whose buffers die with it), and the window is a few microseconds long.
// Here every worker serves the tag as plain before each switch, so each
// holds segments below what the owners serve afterwards; ownership then
// moves among the workers that still hold them, by SIGSTOP, SIGTERM and
// SIGKILL of the owner, some of the moves while the logs of the workers
// that may claim the tag are stalled (logPipe), which holds the claimant
// in the log line between taking the tag and dropping its buffers.
//
// Each ordered phase is checked from the moment the switch has settled
// (every worker has forwarded a request, and the owner serves from a
// segment above the tag's max_id as it was then: above every plain
// segment) until the switch back: for any request A answered before B was
// sent, max(A) < min(B). Over the whole run: no ID twice, per-worker
// increase, only 503 or timeouts as failures, every fault's effect seen,
// no failure once the faults are over.
//
// Short mode: 30 s of cycles with one seed. Long mode
// (DISPENSER_CHAOS_LONG): DISPENSER_CHAOS_DURATION (default 5m) of cycles,
// three seeds in turn.
func TestOrderedOwnerChanges(t *testing.T) {
	t.Parallel()
	seed := chaosSeed(t)
	d, runs := 30*time.Second, 1
	if longMode() {
		d, runs = 5*time.Minute, 3
		if v := os.Getenv("DISPENSER_CHAOS_DURATION"); v != "" {
			var err error
			if d, err = time.ParseDuration(v); err != nil {
				t.Fatalf("DISPENSER_CHAOS_DURATION=%q: %v", v, err)
			}
		}
	}
	for i := range runs {
		s := seed + uint64(i)
		t.Run(fmt.Sprintf("seed-%d", s), func(t *testing.T) { runOwnerChanges(t, s, d) })
	}
}

// Settings of the owner-changes mode.
const (
	switchedTag     = "switched"             // switched between plain and ordered
	switchedClients = 8                      // concurrent clients of it
	switchedRate    = 150                    // requests per second per client
	switchedLease   = 400 * time.Millisecond // --ordered-lease
	switchedRefresh = 200 * time.Millisecond // --refresh-interval: switches spread fast
	switchedMaxStep = 200                    // --max-step: segments spent in well under a second
)

// ownerChaos is the state of one run of TestOrderedOwnerChanges.
type ownerChaos struct {
	t      *testing.T
	rng    *rand.Rand
	store  *kv.Store // the workers' segment store, to switch the tag
	fleet  *fleet
	nc     *nats.Conn // the test's own connection, for stats
	slots  []*proc
	load   *load
	log    *faultLog
	phases []orderedPhase
}

// orderedPhase is one period in which the tag was ordered; times since
// load start.
type orderedPhase struct {
	switched int64 // the tag was made ordered
	settled  int64 // the switch had settled: replies are checked from here
	end      int64 // the tag was made plain again (0: never settled)
	maxID    int64 // the tag's max_id once every worker had seen the switch
	owners   []string
}

func runOwnerChanges(t *testing.T, seed uint64, d time.Duration) {
	c := &ownerChaos{t: t, rng: rand.New(rand.NewPCG(seed, 0x0dde5))}
	srv := testenv.StartNATSServer(t)
	createKVTags(t, srv.URL(), "chaos_segments", 1, map[string]int64{switchedTag: 100})
	c.nc = connect(t, srv.URL(), "owners-stats")
	js, err := jetstream.New(c.nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	c.store, err = kv.New(ctx, js, kv.Settings{Bucket: "chaos_segments"})
	cancel()
	if err != nil {
		t.Fatal(err)
	}
	c.fleet = newFleet(t,
		"--nats-url", srv.URL(),
		"--segment-bucket", "chaos_segments",
		"--snowflake=false",
		"--ordered-lease", switchedLease.String(),
		"--refresh-interval", switchedRefresh.String(),
		"--max-step", strconv.Itoa(switchedMaxStep),
		"--shutdown-timeout", "5s",
	)
	c.fleet.pipeLogs = true
	for i := range 3 {
		c.slots = append(c.slots, c.fleet.start(fmt.Sprintf("owners-%d", i)))
	}
	spec := loadSpec{clients: switchedClients, rate: switchedRate, maxCount: 3, timeout: 2 * time.Second, seed: seed,
		targets: []target{segmentTarget(switchedTag)}} // checked by phase, not as an ordered target
	c.load = startLoad(t, connect(t, srv.URL(), "owners-load"), spec)
	c.log = &faultLog{l: c.load, grace: spec.timeout + 500*time.Millisecond}

	for end := time.Now().Add(d); time.Now().Before(end); {
		c.pause(300*time.Millisecond, 800*time.Millisecond) // plain: every worker fetches segments
		ph := c.makeOrdered()
		if ph.settled == 0 {
			break // reported
		}
		for range 1 + c.rng.IntN(3) {
			faults := []func(){c.sigstopOwner, c.sigtermOwner, c.sigkillOwner, c.stalledClaim}
			faults[c.rng.IntN(len(faults))]()
			if c.t.Failed() {
				break
			}
		}
		c.makePlain(ph)
		if c.t.Failed() {
			break
		}
	}

	time.Sleep(c.log.grace)
	quiet := c.load.now()
	time.Sleep(2 * time.Second)
	c.load.stop()

	table, _ := c.log.report()
	requests, ok, ids := c.load.totals()
	t.Logf("seed %d: %d requests, %d answered, %d IDs; failed requests by fault:\n%s", seed, requests, ok, ids, table)
	c.log.checkEffects(t)
	c.load.check(t, c.fleet.describe)
	c.checkPhases()
	c.checkFailures()
	if late := c.load.failuresSince(quiet); len(late) > 0 {
		t.Errorf("%d requests failed after the faults were over, e.g. %+v", len(late), late[0])
	}
}

func (c *ownerChaos) pause(lo, hi time.Duration) {
	time.Sleep(lo + time.Duration(c.rng.Int64N(int64(hi-lo)+1)))
}

func (c *ownerChaos) logf(format string, args ...any) {
	c.t.Logf("%7.3fs "+format, append([]any{float64(c.load.now()) / 1e9}, args...)...)
}

// setOrdered switches the tag in the store.
func (c *ownerChaos) setOrdered(ordered bool) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := c.store.UpdateTag(ctx, switchedTag, tagmodel.Update{Ordered: &ordered}); err != nil {
		c.t.Fatalf("switching %s to ordered=%v: %v", switchedTag, ordered, err)
	}
}

// owner returns the live process among c.slots, other than skip, that owns
// the tag by its stats, and its stats.
func (c *ownerChaos) owner(skip *proc) (*proc, *workerStats, error) {
	for _, p := range c.slots {
		if p == skip {
			continue // perhaps frozen: its stats would only time out
		}
		st, err := statsOf(c.nc, p.id)
		if err == nil && slices.Contains(st.Ordered.Owned, switchedTag) {
			return p, st, nil
		}
	}
	return nil, nil, fmt.Errorf("no worker but %v owns %s", skip, switchedTag)
}

// awaitOwner waits up to 20 s for a live owner other than skip.
func (c *ownerChaos) awaitOwner(skip *proc) (owner *proc, st *workerStats, err error) {
	err = wait.Until(20*time.Second, func() (err error) {
		owner, st, err = c.owner(skip)
		return err
	})
	return owner, st, err
}

// makeOrdered makes the tag ordered and waits until the switch has settled:
// every worker has seen it (it forwarded a request since, or owns the tag),
// and the owner serves from a segment that starts at or above the tag's
// max_id read after that, so above every segment fetched as plain. The
// promise of an ordered tag holds for requests sent from then on. The
// phase's settled time stays 0 if it did not settle within 20 s.
func (c *ownerChaos) makeOrdered() *orderedPhase {
	forwarded := map[*proc]uint64{}
	for _, p := range c.slots {
		forwarded[p] = c.stats(p).Forwarded
	}
	w := c.log.begin("switch-to-ordered")
	c.setOrdered(true)
	c.phases = append(c.phases, orderedPhase{switched: c.load.now()})
	ph := &c.phases[len(c.phases)-1]
	err := wait.Until(20*time.Second, func() error {
		for _, p := range c.slots {
			st, err := statsOf(c.nc, p.id)
			if err != nil {
				return err
			}
			if st.Forwarded == forwarded[p] && !slices.Contains(st.Ordered.Owned, switchedTag) {
				return fmt.Errorf("worker %v has neither forwarded a request nor claimed the tag since the switch", p)
			}
		}
		return nil
	})
	if err != nil {
		c.log.end(w)
		c.t.Errorf("switch to ordered: %v within 20s", err)
		return ph
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	tag, err := c.store.Tag(ctx, switchedTag)
	cancel()
	if err != nil {
		c.t.Fatal(err)
	}
	ph.maxID = tag.MaxID
	var owner *proc
	var start int64
	err = wait.Until(20*time.Second, func() error {
		p, st, err := c.owner(nil)
		if err != nil {
			return err
		}
		owner = p
		if cur := st.Tags[switchedTag].Current; cur != nil {
			start = cur.Start
		}
		if start < ph.maxID {
			return fmt.Errorf("owner %v serves from a segment starting at %d, below max_id %d", p, start, ph.maxID)
		}
		return nil
	})
	c.log.end(w)
	if err != nil {
		c.t.Errorf("switch to ordered did not settle within 20s: %v", err)
		return ph
	}
	ph.settled = c.load.now()
	ph.owners = append(ph.owners, owner.String())
	c.log.observed(w, "every worker saw it; owner %v serves from %d, max_id was %d", owner, start, ph.maxID)
	c.logf("%s is ordered; settled with owner %v", switchedTag, owner)
	return ph
}

// makePlain makes the tag plain again and waits until no worker owns it
// (the owner releases it at its next heartbeat).
func (c *ownerChaos) makePlain(ph *orderedPhase) {
	ph.end = c.load.now()
	w := c.log.begin("switch-to-plain")
	c.setOrdered(false)
	err := wait.Until(20*time.Second, func() error {
		if p, _, err := c.owner(nil); err == nil {
			return fmt.Errorf("%v still owns %s", p, switchedTag)
		}
		return nil
	})
	c.log.end(w)
	if err != nil {
		c.t.Errorf("switch to plain: %v within 20s", err)
		return
	}
	c.log.observed(w, "no worker owns %s any more", switchedTag)
}

// stats returns p's stats and fails the test if it cannot.
func (c *ownerChaos) stats(p *proc) *workerStats {
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

// current returns the owner and its slot, failing the test if there is
// none.
func (c *ownerChaos) current() (int, *proc) {
	c.t.Helper()
	p, _, err := c.awaitOwner(nil)
	if err != nil {
		c.t.Fatalf("%v within 20s", err)
	}
	return slices.Index(c.slots, p), p
}

// tookOver records the new owner in the current phase.
func (c *ownerChaos) tookOver(np *proc) {
	ph := &c.phases[len(c.phases)-1]
	ph.owners = append(ph.owners, np.String())
}

// sigstopOwner freezes the owner until another worker has taken the tag
// over, then thaws it; it must no longer own the tag.
func (c *ownerChaos) sigstopOwner() {
	const name = "sigstop-owner"
	i, p := c.current()
	w := c.log.begin(name)
	p.signal(c.t, syscall.SIGSTOP)
	np, st, err := c.awaitOwner(p)
	p.signal(c.t, syscall.SIGCONT)
	thawed := wait.Until(20*time.Second, func() error {
		s, err := statsOf(c.nc, p.id)
		if err != nil {
			return err
		}
		if slices.Contains(s.Ordered.Owned, switchedTag) && np != nil && np != p {
			return fmt.Errorf("%v still owns %s, which %v took over", p, switchedTag, np)
		}
		return nil
	})
	c.log.end(w)
	switch {
	case err != nil:
		c.t.Errorf("%s: %v within 20s of freezing the owner", name, err)
	case thawed != nil:
		c.t.Errorf("%s: thawed owner: %v", name, thawed)
	default:
		c.tookOver(np)
		c.log.observed(w, "%v frozen; %v took over (claims %d); thawed, no longer owns it", p, np, st.Ordered.Claims)
	}
	c.logf("%s: slot %d %v; %v owns %s", name, i, p, np, switchedTag)
}

// sigtermOwner stops the owner gracefully (it releases the tag, another
// worker claims it at once) and starts it again.
func (c *ownerChaos) sigtermOwner() {
	const name = "sigterm-owner"
	i, p := c.current()
	w := c.log.begin(name)
	p.signal(c.t, syscall.SIGTERM)
	np, st, err := c.awaitOwner(p)
	if !p.wait(20 * time.Second) {
		c.t.Fatalf("worker %v still runs 20s after SIGTERM", p)
	}
	c.slots[i] = c.fleet.start(p.instance)
	c.log.end(w)
	switch {
	case err != nil:
		c.t.Errorf("%s: %v within 20s of stopping the owner", name, err)
	case !p.state.Success():
		c.t.Errorf("%s: %v exited with %v", name, p, p.state)
	default:
		c.tookOver(np)
		c.log.observed(w, "%v exited 0; %v took over (claims %d)", p, np, st.Ordered.Claims)
	}
	c.logf("%s: %v, restarted as %v; %v owns %s", name, p, c.slots[i], np, switchedTag)
}

// sigkillOwner kills the owner and starts it again; another worker takes
// the tag over once the lease has expired.
func (c *ownerChaos) sigkillOwner() {
	const name = "sigkill-owner"
	i, p := c.current()
	w := c.log.begin(name)
	p.signal(c.t, syscall.SIGKILL)
	if !p.wait(10 * time.Second) {
		c.t.Fatalf("worker %v still runs 10s after SIGKILL", p)
	}
	c.slots[i] = c.fleet.start(p.instance)
	np, st, err := c.awaitOwner(p)
	c.log.end(w)
	ws, _ := p.state.Sys().(syscall.WaitStatus)
	switch {
	case err != nil:
		c.t.Errorf("%s: %v within 20s of killing the owner", name, err)
	case !ws.Signaled() || ws.Signal() != syscall.SIGKILL:
		c.t.Errorf("%s: %v ended with %v", name, p, p.state)
	default:
		c.tookOver(np)
		c.log.observed(w, "%v killed; %v took over (claims %d)", p, np, st.Ordered.Claims)
	}
	c.logf("%s: %v, restarted as %v; %v owns %s", name, p, c.slots[i], np, switchedTag)
}

// ownerRecord is the part of an ordered tag's lease (see package
// ownership) that the test reads.
type ownerRecord struct {
	Owner    string `json:"owner"` // instance name, "-", a token
	Released bool   `json:"released"`
}

// lease reads the tag's lease from the bucket dispenser_owners.
func (c *ownerChaos) lease() (ownerRecord, error) {
	var rec ownerRecord
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	js, err := jetstream.New(c.nc)
	if err != nil {
		return rec, err
	}
	bucket, err := js.KeyValue(ctx, "dispenser_owners")
	if err != nil {
		return rec, err
	}
	e, err := bucket.Get(ctx, switchedTag)
	if err != nil {
		return rec, err
	}
	return rec, json.Unmarshal(e.Value(), &rec)
}

// stalledClaim stalls the logs of every worker but the owner, freezes the
// owner until one of them has claimed the tag (its lease names another
// owner), keeps the stall a little longer (requests reach the claimant
// meanwhile), then ends it and thaws the old owner. The effect: a thread
// of the claimant was blocked writing its log while the stall lasted, and
// a live worker other than the old owner owns the tag afterwards.
func (c *ownerChaos) stalledClaim() {
	const name = "stalled-claim"
	i, p := c.current()
	old, err := c.lease()
	if err != nil {
		c.t.Fatalf("%s: %v", name, err)
	}
	var stalled []*proc
	w := c.log.begin(name)
	for _, q := range c.slots {
		if q == p {
			continue
		}
		if err := q.pipe.stall(10 * time.Second); err != nil {
			c.t.Fatalf("%s: stalling the log of %v: %v", name, q, err)
		}
		stalled = append(stalled, q)
	}
	p.signal(c.t, syscall.SIGSTOP)
	var claimant *proc
	claimed := wait.Until(20*time.Second, func() error {
		rec, err := c.lease()
		if err != nil {
			return err
		}
		if rec.Owner == old.Owner || rec.Released {
			return fmt.Errorf("the lease still names %s (released %v)", rec.Owner, rec.Released)
		}
		for _, q := range stalled {
			if strings.HasPrefix(rec.Owner, q.instance+"-") {
				claimant = q
				return nil
			}
		}
		return fmt.Errorf("the lease names %s, none of %v", rec.Owner, stalled)
	})
	c.pause(100*time.Millisecond, 500*time.Millisecond)
	blocked := 0
	if claimant != nil {
		blocked = blockedWriting(claimant.cmd.Process.Pid)
	}
	for _, q := range stalled {
		q.pipe.resume()
	}
	p.signal(c.t, syscall.SIGCONT)
	np, st, err := c.awaitOwner(p)
	c.log.end(w)
	switch {
	case claimed != nil:
		c.t.Errorf("%s: no claim within 20s of freezing the owner %v: %v", name, p, claimed)
	case err != nil:
		c.t.Errorf("%s: %v within 20s of the stall's end", name, err)
	case blocked == 0:
		c.t.Errorf("%s: claimant %v had no thread blocked writing its stalled log", name, claimant)
	default:
		c.tookOver(np)
		c.log.observed(w, "logs of %v stalled (pipes full); %v frozen; %v claimed the tag with %d thread(s) blocked writing its log; %v owns it (claims %d)",
			stalled, p, claimant, blocked, np, st.Ordered.Claims)
	}
	c.logf("%s: slot %d %v frozen; %v claimed, %v owns %s", name, i, p, claimant, np, switchedTag)
}

// checkPhases checks each ordered phase for linearizable increase, over the
// requests sent after it settled and answered before it ended.
func (c *ownerChaos) checkPhases() {
	total, bad := 0, 0
	for k, ph := range c.phases {
		if ph.settled == 0 || ph.end == 0 {
			continue
		}
		var obs []check.Observation
		for i, cl := range c.load.clients {
			for _, r := range cl.replies {
				if r.sent < ph.settled || r.got > ph.end {
					continue
				}
				obs = append(obs, c.load.observation(i, cl, r))
			}
		}
		total += len(obs)
		n, examples := check.Linearizable(obs)
		if n > 0 {
			bad++
			who := func(o check.Observation) string {
				return fmt.Sprintf("%s, %s, during %s", o.Client, c.fleet.describe(o.Worker), c.log.attribute(int64(o.End.Sub(c.load.t0))))
			}
			c.t.Errorf("ordered phase %d (%.3fs-%.3fs, owners %s, max_id %d at the switch): %d of %d requests broke linearizable increase:\n%s",
				k, float64(ph.settled)/1e9, float64(ph.end)/1e9, strings.Join(ph.owners, " -> "), ph.maxID, n, len(obs), c.load.examples(examples, who))
		}
	}
	c.t.Logf("%d ordered phases, %d requests checked for linearizable increase, %d phases broke it", len(c.phases), total, bad)
	if total == 0 {
		c.t.Errorf("no request checked for linearizable increase")
	}
}

// checkFailures fails the test for a failed request other than 503 or a
// timeout.
func (c *ownerChaos) checkFailures() {
	bad := map[string]int{}
	for _, cl := range c.load.clients {
		for _, f := range cl.fails {
			if f.kind != protocol.CodeUnavailable && f.kind != "timeout" {
				bad[f.kind+" during "+c.log.attribute(f.got)]++
			}
		}
	}
	if len(bad) > 0 {
		c.t.Errorf("requests failed otherwise than with 503 or a timeout: %v; e.g. %v", bad, c.load.firstErrors())
	}
}
