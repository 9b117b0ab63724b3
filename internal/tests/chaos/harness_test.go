package chaos

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nats.go/micro"

	"github.com/dispenser-dev/dispenser/dispenser"
	"github.com/dispenser-dev/dispenser/internal/tests/procs"
	"github.com/dispenser-dev/dispenser/internal/tests/testdb"
	"github.com/dispenser-dev/dispenser/ownership"
	"github.com/dispenser-dev/dispenser/segment"
	"github.com/dispenser-dev/dispenser/segment/kv"
	"github.com/dispenser-dev/dispenser/snowflake"
	"github.com/dispenser-dev/dispenser/tagmodel"
	"github.com/dispenser-dev/dispenser/testenv"
)

// envBool reads a boolean environment variable; def if unset or unparsable.
func envBool(name string, def bool) bool {
	v, err := strconv.ParseBool(os.Getenv(name))
	if err != nil {
		return def
	}
	return v
}

// longMode reports whether DISPENSER_CHAOS_LONG asks for the long mode.
func longMode() bool { return envBool("DISPENSER_CHAOS_LONG", false) }

// The dispenser binary, built once per test binary.
var binary struct {
	once sync.Once
	dir  string // removed by TestMain
	path string
	err  error
}

// dispenserBinary builds cmd/dispenser on first use and returns its path.
// The workers are built with -race when the test binary is, unless
// DISPENSER_CHAOS_RACE says otherwise: that way `go test -race` reuses the
// packages it compiled anyway, and the workers' data races show up in their
// logs (and fail the test, see fleet.checkLogs).
func dispenserBinary(tb testing.TB) string {
	tb.Helper()
	binary.once.Do(func() { binary.path, binary.err = buildBinary() })
	if binary.err != nil {
		tb.Fatalf("building cmd/dispenser: %v", binary.err)
	}
	return binary.path
}

func raceWorkers() bool { return envBool("DISPENSER_CHAOS_RACE", raceBuild) }

func buildBinary() (string, error) {
	root, err := procs.ModuleRoot()
	if err != nil {
		return "", err
	}
	if binary.dir, err = os.MkdirTemp("", "dispenser-chaos-"); err != nil {
		return "", err
	}
	path := filepath.Join(binary.dir, "dispenser")
	if err := procs.Build(root, path, raceWorkers()); err != nil {
		return "", err
	}
	procs.StatSources(root)
	return path, nil
}

// fleet starts dispenser worker processes and keeps every process it
// started, so that replies can be traced back to a process lifetime and all
// of them are killed in Cleanup.
type fleet struct {
	tb   testing.TB
	bin  string
	dir  string   // worker logs
	base []string // flags of every worker
	// pipeLogs: workers write their logs to a pipe the test drains into
	// the log file, so that a fault can stall it (logPipe); else straight
	// to the file.
	pipeLogs bool

	mu    sync.Mutex
	procs []*proc
	byID  map[string]*proc // micro service ID -> process
}

// proc is one worker process: one lifetime of an instance.
type proc struct {
	instance string
	seq      int // 1-based start order in the fleet
	cmd      *exec.Cmd
	log      string
	id       string // micro service ID, unique per process
	workerID int    // snowflake worker ID leased at start; -1 without
	done     chan struct{}
	state    *os.ProcessState // set when done is closed
	pipe     *logPipe         // with fleet.pipeLogs: the pipe of its stdout and stderr
}

func (p *proc) String() string {
	return fmt.Sprintf("%s#%d(pid %d, sf %d)", p.instance, p.seq, p.cmd.Process.Pid, p.workerID)
}

// newFleet returns a fleet whose workers run `dispenser serve` with flags.
// Cleanup kills the workers still running and, if the test failed, logs the
// tail of every worker's log.
func newFleet(tb testing.TB, flags ...string) *fleet {
	tb.Helper()
	f := &fleet{tb: tb, bin: dispenserBinary(tb), dir: tb.TempDir(), base: flags, byID: map[string]*proc{}}
	tb.Cleanup(func() {
		f.mu.Lock()
		procs := append([]*proc(nil), f.procs...)
		f.mu.Unlock()
		for _, p := range procs {
			select {
			case <-p.done:
				continue
			default:
			}
			p.cmd.Process.Signal(syscall.SIGCONT)
			p.cmd.Process.Kill()
			select {
			case <-p.done:
			case <-time.After(10 * time.Second):
				tb.Errorf("worker %v did not exit after SIGKILL", p)
			}
		}
		f.checkLogs()
		if tb.Failed() {
			for _, p := range procs {
				tb.Logf("---- log of worker %v (%s), last 4 KB:\n%s", p, p.log, tail(p.log, 4096))
			}
		}
	})
	return f
}

// checkLogs fails the test if a worker log reports a data race or a panic.
func (f *fleet) checkLogs() {
	for _, p := range f.all() {
		b, _ := os.ReadFile(p.log)
		for _, bad := range []string{"WARNING: DATA RACE", "panic:", "fatal error:"} {
			if bytes.Contains(b, []byte(bad)) {
				f.tb.Errorf("worker %v logged %q; log %s:\n%s", p, bad, p.log, tail(p.log, 8192))
				break
			}
		}
	}
}

