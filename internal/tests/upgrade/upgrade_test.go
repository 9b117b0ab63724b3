package upgrade

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"

	"github.com/dispenser-dev/dispenser/client"
	"github.com/dispenser-dev/dispenser/dispenser"
	"github.com/dispenser-dev/dispenser/internal/tests/check"
	"github.com/dispenser-dev/dispenser/internal/tests/faultnet"
	"github.com/dispenser-dev/dispenser/internal/tests/procs"
	"github.com/dispenser-dev/dispenser/internal/tests/wait"
	"github.com/dispenser-dev/dispenser/protocol"
	"github.com/dispenser-dev/dispenser/testenv"
)

// longMode reports whether DISPENSER_UPGRADE_LONG asks for the long run.
func longMode() bool { return os.Getenv("DISPENSER_UPGRADE_LONG") != "" }

// proc is one worker process of one version.
type proc struct {
	name    string // "w<node>/<version>#<n>"
	version string // "previous" or "current"
	cmd     *exec.Cmd
	log     string
	id      string // micro service ID, from its "serving" log line
	done    chan struct{}
	state   *os.ProcessState // set when done is closed
}

// run runs a one-shot command of bin (migrate, tags) and returns its
// output.
func run(tb testing.TB, bin string, args ...string) string {
	tb.Helper()
	cmd := exec.Command(bin, args...)
	cmd.Env = procs.WorkerEnv()
	out, err := cmd.CombinedOutput()
	if err != nil {
		tb.Fatalf("%s %s: %v\n%s", filepath.Base(filepath.Dir(bin)), strings.Join(args, " "), err, out)
	}
	return string(out)
}

// fleet is the worker processes of the test, one per node at a time.
type fleet struct {
	tb    testing.TB
	dir   string
	c     *faultnet.Cluster
	pgURL string
	mu    sync.Mutex
	procs []*proc // every process started
}

func newFleet(tb testing.TB, c *faultnet.Cluster, pgURL string) *fleet {
	f := &fleet{tb: tb, dir: tb.TempDir(), c: c, pgURL: pgURL}
	tb.Cleanup(func() {
		for _, p := range f.all() {
			select {
			case <-p.done:
				continue
			default:
			}
			p.cmd.Process.Kill()
			<-p.done
		}
		for _, p := range f.all() {
			b, _ := os.ReadFile(p.log)
			if bytes.Contains(b, []byte("panic:")) || bytes.Contains(b, []byte("fatal error:")) {
				tb.Errorf("%s panicked; log %s:\n%s", p.name, p.log, tail(p.log, 8192))
			}
			// The current version adopts its own landed renewal
			// (ownership.TestReleaseAfterALandedRenewal); the previous
			// one did not.
			if bytes.Contains(b, []byte("ownership: release failed")) {
				if p.version == "current" {
					tb.Errorf("%s: an ordered tag's release failed; log %s:\n%s", p.name, p.log, tail(p.log, 4096))
				} else {
					tb.Logf("%s (previous version): an ordered tag's release failed (its race with the heartbeat)", p.name)
				}
			}
		}
		if tb.Failed() {
			for _, p := range f.all() {
				tb.Logf("---- log of %s (%s), last 4 KB:\n%s", p.name, p.log, tail(p.log, 4096))
			}
		}
	})
	return f
}

func (f *fleet) all() []*proc {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.procs)
}

