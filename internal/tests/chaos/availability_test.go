package chaos

import (
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/dispenser-dev/dispenser/internal/tests/testdb"
	"github.com/dispenser-dev/dispenser/internal/tests/wait"
	"github.com/dispenser-dev/dispenser/segment/kv"
	"github.com/dispenser-dev/dispenser/testenv"
)

// Offered load of the availability tests: per tag, two clients at 50
// requests a second of 1 to 19 IDs (10 on average): 1000 IDs a second. The
// step is 30 s of that.
const (
	availClients  = 2
	availReqRate  = 50
	availMaxCount = 19
	availRate     = availClients * availReqRate * (1 + availMaxCount) / 2 // IDs per second per tag
	availStep     = 30 * availRate
)

var availTags = map[string]int64{"orders": availStep, "users": availStep}

// availTimeout is the request timeout of the availability tests, which
// claim zero failed requests: generous, so that a busy CI machine does not
// fail a request the service answers late. availGrace is how long after a
// fault a failure still counts to it.
const (
	availTimeout = 5 * time.Second
	availGrace   = availTimeout + 500*time.Millisecond
)

func availSpec() loadSpec {
	spec := loadSpec{clients: availClients, rate: availReqRate, maxCount: availMaxCount, timeout: availTimeout, seed: 1}
	for _, tag := range sortedKeys(availTags) {
		spec.targets = append(spec.targets, segmentTarget(tag))
	}
	spec.targets = append(spec.targets, snowflakeTarget)
	return spec
}

// availFlags are the worker flags of the availability tests: the step stays
// at the tag's (about 30 s of the offered load), and the next segment is
// fetched after 1% of the current one is used, so that both buffers are
// full within a second.
func availFlags() []string {
	return []string{"--max-step", strconv.Itoa(availStep), "--prefetch-ratio", "0.01"}
}

// outageFlags are the worker flags of the database outage tests, on the
// NATS server at natsURL and PostgreSQL at dbURL.
func outageFlags(natsURL, dbURL string) []string {
	return append(availFlags(), "--nats-url", natsURL, "--postgres-url", dbURL,
		"--snowflake-lease", "2s", "--snowflake-heartbeat", "500ms",
		// A restarted worker's first request of each tag waits for that
		// tag's first fetch, right after PostgreSQL came back: on a busy
		// machine that takes longer than the default 100ms (seen in CI).
		"--max-wait", "2s")
}

// waitBuffers waits until every worker holds a current and a ready next
// segment of every tag.
func waitBuffers(tb testing.TB, nc *nats.Conn, procs []*proc) {
	tb.Helper()
	err := wait.Until(30*time.Second, func() error {
		for _, p := range procs {
			st, err := statsOf(nc, p.id)
			if err != nil {
				return err
			}
			for tag := range availTags {
				ts := st.Tags[tag]
				if ts.Current == nil || !ts.NextReady {
					return fmt.Errorf("worker %v, tag %s: current %v, next ready %v, last error %q", p, tag, ts.Current, ts.NextReady, ts.LastError)
				}
			}
		}
		return nil
	})
	if err != nil {
		tb.Fatalf("buffers not full within 30s: %v", err)
	}
}