// start starts a worker with the given instance name (and extra flags) and
// waits until it serves.
func (f *fleet) start(instance string, extra ...string) *proc {
	f.tb.Helper()
	f.mu.Lock()
	seq := len(f.procs) + 1
	f.mu.Unlock()
	p := &proc{instance: instance, seq: seq, workerID: -1, done: make(chan struct{}),
		log: filepath.Join(f.dir, fmt.Sprintf("%02d-%s.log", seq, instance))}
	lf, err := os.Create(p.log)
	if err != nil {
		f.tb.Fatal(err)
	}
	args := append([]string{"serve"}, f.base...)
	args = append(args, "--instance", instance, "--log-format", "json")
	args = append(args, extra...)
	p.cmd = exec.Command(f.bin, args...)
	p.cmd.Env = procs.WorkerEnv()
	p.cmd.Stdout, p.cmd.Stderr = lf, lf
	if f.pipeLogs {
		if p.pipe, err = newLogPipe(lf); err != nil {
			lf.Close()
			f.tb.Fatalf("worker %s: %v", instance, err)
		}
		p.cmd.Stdout, p.cmd.Stderr = p.pipe.w, p.pipe.w
	}
	// Should the test binary die, its workers die too.
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	err = p.cmd.Start()
	if p.pipe == nil {
		lf.Close()
	}
	if err != nil {
		if p.pipe != nil {
			p.pipe.finish()
		}
		f.tb.Fatalf("starting worker %s: %v", instance, err)
	}
	go func() {
		p.cmd.Wait()
		if p.pipe != nil {
			p.pipe.finish() // the whole log is in the file before done closes
		}
		p.state = p.cmd.ProcessState
		close(p.done)
	}()
	f.mu.Lock()
	f.procs = append(f.procs, p)
	f.mu.Unlock()

	deadline := time.Now().Add(30 * time.Second)
	for p.id == "" {
		p.readStartLog()
		if p.id != "" {
			break
		}
		select {
		case <-p.done:
			f.tb.Fatalf("worker %s exited before serving (%v); log:\n%s", instance, p.state, tail(p.log, 4096))
		case <-time.After(20 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			f.tb.Fatalf("worker %s not serving within 30s; log:\n%s", instance, tail(p.log, 4096))
		}
	}
	f.mu.Lock()
	f.byID[p.id] = p
	f.mu.Unlock()
	return p
}

// readStartLog reads the service ID and the snowflake worker ID from the
// worker's JSON log lines "serving" and "snowflake worker ID leased".
func (p *proc) readStartLog() {
	for _, line := range procs.LogLines(p.log) {
		switch line["msg"] {
		case "serving":
			p.id, _ = line["id"].(string)
		case "snowflake worker ID leased":
			if v, ok := line["worker_id"].(float64); ok {
				p.workerID = int(v)
			}
		}
	}
}

// logged returns the log lines whose msg is msg.
func (p *proc) logged(msg string) []map[string]any {
	var out []map[string]any
	for _, l := range procs.LogLines(p.log) {
		if l["msg"] == msg {
			out = append(out, l)
		}
	}
	return out
}

// signal sends sig to the process.
func (p *proc) signal(tb testing.TB, sig syscall.Signal) {
	tb.Helper()
	if err := p.cmd.Process.Signal(sig); err != nil {
		tb.Fatalf("%v to worker %v: %v", sig, p, err)
	}
}

// wait waits at most d for the process to exit and reports whether it did.
func (p *proc) wait(d time.Duration) bool {
	select {
	case <-p.done:
		return true
	case <-time.After(d):
		return false
	}
}

// rss returns the resident set size of the running process in bytes, from
// /proc/<pid>/status.
func (p *proc) rss(tb testing.TB) int64 {
	tb.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", p.cmd.Process.Pid))
	if err != nil {
		tb.Fatalf("worker %v: %v", p, err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(rest), "kB")), 10, 64)
			if err != nil {
				tb.Fatalf("worker %v: VmRSS %q: %v", p, rest, err)
			}
			return kb << 10
		}
	}
	tb.Fatalf("worker %v: no VmRSS in /proc/%d/status", p, p.cmd.Process.Pid)
	return 0
}

// claimed returns the snowflake worker IDs that processes of instance have
// claimed, from their "snowflake: claimed worker ID" log lines.
func (f *fleet) claimed(instance string) []int {
	var ids []int
	for _, p := range f.all() {
		if p.instance != instance {
			continue
		}
		for _, l := range p.logged("snowflake: claimed worker ID") {
			if v, ok := l["worker"].(float64); ok && !slices.Contains(ids, int(v)) {
				ids = append(ids, int(v))
			}
		}
	}
	return ids
}

// byServiceID returns the process with micro service ID id, or nil.
func (f *fleet) byServiceID(id string) *proc {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.byID[id]
}