// start starts a worker of bin on node and waits until it serves (its
// "serving" log line: it is in the queue groups).
func (f *fleet) start(bin, version string, node int) *proc {
	f.tb.Helper()
	f.mu.Lock()
	n := len(f.procs) + 1
	f.mu.Unlock()
	p := &proc{name: fmt.Sprintf("w%d/%s#%d", node, version, n), version: version, done: make(chan struct{})}
	p.log = filepath.Join(f.dir, fmt.Sprintf("%02d-w%d-%s.log", n, node, version))
	lf, err := os.Create(p.log)
	if err != nil {
		f.tb.Fatal(err)
	}
	defer lf.Close()
	// Its own node first; the others to move to in lame-duck mode. Only
	// flags both versions know.
	// A restarted server listens on another port: read them now.
	urls := []string{f.c.Servers[node].ClientURL()}
	for i, s := range f.c.Servers {
		if i != node {
			urls = append(urls, s.ClientURL())
		}
	}
	p.cmd = exec.Command(bin, "serve",
		"--nats-url", strings.Join(urls, ","), "--postgres-url", f.pgURL,
		"--instance", fmt.Sprintf("w%d", node), "--log-format", "json",
		"--snowflake-replicas", "3", "--ordered-replicas", "3", "--witness-replicas", "3",
		"--max-wait", "2s",
		// A release by a worker of the previous version can fail when it
		// races the heartbeat it cancels ("ownership: release failed"),
		// leaving the tag without an owner for two leases: 10 s, not the
		// default 30 s, which the retrying clients' 30 s would not ride out.
		"--ordered-lease", "5s")
	p.cmd.Env = procs.WorkerEnv()
	p.cmd.Stdout, p.cmd.Stderr = lf, lf
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL} // should the test die
	if err := p.cmd.Start(); err != nil {
		f.tb.Fatalf("starting %s: %v", p.name, err)
	}
	go func() {
		p.cmd.Wait()
		p.state = p.cmd.ProcessState
		close(p.done)
	}()
	f.mu.Lock()
	f.procs = append(f.procs, p)
	f.mu.Unlock()
	for deadline := time.Now().Add(60 * time.Second); p.id == ""; {
		for _, l := range procs.LogLines(p.log) {
			if l["msg"] == "serving" {
				p.id, _ = l["id"].(string)
			}
		}
		if p.id != "" {
			break
		}
		select {
		case <-p.done:
			f.tb.Fatalf("%s exited before serving (%v); log:\n%s", p.name, p.state, tail(p.log, 4096))
		case <-time.After(20 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			f.tb.Fatalf("%s not serving within 60 s; log:\n%s", p.name, tail(p.log, 4096))
		}
	}
	return p
}

// serviceID returns the worker's micro service ID now: a worker that moved
// to another server (lame-duck mode) serves under a new one, in its log
// line "moved".
func (p *proc) serviceID() string {
	id := p.id
	for _, l := range procs.LogLines(p.log) {
		if l["msg"] == "moved" {
			if v, ok := l["id"].(string); ok {
				id = v
			}
		}
	}
	return id
}

// stop sends SIGTERM and waits for a clean exit.
func (f *fleet) stop(p *proc) {
	f.tb.Helper()
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		f.tb.Fatalf("SIGTERM to %s: %v", p.name, err)
	}
	select {
	case <-p.done:
	case <-time.After(60 * time.Second):
		f.tb.Fatalf("%s did not exit within 60 s of SIGTERM", p.name)
	}
	if !p.state.Success() {
		f.tb.Errorf("%s exited with %v; log:\n%s", p.name, p.state, tail(p.log, 4096))
	}
}

// tail returns at most the last n bytes of file name.
func tail(name string, n int) string {
	b, err := os.ReadFile(name)
	if err != nil {
		return err.Error()
	}
	if len(b) > n {
		b = b[len(b)-n:]
	}
	return string(b)
}

// statsOf returns how many requests the worker with micro service ID id
// has had on each endpoint, and the ordered tags it owns.
func statsOf(nc *nats.Conn, id string) (requests map[string]int, owned []string, err error) {
	msg, err := nc.Request("$SRV.STATS."+dispenser.Name+"."+id, nil, 5*time.Second)
	if err != nil {
		return nil, nil, fmt.Errorf("stats of %s: %w", id, err)
	}
	var st micro.Stats
	if err := json.Unmarshal(msg.Data, &st); err != nil {
		return nil, nil, fmt.Errorf("stats of %s: %w", id, err)
	}
	requests = map[string]int{}
	for _, e := range st.Endpoints {
		requests[e.Name] += e.NumRequests
		if e.Name == "segment" {
			var d struct {
				Ordered struct {
					Owned []string `json:"owned"`
				} `json:"ordered"`
			}
			if err := json.Unmarshal(e.Data, &d); err != nil {
				return nil, nil, fmt.Errorf("segment stats of %s: %w", id, err)
			}
			owned = d.Ordered.Owned
		}
	}
	return requests, owned, nil
}

// subjects of the load: a plain tag, an ordered tag, snowflake IDs.
var subjects = []string{"plain", "orders", "snowflake"}

// requester asks for one ID at a time as the clients a rolling upgrade
// and its rollback serve: those of before the upgrade (clients are
// upgraded after the workers, and rolled back before them: operations.md)
// such as the previous version's Go client, a client of another language
// or the nats CLI. A plain request on the service's subject: no reply
// token, no direct subject. With retries it follows the Go client's
// policy: an attempt without a reply within client.AttemptTimeout, no
// responders or a 503 is sent again after a short backoff (5 ms doubling
// to 200 ms) until 30 s are over; without, it fails at its first failure
// or after 5 s.
type requester struct {
	nc      *nats.Conn
	retries bool
}