// TestDatabaseOutage stops PostgreSQL for 10 s under load, with steps sized
// for about 30 s of the offered load: no request may fail. During the
// outage every worker is made to spend its current segment, so that it
// switches to its next one and fetches, which fails; once PostgreSQL is
// back, every worker must refill its buffers by itself.
func TestDatabaseOutage(t *testing.T) {
	t.Parallel()
	const outage = 10 * time.Second
	pg, dbURL := postgresCluster(t, availTags)
	ns := testenv.StartNATSServer(t)
	f := newFleet(t, outageFlags(ns.URL(), dbURL)...)
	var procs []*proc
	for i := range 3 {
		procs = append(procs, f.start(fmt.Sprintf("db-%d", i)))
	}
	nc := connect(t, ns.URL(), "db-stats")
	l := startLoad(t, connect(t, ns.URL(), "db-load"), availSpec())
	waitBuffers(t, nc, procs)
	warm := l.now()

	faults := &faultLog{l: l, grace: availGrace}
	w := faults.begin("postgres stopped 10s")
	down := time.Now()
	if err := pg.Stop("fast"); err != nil {
		t.Fatal(err)
	}
	time.Sleep(2 * time.Second)
	for _, tag := range sortedKeys(availTags) {
		spendCurrent(t, l, nc, procs, tag)
	}
	err := wait.Until(5*time.Second, func() error {
		for _, p := range procs {
			st, err := statsOf(nc, p.id)
			if err != nil {
				return err
			}
			for tag := range availTags {
				if ts := st.Tags[tag]; ts.NextReady || ts.LastError == "" {
					return fmt.Errorf("worker %v, tag %s: next ready %v, last error %q", p, tag, ts.NextReady, ts.LastError)
				}
			}
		}
		return nil
	})
	if err != nil {
		t.Errorf("with the database down, every worker should be fetching in vain: %v", err)
	} else {
		faults.observed(w, "every worker fetching in vain")
	}
	time.Sleep(time.Until(down.Add(outage)))
	if err := pg.Start(); err != nil {
		t.Fatal(err)
	}
	faults.end(w)
	up := time.Now()
	err = wait.Until(20*time.Second, func() error {
		for _, p := range procs {
			st, err := statsOf(nc, p.id)
			if err != nil {
				return err
			}
			for tag := range availTags {
				if ts := st.Tags[tag]; !ts.NextReady || ts.LastError != "" {
					return fmt.Errorf("worker %v, tag %s: next ready %v, last error %q", p, tag, ts.NextReady, ts.LastError)
				}
			}
		}
		return nil
	})
	if err != nil {
		t.Errorf("workers did not refill their buffers within 20s of the database's return: %v", err)
	}
	t.Logf("buffers refilled %v after the database returned", time.Since(up).Round(100*time.Millisecond))
	time.Sleep(2 * time.Second)
	l.stop()

	table, _ := faults.report()
	requests, ok, ids := l.totals()
	t.Logf("%d requests, %d answered, %d IDs:\n%s", requests, ok, ids, table)
	faults.checkEffects(t)
	if failed := failedAfterWarmUp(t, l, warm); len(failed) > 0 {
		t.Errorf("%d requests failed with the database down for %v, want 0; e.g. %+v; error replies by worker: %v", len(failed), outage, failed[0], l.failedBy(f.describe))
	}
	l.check(t, f.describe)
}

// TestRestartDuringDatabaseOutage restarts a worker while PostgreSQL is
// down, as a deployment or a crash loop may. The two other workers hold
// segments for far longer than the outage, so the service as a whole could
// serve every request; but the new worker has no segments and cannot fetch
// any, and if it takes its share of segment requests anyway, those fail.
// No request may fail, and once PostgreSQL is back the new worker must
// serve every tag.
func TestRestartDuringDatabaseOutage(t *testing.T) {
	t.Parallel()
	pg, dbURL := postgresCluster(t, availTags)
	ns := testenv.StartNATSServer(t)
	f := newFleet(t, outageFlags(ns.URL(), dbURL)...)
	var procs []*proc
	for i := range 3 {
		procs = append(procs, f.start(fmt.Sprintf("restart-%d", i)))
	}
	nc := connect(t, ns.URL(), "restart-stats")
	l := startLoad(t, connect(t, ns.URL(), "restart-load"), availSpec())
	waitBuffers(t, nc, procs)
	warm := l.now()

	faults := &faultLog{l: l, grace: availGrace}
	w := faults.begin("worker restarted, postgres down")
	if err := pg.Stop("fast"); err != nil {
		t.Fatal(err)
	}
	time.Sleep(time.Second)
	old := procs[0]
	old.signal(t, syscall.SIGTERM)
	if !old.wait(20 * time.Second) {
		t.Fatalf("worker %v still runs 20s after SIGTERM", old)
	}
	// If it fetched last for a tag, it could not give its segments back
	// (the database is down), which only wastes IDs; otherwise the witness
	// refuses the give-back without asking the database. Either way the
	// README promises exit status 0. (TestExitZeroWhenGiveBackAndReleaseFail
	// makes both the give-back and the lease release fail for certain.)
	gaveBack := "no give-back needed the database"
	if len(old.logged("segments not given back; their unissued IDs are skipped")) > 0 {
		gaveBack = "its give-back failed"
	}
	if !old.state.Success() {
		t.Errorf("worker %v: %v after SIGTERM with the database down (%s), want exit status 0; log:\n%s", old, old.state, gaveBack, tail(old.log, 4096))
	} else {
		faults.observed(w, "%v exited 0 (%s)", old, gaveBack)
	}
	procs[0] = f.start(old.instance)
	time.Sleep(4 * time.Second)
	if err := pg.Start(); err != nil {
		t.Fatal(err)
	}
	faults.end(w)
	// The event itself, not a fixed pause after PostgreSQL's start: the
	// new worker holds segments of every tag again.
	waitBuffers(t, nc, procs[:1])
	since := l.now()
	time.Sleep(2 * time.Second)
	l.stop()

	table, _ := faults.report()
	requests, ok, ids := l.totals()
	t.Logf("%d requests, %d answered, %d IDs:\n%s", requests, ok, ids, table)
	faults.checkEffects(t)
	if failed := failedAfterWarmUp(t, l, warm); len(failed) > 0 {
		t.Errorf("%d of %d requests failed while a worker started with the database down and two workers had full buffers, want 0; e.g. %+v; error replies by worker: %v",
			len(failed), requests, failed[0], l.failedBy(f.describe))
	}
	answered := l.answeredSince(since)
	for _, tg := range l.spec.targets {
		if !answered[tg.name][procs[0].id] {
			t.Errorf("worker %v, started during the outage, answered no %s request after it", procs[0], tg.name)
		}
	}
	l.check(t, f.describe)
}