// all returns every process started so far.
func (f *fleet) all() []*proc {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]*proc(nil), f.procs...)
}

// describe names the process behind a micro service ID for messages.
func (f *fleet) describe(id string) string {
	if p := f.byServiceID(id); p != nil {
		return p.String()
	}
	return "unknown worker " + id
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

// connect connects a client that reconnects forever and quickly.
func connect(tb testing.TB, urls, name string) *nats.Conn {
	tb.Helper()
	nc, err := nats.Connect(urls,
		nats.Name(name),
		nats.MaxReconnects(-1),
		nats.RetryOnFailedConnect(true),
		nats.ReconnectWait(100*time.Millisecond),
		nats.ReconnectJitter(50*time.Millisecond, 50*time.Millisecond),
		nats.ErrorHandler(func(*nats.Conn, *nats.Subscription, error) {}), // not to stderr
	)
	if err != nil {
		tb.Fatalf("connect to %s: %v", urls, err)
	}
	tb.Cleanup(nc.Close)
	return nc
}

// postgresCluster starts a throwaway PostgreSQL cluster of the test's own,
// which the test may stop and restart, with a migrated database holding
// tags; it returns the cluster and the database URL.
func postgresCluster(tb testing.TB, tags map[string]int64) (*testenv.PostgresCluster, string) {
	tb.Helper()
	// Not tb.TempDir(): as root, the server runs as user postgres, which
	// cannot enter it.
	c, err := testenv.StartPostgresCluster("")
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(c.Close)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	dbURL, err := c.CreateDatabase(ctx)
	if err != nil {
		tb.Fatal(err)
	}
	testdb.Setup(tb, dbURL, tags)
	return c, dbURL
}

// createKVTags creates tags with steps in the JetStream KV segment store
// bucket (with replicas, if it is new) on the NATS server(s) at urls; those
// named in ordered are ordered tags.
func createKVTags(tb testing.TB, urls, bucket string, replicas int, tags map[string]int64, ordered ...string) {
	tb.Helper()
	nc, err := nats.Connect(urls)
	if err != nil {
		tb.Fatal(err)
	}
	defer nc.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	js, err := jetstream.New(nc)
	if err != nil {
		tb.Fatal(err)
	}
	// A request to a cluster still settling its JetStream meta leader can go
	// unanswered: try again with short attempts rather than one long one.
	var st *kv.Store
	for {
		actx, acancel := context.WithTimeout(ctx, 5*time.Second)
		st, err = kv.New(actx, js, kv.Settings{Bucket: bucket, Replicas: replicas})
		acancel()
		if err == nil {
			break
		}
		if ctx.Err() != nil {
			tb.Fatalf("creating bucket %s: %v", bucket, err)
		}
		tb.Logf("creating bucket %s: %v; trying again", bucket, err)
	}
	for tag, step := range tags {
		t := tagmodel.Tag{Name: tag, Step: step, MaxID: 1, Description: "chaos test", Ordered: slices.Contains(ordered, tag)}
		if err := st.CreateTag(ctx, t); err != nil {
			tb.Fatal(err)
		}
	}
}

// workerStats is what one worker reports on $SRV.STATS.
type workerStats struct {
	Tags      map[string]segment.TagStats
	Snowflake snowflake.NodeStats
	Ordered   ownership.Stats // the segment endpoint's "ordered"
	Forwarded uint64          // its "forwarded": requests forwarded to the owner of their ordered tag
	Requests  map[string]int  // per endpoint
	Errors    map[string]int
}

// statsOf asks the worker with micro service ID id for its stats.
func statsOf(nc *nats.Conn, id string) (*workerStats, error) {
	msg, err := nc.Request("$SRV.STATS."+dispenser.Name+"."+id, nil, 2*time.Second)
	if err != nil {
		return nil, fmt.Errorf("stats of %s: %w", id, err)
	}
	var st micro.Stats
	if err := json.Unmarshal(msg.Data, &st); err != nil {
		return nil, fmt.Errorf("stats of %s: %w", id, err)
	}
	ws := &workerStats{Tags: map[string]segment.TagStats{}, Requests: map[string]int{}, Errors: map[string]int{}}
	for _, e := range st.Endpoints {
		ws.Requests[e.Name], ws.Errors[e.Name] = e.NumRequests, e.NumErrors
		switch e.Name {
		case "segment":
			var d struct {
				Tags    []segment.TagStats
				Ordered struct {
					ownership.Stats
					Forwarded uint64 `json:"forwarded"`
				} `json:"ordered"`
			}
			if err := json.Unmarshal(e.Data, &d); err != nil {
				return nil, fmt.Errorf("segment stats of %s: %w", id, err)
			}
			ws.Ordered, ws.Forwarded = d.Ordered.Stats, d.Ordered.Forwarded
			for _, t := range d.Tags {
				ws.Tags[t.Tag] = t
			}
		case "snowflake":
			if err := json.Unmarshal(e.Data, &ws.Snowflake); err != nil {
				return nil, fmt.Errorf("snowflake stats of %s: %w", id, err)
			}
		}
	}
	return ws, nil
}