// errUnavailable is a 503 reply.
var errUnavailable = errors.New("503")

func (r requester) id(subject string) (int64, error) {
	timeout := 5 * time.Second
	if r.retries {
		timeout = 30 * time.Second
	}
	deadline := time.Now().Add(timeout)
	backoff := 5 * time.Millisecond
	for {
		attempt := time.Until(deadline)
		if r.retries {
			attempt = min(attempt, client.AttemptTimeout)
		}
		msg, err := r.nc.Request(subject, nil, attempt)
		if err == nil {
			if code := msg.Header.Get(micro.ErrorCodeHeader); code == protocol.CodeUnavailable {
				err = fmt.Errorf("%w: %s", errUnavailable, msg.Header.Get(micro.ErrorHeader))
			} else if code != "" {
				return 0, fmt.Errorf("%s: %s", code, msg.Header.Get(micro.ErrorHeader))
			} else {
				runs, err := protocol.ParseIDs(msg.Data, 1, protocol.FormatList, 1)
				if err != nil {
					return 0, err
				}
				return runs[0].First, nil
			}
		}
		retryable := errors.Is(err, errUnavailable) || errors.Is(err, nats.ErrNoResponders) || errors.Is(err, nats.ErrTimeout)
		if !r.retries || !retryable || time.Now().Add(backoff).After(deadline) {
			return 0, err
		}
		time.Sleep(backoff)
		backoff = min(2*backoff, 200*time.Millisecond)
	}
}

// load requests IDs of every subject from two requesters on every node,
// one with retries and one without, and records every reply.
type load struct {
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu      sync.Mutex // protects the fields below
	phase   string
	answers map[string]int                 // per subject, every client
	obs     map[string][]check.Observation // per subject, every request that got an ID
	// retried: failures of the clients with retries, per subject.
	retried map[string][]string
	// raw: failures of the clients without retries, by "<phase when
	// sent>, client on <server>[→<server it moved to>], <subject>"; cut:
	// how many of them timed out with a disconnection of the client's
	// connection between the request's send and its failure (in flight
	// when its server closed the connection), by the same key.
	raw map[string][]string
	cut map[string]int
}

func startLoad(t *testing.T, c *faultnet.Cluster) *load {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	l := &load{cancel: cancel, phase: "previous", answers: map[string]int{}, obs: map[string][]check.Observation{},
		retried: map[string][]string{}, raw: map[string][]string{}, cut: map[string]int{}}
	for _, s := range c.Servers {
		for _, retries := range []bool{true, false} {
			var disconnects atomic.Int64 // the connection's disconnections so far
			nc, err := nats.Connect(s.ClientURL(), nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond),
				nats.DisconnectErrHandler(func(*nats.Conn, error) { disconnects.Add(1) }))
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(nc.Close)
			cl := requester{nc: nc, retries: retries}
			for _, subject := range subjects {
				l.wg.Go(func() {
					for ctx.Err() == nil {
						l.mu.Lock()
						phase := l.phase
						l.mu.Unlock()
						start := time.Now()
						at := nc.ConnectedServerName() // clients move when their server restarts
						before := disconnects.Load()
						var id int64
						var err error
						if subject == "snowflake" {
							id, err = cl.id("id.snowflake")
						} else {
							id, err = cl.id("id.segment." + subject)
						}
						on := at
						if now := nc.ConnectedServerName(); now != at {
							on += "→" + now
						}
						cut := disconnects.Load() != before && errors.Is(err, nats.ErrTimeout)
						l.record(subject, phase+", client on "+on, retries, id, err, cut, start, time.Now())
					}
				})
			}
		}
	}
	t.Cleanup(l.halt)
	return l
}

func (l *load) halt() {
	l.cancel()
	l.wg.Wait()
}

func (l *load) setPhase(t *testing.T, phase string) {
	t.Logf("%s: %s", time.Now().Format("15:04:05.000"), phase)
	l.mu.Lock()
	l.phase = phase
	l.mu.Unlock()
}

// record records a request of subject sent at start and answered (id or
// err) at end; cut: it timed out across a disconnection of its connection.
func (l *load) record(subject, where string, retries bool, id int64, err error, cut bool, start, end time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.answers[subject]++
	if err != nil {
		msg := time.Now().Format("15:04:05.000 ") + err.Error()
		if retries {
			l.retried[subject] = append(l.retried[subject], msg)
		} else {
			key := where + ", " + subject
			l.raw[key] = append(l.raw[key], msg)
			if cut {
				l.cut[key]++
			}
		}
		return
	}
	l.obs[subject] = append(l.obs[subject], check.Observation{Start: start, End: end, IDs: []int64{id}})
}