// spendCurrent takes IDs of tag until every worker has handed out the rest
// of the current segment it held when called, so that it has switched to
// its next segment and must fetch another. Requests go to random workers,
// so a worker that is done gets more until the last one is: small batches
// keep that overshoot (about sqrt(rest*batch)) far below a segment.
func spendCurrent(tb testing.TB, l *load, nc *nats.Conn, procs []*proc, tag string) {
	tb.Helper()
	const batch = 500
	left := map[string]int64{}
	for _, p := range procs {
		st, err := statsOf(nc, p.id)
		if err != nil {
			tb.Fatal(err)
		}
		cur := st.Tags[tag].Current
		if cur == nil {
			tb.Fatalf("worker %v has no segment of %s", p, tag)
		}
		left[p.id] = cur.End - cur.Cursor
	}
	c := l.newClient(segmentTarget(tag), 2)
	done := 0
	for i := 0; done < len(procs); i++ {
		if i == 10000 {
			tb.Fatalf("%s: workers still hold IDs of their current segment after %d requests: %v", tag, i, left)
		}
		if !c.request(batch) {
			continue // counted as a failure
		}
		r := c.replies[len(c.replies)-1]
		id := l.workerID(r.worker)
		left[id] -= int64(r.n)
		if left[id] <= 0 && left[id]+int64(r.n) > 0 {
			done++
		}
	}
	var over []string
	for _, p := range procs {
		over = append(over, strconv.FormatInt(-left[p.id], 10))
	}
	tb.Logf("%s: spent the current segments of all workers in %d requests; overshoot %s IDs", tag, len(c.replies), strings.Join(over, ", "))
}