// waitFor waits until every subject has n more answers than now.
func (l *load) waitFor(t *testing.T, n int) {
	t.Helper()
	l.mu.Lock()
	want := map[string]int{}
	for _, s := range subjects {
		want[s] = l.answers[s] + n
	}
	l.mu.Unlock()
	wait.For(t, 60*time.Second, fmt.Sprintf("%d more answers of every subject", n), func() bool {
		l.mu.Lock()
		defer l.mu.Unlock()
		for s, w := range want {
			if l.answers[s] < w {
				return false
			}
		}
		return true
	})
}

// ownerMoveBound is the most ordered-tag requests the clients without
// retries (three, one request in flight each) may see fail per owner move
// of the current version: those in flight when it hands the tag over and
// finds no new owner within a short wait (ordered.handOverWait), usually
// one per client (once, in long mode, one client got three around one
// hand-over and the others none). Stopping a worker that does not own the
// tag fails none.
const ownerMoveBound = 3

// previousSanityBound bounds the ordered-tag failures of clients without
// retries while workers of the previous version stop (its owners answer
// 503 to the requests forwarded after their release, as many as arrive
// before the others see it, and its stopping workers made requests wait
// 2 s for an owner): counted and logged; the bound only catches an outage.
const previousSanityBound = 100

// TestRollingUpgrade: three workers of the previous version (a fixed
// earlier commit, built from the git history) serve a 3-node cluster and
// PostgreSQL under load from clients on every node; the current version's
// migrate runs; each worker is replaced by one of the current version, one
// at a time (both versions serve side by side meanwhile), and then each by
// one of the previous version again (the rollback, which needs nothing
// but the previous binaries: migrations only add). No ID is handed out
// twice, the ordered tag's IDs increase across versions, clients with the
// Go client's retry policy see no failure, and clients without retries see no
// failed plain or snowflake request (in long mode: but those of a client
// on a server being restarted, in flight when it closes the client's
// connection). Their failed ordered requests are counted by half: while
// current workers stop, at most ownerMoveBound per owner stopped (those
// in flight at its hand-over; none at the stop of a worker that owns
// nothing); while previous workers stop, whatever that version fails
// (logged, bounded only against an outage). Each worker that runs answers
// plain and snowflake requests in every step, so both versions serve side
// by side.
func TestRollingUpgrade(t *testing.T) {
	t.Parallel()
	prev := previousBinary(t, previous)
	cur := currentBinary(t)
	long := longMode()

	c := faultnet.NewCluster(t, 3, faultnet.ClusterOptions{})
	pgURL := testenv.Postgres(t)
	// The database as the previous version set it up.
	run(t, prev, "migrate", "--postgres-url", pgURL)
	run(t, prev, "tags", "create", "plain", "--step", "2000", "--postgres-url", pgURL)
	run(t, prev, "tags", "create", "orders", "--step", "2000", "--ordered", "--postgres-url", pgURL)

	f := newFleet(t, c, pgURL)
	workers := make([]*proc, len(c.Servers))
	for i := range workers {
		workers[i] = f.start(prev, "previous", i)
	}
	l := startLoad(t, c)
	perStep := 100
	if long {
		perStep = 1000
	}
	l.waitFor(t, perStep)
	stats := testenv.Connect(t, c.Servers[0])
	// checkServing fails the test unless every running worker has answered
	// plain, ordered-or-forwarded and snowflake requests since before.
	checkServing := func(before map[string]map[string]int) map[string]map[string]int {
		t.Helper()
		now := map[string]map[string]int{}
		for _, p := range workers {
			id := p.serviceID() // counts start again under a new one
			n, _, err := statsOf(stats, id)
			if err != nil {
				t.Fatal(err)
			}
			now[id] = n
			for _, e := range []string{"segment", "snowflake"} {
				if n[e] <= before[id][e] {
					t.Errorf("%s answered no %s request in this step (%d in all)", p.name, e, n[e])
				}
			}
		}
		return now
	}
	seen := checkServing(nil)

	// The upgrade: the current version's migrations first, as the Helm
	// chart's pre-upgrade hook runs them, while the previous workers serve.
	l.setPhase(t, "migrate")
	t.Logf("current migrate: %s", strings.TrimSpace(run(t, cur, "migrate", "--postgres-url", pgURL)))
	l.waitFor(t, perStep)
	// ownerStops counts, per half ("upgrade", "rollback"), the workers
	// stopped while they owned the ordered tag; restarts the server
	// restarts of long mode.
	ownerStops, restarts := map[string]int{}, map[string]int{}
	replace := func(phase, bin, version string) {
		for i := range workers {
			l.setPhase(t, fmt.Sprintf("%s w%d", phase, i))
			if _, owned, err := statsOf(stats, workers[i].serviceID()); err != nil {
				t.Fatal(err)
			} else if slices.Contains(owned, "orders") {
				ownerStops[phase]++
				t.Logf("%s owns the ordered tag", workers[i].name)
			}
			f.stop(workers[i])
			workers[i] = f.start(bin, version, i)
			l.waitFor(t, perStep)
			seen = checkServing(seen)
			if long && i == 1 {
				// Both versions serve: restart every nats-server, one
				// at a time, in lame-duck mode.
				for s := range c.Servers {
					l.setPhase(t, fmt.Sprintf("%s, mixed: server n%d", phase, s))
					restarts[phase]++
					c.Restart(t, s, true)
					l.waitFor(t, perStep)
				}
			}
		}
	}
	replace("upgrade", cur, "current")
	l.setPhase(t, "current")
	l.waitFor(t, perStep)
	replace("rollback", prev, "previous")
	l.setPhase(t, "previous again")
	l.waitFor(t, perStep)
	l.halt()

	l.mu.Lock()
	defer l.mu.Unlock()
	for _, s := range subjects {
		if fails := l.retried[s]; len(fails) > 0 {
			t.Errorf("with retries: %s: %d requests failed, e.g. %s", s, len(fails), fails[0])
		}
	}
	var dups []string
	for _, s := range subjects {
		for _, d := range check.Unique(l.obs[s]).Duplicates {
			dups = append(dups, fmt.Sprintf("%s %d", s, d.ID))
		}
	}
	if len(dups) > 0 {
		t.Errorf("%d IDs handed out twice, e.g. %v", len(dups), dups[0])
	}
	if n, examples := check.Linearizable(l.obs["orders"]); n > 0 {
		t.Errorf("%d ordered IDs out of order, e.g. %d after a reply with %d had completed", n, examples[0].Late.Min(), examples[0].Early.Max())
	}
	keys := make([]string, 0, len(l.raw))
	for k := range l.raw {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	// half says which half of the test a phase belongs to: a failure is
	// recorded with the phase it was sent in, and caused by that phase's
	// stop or the next one's (it was in flight then). The rollback half
	// ("current" on) stops only workers of the current version.
	half := func(phase string) string {
		if phase == "current" || strings.HasPrefix(phase, "rollback") || phase == "previous again" {
			return "rollback"
		}
		return "upgrade"
	}
	ordered := map[string]int{}
	for _, key := range keys {
		fails := l.raw[key]
		t.Logf("without retries: %s: %d failed (%d timed out across a disconnection), e.g. %s", key, len(fails), l.cut[key], fails[0])
		parts := strings.Split(key, ", ") // phase (maybe with a comma), client's server(s), subject
		phase, subject := strings.Join(parts[:len(parts)-2], ", "), parts[len(parts)-1]
		switch {
		case subject == "orders":
			ordered[half(phase)] += len(fails)
		case l.cut[key] == len(fails):
			// A client on a restarting server loses what is in flight
			// when the server closes its connection: a timeout, with
			// the disconnection between the request and its failure
			// (see worker.TestRollingRestarts).
		default:
			t.Errorf("without retries: %s: %d requests failed, %d of them timeouts in flight when the client's connection closed, want no other, e.g. %s",
				key, len(fails), l.cut[key], fails[0])
		}
	}
	// Server restarts (long mode): each may fail the ordered requests in
	// flight on the restarting server and those at the owner's move to
	// another connection.
	if bound := ownerMoveBound*ownerStops["rollback"] + 2*3*restarts["rollback"]; ordered["rollback"] > bound {
		t.Errorf("without retries: %d ordered-tag requests failed while current workers stopped, %d of them owners; want at most %d",
			ordered["rollback"], ownerStops["rollback"], bound)
	}
	if ordered["upgrade"] > previousSanityBound {
		t.Errorf("without retries: %d ordered-tag requests failed while previous workers stopped; want at most %d", ordered["upgrade"], previousSanityBound)
	}
	t.Logf("ordered-tag requests failed without retries: %d while previous workers stopped (%d owners), %d while current ones stopped (%d owners)",
		ordered["upgrade"], ownerStops["upgrade"], ordered["rollback"], ownerStops["rollback"])
	t.Logf("answers %v", l.answers)
}