// TestNATSClusterFailover runs three workers on a cluster of three
// nats-servers, with the lease bucket and the segment store (JetStream KV)
// replicated three times, and stops each server in turn for 3 s under
// load. No worker may lose its snowflake lease, no ID may be returned
// twice, and requests may fail only while clients reconnect: timeouts and
// no-responders during a server's absence, never an error reply.
func TestNATSClusterFailover(t *testing.T) {
	t.Parallel()
	cl := testenv.StartNATSCluster(t, 3)
	createKVTags(t, cl.URLs(), kv.DefaultBucket, 3, availTags)
	nc := connect(t, cl.URLs(), "cluster-stats")
	f := newFleet(t, append(availFlags(), "--nats-url", cl.URLs(),
		"--segment-replicas", "3", "--snowflake-replicas", "3",
		// Twice the default lease: on a busy machine the stream leader
		// elections of a rolling restart stalled heartbeats for more than
		// 10s (seen in CI: the worker fenced, snowflake answered 503).
		"--snowflake-lease", "20s", "--snowflake-heartbeat", "1s")...)
	var procs []*proc
	for i := range 3 {
		procs = append(procs, f.start(fmt.Sprintf("cluster-%d", i)))
	}
	l := startLoad(t, connect(t, cl.URLs(), "cluster-load"), availSpec())
	waitBuffers(t, nc, procs)
	warm := l.now()

	// The effect of stopping a server: a client connected to it, here one
	// connected to each server on purpose, reconnects to another.
	var watchers []*atomic.Int64
	for i, node := range cl.Nodes {
		urls := []string{node.URL()}
		for j, other := range cl.Nodes {
			if j != i {
				urls = append(urls, other.URL())
			}
		}
		n := &atomic.Int64{}
		watchers = append(watchers, n)
		wc, err := nats.Connect(strings.Join(urls, ","), nats.DontRandomize(), nats.MaxReconnects(-1),
			nats.ReconnectWait(100*time.Millisecond), nats.ReconnectHandler(func(*nats.Conn) { n.Add(1) }))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(wc.Close)
		if got := wc.ConnectedUrl(); got != node.URL() {
			t.Fatalf("watcher of %s connected to %s", node.Opts.ServerName, got)
		}
	}

	faults := &faultLog{l: l, grace: availGrace}
	for i, node := range cl.Nodes {
		w := faults.begin(fmt.Sprintf("%s stopped", node.Opts.ServerName))
		before := watchers[i].Load()
		node.Stop()
		time.Sleep(3 * time.Second)
		if err := node.Start(); err != nil {
			t.Fatal(err)
		}
		cl.WaitHealthy(t)
		if err := wait.Until(20*time.Second, func() error {
			if watchers[i].Load() == before {
				return fmt.Errorf("the client connected to %s did not reconnect", node.Opts.ServerName)
			}
			return nil
		}); err == nil {
			faults.observed(w, "a client connected to %s reconnected to another server", node.Opts.ServerName)
		}
		faults.end(w)
		t.Logf("server %d back at %.1fs", i, float64(l.now())/1e9)
		time.Sleep(500 * time.Millisecond)
	}
	time.Sleep(2 * time.Second)
	l.stop()

	table, fails := faults.report()
	requests, ok, ids := l.totals()
	t.Logf("%d requests, %d answered, %d IDs; failed requests by stopped server:\n%s", requests, ok, ids, table)
	t.Logf("example errors: %v", l.firstErrors())
	faults.checkEffects(t)
	for fault, byKind := range fails {
		for kind, n := range byKind {
			if fault != "none" && (kind == "500" || kind == "503") {
				t.Errorf("%s: %d requests failed with error %s, want only failures while clients reconnect", fault, n, kind)
			}
		}
	}
	for _, fl := range failedAfterWarmUp(t, l, warm) {
		if faults.attribute(fl.got) == "none" {
			t.Errorf("a request failed while all servers ran: %+v", fl)
		}
	}
	var leases []string
	for _, p := range procs {
		st, err := statsOf(nc, p.id)
		if err != nil {
			t.Errorf("worker %v: %v", p, err)
			continue
		}
		sf := st.Snowflake
		leases = append(leases, fmt.Sprintf("%v: worker ID %d, claims %d, lost %d, fenced episodes %d, heartbeat failures %d",
			p, sf.WorkerID, sf.Claims, sf.LostLeases, sf.FencedEpisodes, sf.HeartbeatFailures))
		if sf.WorkerID != p.workerID || sf.LostLeases != 0 || sf.Claims != 1 {
			t.Errorf("worker %v lost its lease: worker ID %d (at start %d), %d claims, %d lost leases",
				p, sf.WorkerID, p.workerID, sf.Claims, sf.LostLeases)
		}
	}
	t.Logf("leases:\n%s", strings.Join(leases, "\n"))
	l.check(t, f.describe)
}

// TestSustainedLoad measures the maximum rate of single-ID requests that
// the harness gets from three workers, then offers 80% of it for 10 s (60 s
// in long mode). No request may fail, and the workers' resident memory
// must stay flat: at the end at most twice that at the start plus 20 MB.
// It does not run in parallel with the other tests, which would skew the
// measurement.
func TestSustainedLoad(t *testing.T) {
	measure, sustain := 2*time.Second, 10*time.Second
	if longMode() {
		measure, sustain = 10*time.Second, 60*time.Second
	}
	dbURL := testenv.Postgres(t)
	testdb.Setup(t, dbURL, map[string]int64{"orders": 1000, "users": 1000})
	ns := testenv.StartNATSServer(t)
	f := newFleet(t, "--nats-url", ns.URL(), "--postgres-url", dbURL)
	var procs []*proc
	for i := range 3 {
		procs = append(procs, f.start(fmt.Sprintf("sustained-%d", i)))
	}
	nc := connect(t, ns.URL(), "sustained-load")
	targets := []target{segmentTarget("orders"), segmentTarget("users"), snowflakeTarget}
	const clients = 4 // per target

	m := startLoad(t, nc, loadSpec{targets: targets, clients: clients, timeout: availTimeout, seed: 3})
	time.Sleep(500 * time.Millisecond)
	n0, t0 := m.answered.Load(), time.Now()
	time.Sleep(measure)
	maxRate := float64(m.answered.Load()-n0) / time.Since(t0).Seconds()
	m.stop()
	m.check(t, f.describe)

	// Twice the clients at a paced rate: each has slack to keep its pace.
	rate := 0.8 * maxRate
	perClient := rate / float64(2*clients*len(targets))
	s := startLoad(t, nc, loadSpec{targets: targets, clients: 2 * clients, rate: perClient, timeout: availTimeout, seed: 4})
	time.Sleep(time.Second)
	rssStart := map[*proc]int64{}
	for _, p := range procs {
		rssStart[p] = p.rss(t)
	}
	n1, t1 := s.answered.Load(), time.Now()
	time.Sleep(sustain)
	achieved := float64(s.answered.Load()-n1) / time.Since(t1).Seconds()
	var rss []string
	for _, p := range procs {
		start, end := rssStart[p], p.rss(t)
		rss = append(rss, fmt.Sprintf("%v: %.1f MB -> %.1f MB", p, float64(start)/(1<<20), float64(end)/(1<<20)))
		if end > 2*start+20<<20 {
			t.Errorf("worker %v: resident size grew from %d to %d bytes in %v of steady load", p, start, end, sustain)
		}
	}
	s.stop()
	requests, ok, ids := s.totals()
	t.Logf("maximum %.0f requests/s; offered %.0f/s (80%%) for %v, achieved %.0f/s: %d requests, %d IDs; resident size:\n%s",
		maxRate, rate, sustain, achieved, requests, ids, strings.Join(rss, "\n"))
	if requests != ok {
		t.Errorf("%d of %d requests failed under sustained load; e.g. %v", requests-ok, requests, s.firstErrors())
	}
	// The claim is that the workers keep up with 80% of the maximum: the
	// rate achieved must be the rate offered, give or take a margin for a
	// busy machine (the paced clients do not catch up after a stall).
	if achieved < sustainedShare*rate {
		t.Errorf("achieved %.0f requests/s of the %.0f/s offered (80%% of the maximum %.0f/s), want at least %.0f%% of it",
			achieved, rate, maxRate, 100*sustainedShare)
	}
	s.check(t, f.describe)
}

// sustainedShare is the share of the offered rate that TestSustainedLoad
// must achieve.
const sustainedShare = 0.9

// failedAfterWarmUp returns the failures of requests sent at or after warm
// (nanoseconds since the load started) and logs how many failed before:
// until its buffers are warm, a worker fetches a tag's first segment on the
// tag's first request, and a busy machine may take longer than --max-wait
// for that (503, as documented). The zero-failure claims are about warm
// workers.
func failedAfterWarmUp(tb testing.TB, l *load, warm int64) []failure {
	tb.Helper()
	var before int
	for _, c := range l.clients {
		for _, f := range c.fails {
			if f.sent < warm {
				before++
			}
		}
	}
	if before > 0 {
		tb.Logf("%d requests failed while the buffers warmed up (not counted)", before)
	}
	return l.failuresSince(warm)
}

// TestExitZeroWhenGiveBackAndReleaseFail stops a worker with SIGTERM after
// its nats-server went away: giving its segments back (to the JetStream KV
// store) and releasing its snowflake lease both fail. They only save IDs
// and time for a successor, so the README promises exit status 0 all the
// same.
func TestExitZeroWhenGiveBackAndReleaseFail(t *testing.T) {
	t.Parallel()
	ns := testenv.StartNATSServer(t)
	createKVTags(t, ns.URL(), kv.DefaultBucket, 1, map[string]int64{"orders": 100})
	f := newFleet(t, "--nats-url", ns.URL(), "--shutdown-timeout", "5s")
	p := f.start("exit-0")
	nc := connect(t, ns.URL(), "exit-0")
	var got string
	err := wait.Until(30*time.Second, func() error {
		resp, err := nc.Request("id.segment.orders", nil, 5*time.Second)
		if err != nil {
			return err
		}
		got = string(resp.Data)
		return nil
	})
	if err != nil || got != "1" {
		t.Fatalf("first ID: %q, %v; want 1", got, err)
	}
	nc.Close()
	ns.Stop()
	p.signal(t, syscall.SIGTERM)
	if !p.wait(60 * time.Second) {
		t.Fatalf("worker %v still runs 60s after SIGTERM", p)
	}
	for _, msg := range []string{
		"segments not given back; their unissued IDs are skipped",
		"snowflake lease not released; a successor waits for it to expire",
	} {
		if len(p.logged(msg)) == 0 {
			t.Errorf("worker %v did not log %q; log:\n%s", p, msg, tail(p.log, 4096))
		}
	}
	if !p.state.Success() {
		t.Errorf("worker %v: %v after SIGTERM with NATS down, want exit status 0; log:\n%s", p, p.state, tail(p.log, 4096))
	}
}
