// Package model is the model-based test of the one promise: no ID and no
// formatted number of a tag is handed out twice, whatever the workers, the
// clocks, the stores and the operator do (issue 34, docs/reliability.md).
//
// A rule first: a setting it does not drive is a setting nobody has
// proven. Every new setting of a tag, a worker or a store gets an action
// or a choice here, in the same change that adds it.
//
// A real system, rebuilt for every run: one store (the JetStream KV
// store on an embedded nats-server, PostgreSQL, or MariaDB, each migrated
// as `dispenser migrate` does), with or without the witness (PostgreSQL
// and MariaDB; the KV store has none), in one of three region modes: one
// region; per-region stores (two regions, a store and a witness each, IDs
// v×2+N); shared (two regions on one store and one witness). Workers are
// segment.Allocators, each with store objects of its own, as a process has. A model: every plain ID handed out, per tag
// (per tag and period for a tag with a reset period), and every formatted
// number's text, per tag.
//
// Settings and actions driven (rapid draws a sequence of them):
//   - tags create / update through the operator's path (tagmodel.CheckRegions
//     with the operator's region flags, then Admin.CreateTag / UpdateTag, as
//     cmd/dispenser's `tags` does), with: step, start, description,
//     ordered, reset (none, day, month, year), time zone, retention days,
//     format (literals, {seq}, {seq:N}, {date:LAYOUT} among numeric,
//     two-digit-year, weekday-name, month-name and `_2` layouts); a
//     refused setting is recorded, and nothing else happens;
//   - requests: plain single, batch, formatted (TakeNowNumbered and
//     Numbering.Append, the Id-Format: formatted path), from any worker;
//   - clocks: the system's clock jumps (days to 100 years, both ways; the
//     KV store's clock with it), and each worker has an offset of its own
//     (hours to a month); PostgreSQL and MariaDB keep the database's clock;
//   - period pruning (PeriodPruner.PrunePeriods; every worker also prunes
//     when it starts);
//   - workers: start, stop with give-back, crash (no give-back), restart,
//     idle release (a worker with a short IdleTimeout left alone), each
//     with serve's segment flags drawn: --max-step (one below a tag's
//     step pins it), --max-depth, --prefetch-ratio, --buffer-time, and
//     --auto-create-tags with --auto-create-step, whose worker is sent
//     requests for tags nobody created (take-unknown);
//   - region settings: workers of each region as the mode says, and
//     misconfigured workers (other region settings, or none, on any store):
//     refused, or their IDs must not meet anyone's;
//   - Leaf (MariaDB): Meituan Leaf's own transaction (internal/leafsql)
//     on the same leaf_alloc rows, beside dispenser;
//   - a store that loses its last writes (with the witness only; without
//     it duplicates are documented): max_id rows put back to an earlier
//     snapshot, periods' rows created since then deleted;
//   - two give-backs racing through the witness (one worker's give-back
//     paused between the witness and the store while another worker
//     fetches and gives back).
//
// Checked after every step: no plain ID and no formatted number of a tag
// handed out twice, across all workers and Leaf; every formatted number is
// one the Go client accepts (client.Formatted's check); no rollback is
// reported (witness.Settings.OnRollback) unless a rollback was made.
//
// Runs: short mode in plain `go test` (a few runs per store); long mode with
// DISPENSER_MODEL_LONG=1 for DISPENSER_MODEL_DURATION (default 30m). A
// failure prints rapid's seed: replay it with -rapid.seed=N (or
// RAPID_SEED=N, or DISPENSER_MODEL_SEED=N, which go test ./... passes to
// every package alike) and -run 'TestModel/STORE', with the same mode (a
// failure of long mode replays only with DISPENSER_MODEL_LONG=1: the number
// of actions drawn differs; a seed makes long mode one replay, not rounds
// for the duration). DISPENSER_MODEL_STORES
// picks stores (kv,postgres,mysql); DISPENSER_MODEL_SKIP leaves out actions
// and choices by name (comma-separated, e.g. rollback,leaf,layout=Mon0102),
// to see what else the test finds once it found one hole.
package model

import (
	"context"
	"database/sql"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
	"pgregory.net/rapid"

	"github.com/dispenser-dev/dispenser/internal/leafsql"
	"github.com/dispenser-dev/dispenser/protocol"
	"github.com/dispenser-dev/dispenser/segment"
	"github.com/dispenser-dev/dispenser/segment/kv"
	"github.com/dispenser-dev/dispenser/segment/mysql"
	"github.com/dispenser-dev/dispenser/segment/postgres"
	"github.com/dispenser-dev/dispenser/segment/witness"
	"github.com/dispenser-dev/dispenser/tagmodel"
	"github.com/dispenser-dev/dispenser/testenv"
)

const (
	envLong     = "DISPENSER_MODEL_LONG"     // 1: long mode
	envDuration = "DISPENSER_MODEL_DURATION" // long mode's length (default 30m)
	envSeed     = "DISPENSER_MODEL_SEED"     // rapid's seed
	envStores   = "DISPENSER_MODEL_STORES"   // kv,postgres,mysql (default all)
	envSkip     = "DISPENSER_MODEL_SKIP"     // actions and choices left out
	envChecks   = "DISPENSER_MODEL_CHECKS"   // runs per store (rapid.checks)
	envSteps    = "DISPENSER_MODEL_STEPS"    // average actions per run (rapid.steps)
)

// Short mode's runs per store and average actions per run; long mode's.
const (
	shortChecks = 4
	shortSteps  = 60
	longChecks  = 20
	longSteps   = 150
)

var discard = slog.New(slog.NewTextHandler(io.Discard, nil))

// skipped reports whether name was left out with DISPENSER_MODEL_SKIP.
func skipped(name string) bool {
	for s := range strings.SplitSeq(os.Getenv(envSkip), ",") {
		if strings.TrimSpace(s) == name {
			return true
		}
	}
	return false
}

// choose draws one of the values whose names are not skipped (name is
// label=value).
func choose[V any](t *rapid.T, label string, values []V) V {
	var ok []V
	for _, v := range values {
		if !skipped(fmt.Sprintf("%s=%v", label, v)) {
			ok = append(ok, v)
		}
	}
	if len(ok) == 0 {
		t.Skipf("every %s skipped", label)
	}
	return rapid.SampledFrom(ok).Draw(t, label)
}

// setFlag sets rapid's flag unless the command line did.
func setFlag(t *testing.T, name, value string) {
	set := false
	flag.Visit(func(f *flag.Flag) { set = set || f.Name == name })
	if set {
		return
	}
	if err := flag.Set(name, value); err != nil {
		t.Fatalf("flag %s=%s: %v", name, value, err)
	}
}

// configure sets rapid's checks, steps and seed from this package's
// environment variables (or its defaults), where neither the command line
// nor rapid's own variables (RAPID_CHECKS, RAPID_STEPS, RAPID_SEED) did.
func configure(t *testing.T, long bool) {
	checks, steps := shortChecks, shortSteps
	if long {
		checks, steps = longChecks, longSteps
	}
	for _, f := range []struct {
		flag, env, rapidEnv string
		def                 int
	}{
		{"rapid.checks", envChecks, "RAPID_CHECKS", checks},
		{"rapid.steps", envSteps, "RAPID_STEPS", steps},
	} {
		v := os.Getenv(f.env)
		if v == "" {
			if _, ok := os.LookupEnv(f.rapidEnv); ok {
				continue
			}
			v = strconv.Itoa(f.def)
		}
		setFlag(t, f.flag, v)
	}
	if s := os.Getenv(envSeed); s != "" {
		setFlag(t, "rapid.seed", s)
	}
	// A failing run prints its seed; no fail file in the source tree.
	setFlag(t, "rapid.nofailfile", "true")
	if long {
		// A run takes seconds on real stores: shrinking needs minutes.
		setFlag(t, "rapid.shrinktime", "5m")
	}
}

// replaying reports whether a seed was given (-rapid.seed, RAPID_SEED or
// DISPENSER_MODEL_SEED): long mode then runs rapid's checks once from that
// seed, the replay a failure prints, instead of rounds for the duration.
func replaying() bool {
	f := flag.Lookup("rapid.seed")
	return f != nil && f.Value.String() != "0"
}

// TestModel runs the model-based test on each store.
func TestModel(t *testing.T) {
	long := os.Getenv(envLong) == "1"
	configure(t, long)
	stores := []string{"kv", "postgres", "mysql"}
	if s := os.Getenv(envStores); s != "" {
		stores = strings.Split(s, ",")
	}
	duration := 30 * time.Minute
	if d := os.Getenv(envDuration); d != "" {
		var err error
		if duration, err = time.ParseDuration(d); err != nil {
			t.Fatalf("%s=%q: %v", envDuration, d, err)
		}
	}
	for _, kind := range stores {
		t.Run(kind, func(t *testing.T) {
			e := newEnv(t, kind)
			defer e.report(t)
			if !long || replaying() {
				rapid.Check(t, e.run)
				return
			}
			end := time.Now().Add(duration / time.Duration(len(stores)))
			for round := 0; time.Now().Before(end); round++ {
				t.Run(strconv.Itoa(round), func(t *testing.T) { rapid.Check(t, e.run) })
				if t.Failed() {
					return
				}
			}
		})
	}
}

// env is what the runs on one store share: a nats-server (KV store,
// witness buckets), counters.
type env struct {
	t    *testing.T
	kind string
	js   jetstream.JetStream
	runs atomic.Int64

	mu      sync.Mutex     // protects actions, refused
	actions map[string]int // actions run, by name
	refused map[string]int // operator actions and workers refused, by reason
}

func newEnv(t *testing.T, kind string) *env {
	switch kind {
	case "kv", "postgres", "mysql":
	default:
		t.Fatalf("%s: unknown store %q: want kv, postgres or mysql", envStores, kind)
	}
	ns := testenv.NATS(t)
	nc := testenv.Connect(t, ns)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	return &env{t: t, kind: kind, js: js, actions: map[string]int{}, refused: map[string]int{}}
}

func (e *env) count(m map[string]int, key string) {
	e.mu.Lock()
	m[key]++
	e.mu.Unlock()
}

// report logs what the runs did.
func (e *env) report(t *testing.T) {
	e.mu.Lock()
	defer e.mu.Unlock()
	var b strings.Builder
	fmt.Fprintf(&b, "%d runs on %s; actions:", e.runs.Load(), e.kind)
	total := 0
	for _, k := range slices.Sorted(mapsKeys(e.actions)) {
		fmt.Fprintf(&b, " %s %d,", k, e.actions[k])
		total += e.actions[k]
	}
	fmt.Fprintf(&b, " total %d; refused:", total)
	for _, k := range slices.Sorted(mapsKeys(e.refused)) {
		fmt.Fprintf(&b, " %q %d,", k, e.refused[k])
	}
	t.Log(b.String())
}

func mapsKeys(m map[string]int) func(func(string) bool) {
	return func(yield func(string) bool) {
		for k := range m {
			if !yield(k) {
				return
			}
		}
	}
}

// iterTB hands testenv a testing.TB whose cleanups run at the end of a
// rapid run, not of the whole test.
type iterTB struct {
	testing.TB
	mu  sync.Mutex
	fns []func()
}

func (tb *iterTB) Cleanup(f func()) {
	tb.mu.Lock()
	tb.fns = append(tb.fns, f)
	tb.mu.Unlock()
}

func (tb *iterTB) cleanup() {
	for i := len(tb.fns) - 1; i >= 0; i-- {
		tb.fns[i]()
	}
}

// Region modes.
const (
	modeOne       = "one"
	modePerRegion = "per-region"
	modeShared    = "shared"
)

// backend is one store of the system: a database or a KV bucket.
type backend struct {
	sys    *system
	region int
	// regions is what the operator's and the region's workers' flags say
	// for this store.
	regions tagmodel.Regions
	pool    *pgxpool.Pool // postgres
	db      *sql.DB       // mysql
	bucket  string        // kv
}

// open returns a new store object over b, as a process opens one, and
// its Raiser (nil for KV).
func (b *backend) open(ctx context.Context) (tagmodel.Store, witness.Raiser, error) {
	switch b.sys.e.kind {
	case "postgres":
		s := postgres.New(b.pool)
		return s, s, nil
	case "mysql":
		s := mysql.New(b.db)
		return s, s, nil
	}
	s, err := kv.New(ctx, b.sys.e.js, kv.Settings{Bucket: b.bucket, Now: b.sys.storeNow, Logger: discard})
	return s, nil, err
}

// worker is one worker process: an Allocator over store objects of its own.
type worker struct {
	id      int
	region  int
	regions tagmodel.Regions
	be      *backend
	wbucket string // witness bucket; "" without
	offset  time.Duration
	idle    bool // a short IdleTimeout: idle releases happen
	misconf bool
	sys     *system
	alloc   *segment.Allocator
	stale   bool // a refresh failed: its view of tag settings may be old

	// The worker's serve flags that shape its segments: --max-step,
	// --max-depth, --prefetch-ratio, --buffer-time, and
	// --auto-create-tags with --auto-create-step (autoStep > 0).
	maxStep, maxDepth, autoStep int64
	prefetch                    float64
	bufferTime                  time.Duration
}

func (w *worker) String() string {
	s := fmt.Sprintf("worker %d (region %d, store %d, %s, offset %v", w.id, w.region, w.be.region, w.regions, w.offset)
	if w.misconf {
		s += ", misconfigured"
	}
	s += fmt.Sprintf(", max-step %d, max-depth %d, prefetch %v, buffer-time %v", w.maxStep, w.maxDepth, w.prefetch, w.bufferTime)
	if w.autoStep > 0 {
		s += fmt.Sprintf(", auto-create step %d", w.autoStep)
	}
	return s + ")"
}

func (w *worker) now() time.Time { return w.sys.now().Add(w.offset) }

// system is one run's real system and its model.
type system struct {
	e       *env
	t       *rapid.T
	prefix  string
	mode    string
	witness bool
	regions int // number of regions
	stores  []*backend
	workers []*worker // live
	nextID  int
	years   atomic.Int64 // the clock's jump: years
	days    atomic.Int64 // and days

	tags map[string]tagmodel.Tag // as the operator last set them

	// The model: plain IDs per tag (tag=KEY for a tag with a reset
	// period), formatted numbers per tag, and who handed each out.
	plain      map[string]map[int64]string
	formatted  map[string]map[string]string
	violations []string

	steps int // actions run (not skipped)

	snapshots       []snapshot
	rollbackActions int
	leafActions     int
	rollbacks       atomic.Int64
	rollbackMu      sync.Mutex // protects rollbackLog
	rollbackLog     []string
}

type snapshot struct {
	be   *backend
	rows map[string]int64
}

func (s *system) now() time.Time {
	return time.Now().AddDate(int(s.years.Load()), 0, int(s.days.Load()))
}

// storeNow is the KV store's clock: the system's. (PostgreSQL and MariaDB
// keep their own.)
func (s *system) storeNow() time.Time { return s.now() }

func (s *system) onRollback(tag string, mark, maxID int64) {
	s.rollbacks.Add(1)
	s.rollbackMu.Lock()
	s.rollbackLog = append(s.rollbackLog, fmt.Sprintf("rollback reported: tag %s, witness mark %d, store max_id %d", tag, mark, maxID))
	s.rollbackMu.Unlock()
}

func ctxT() (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.Background(), 20*time.Second)
}

// run is one rapid run: a new system, then a random sequence of actions.
func (e *env) run(t *rapid.T) {
	n := e.runs.Add(1)
	s := &system{e: e, t: t, prefix: fmt.Sprintf("m%d_", n), tags: map[string]tagmodel.Tag{},
		plain: map[string]map[int64]string{}, formatted: map[string]map[string]string{}}
	s.mode = choose(t, "regions", []string{modeOne, modePerRegion, modeShared})
	s.witness = e.kind != "kv" && choose(t, "witness", []bool{true, false})
	s.regions = 1
	if s.mode != modeOne {
		s.regions = 2
	}
	tb := &iterTB{TB: e.t}
	t.Cleanup(tb.cleanup)
	nStores := 1
	if s.mode == modePerRegion {
		nStores = 2
	}
	for r := range nStores {
		b := &backend{sys: s, region: r}
		if s.mode == modePerRegion {
			b.regions = tagmodel.Regions{Count: 2, Region: r}
		}
		s.newStore(tb, b)
		s.stores = append(s.stores, b)
	}
	t.Cleanup(s.close)
	t.Logf("system: %s store, regions %s, witness %v", e.kind, s.mode, s.witness)
	t.Repeat(s.actions())
}

// newStore makes b's database or bucket.
func (s *system) newStore(tb *iterTB, b *backend) {
	ctx, cancel := ctxT()
	defer cancel()
	switch s.e.kind {
	case "postgres":
		url := testenv.Postgres(tb)
		pool, err := pgxpool.New(ctx, url)
		if err != nil {
			s.t.Fatal(err)
		}
		tb.Cleanup(pool.Close)
		if _, err := postgres.Migrate(ctx, pool); err != nil {
			s.t.Fatal(err)
		}
		b.pool = pool
	case "mysql":
		dsn := testenv.MySQL(tb)
		db, err := mysql.OpenDB(dsn)
		if err != nil {
			s.t.Fatal(err)
		}
		tb.Cleanup(func() { db.Close() })
		if _, err := mysql.Migrate(ctx, db); err != nil {
			s.t.Fatal(err)
		}
		b.db = db
	default:
		b.bucket = fmt.Sprintf("%sseg_r%d", s.prefix, b.region)
		tb.Cleanup(func() {
			ctx, cancel := ctxT()
			defer cancel()
			s.e.js.DeleteKeyValue(ctx, b.bucket)
		})
	}
}

// witnessBucket is region's witness bucket, as the product names it by
// default (worker.StoreEnv.Witness, docs/regions.md): one witness per
// store, so the region's own only in per-region mode; in one region and in
// shared mode one for every region. (A --witness-bucket set per region in
// shared mode is an operator mistake the peer check refuses; a witness per
// region there repeats after a rollback what other regions served, issue
// 34 point 3.)
func (s *system) witnessBucket(region int) string {
	if !s.witness {
		return ""
	}
	if s.mode != modePerRegion {
		return s.prefix + "witness"
	}
	return fmt.Sprintf("%switness_r%d", s.prefix, region)
}

func (s *system) close() {
	for _, w := range s.workers {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		w.alloc.Close(ctx)
		cancel()
	}
	s.workers = nil
	ctx, cancel := ctxT()
	defer cancel()
	for r := range s.regions {
		if b := s.witnessBucket(r); b != "" {
			s.e.js.DeleteKeyValue(ctx, b)
		}
	}
}

// actions are the state machine's actions; "" is the check after each.
func (s *system) actions() map[string]func(*rapid.T) {
	all := map[string]func(*rapid.T){
		"take":             func(t *rapid.T) { s.take(t, "plain") },
		"take-batch":       func(t *rapid.T) { s.take(t, "batch") },
		"take-formatted":   func(t *rapid.T) { s.take(t, "formatted") },
		"take-formatted2":  func(t *rapid.T) { s.take(t, "formatted") },
		"take-formatted3":  func(t *rapid.T) { s.take(t, "formatted") },
		"take2":            func(t *rapid.T) { s.take(t, "plain") },
		"take-unknown":     s.takeUnknown,
		"tags-create":      s.createTag,
		"tags-update":      s.updateTag,
		"clock":            s.clock,
		"prune":            s.prune,
		"worker-start":     func(t *rapid.T) { s.startWorker(t, false) },
		"worker-start2":    func(t *rapid.T) { s.startWorker(t, false) },
		"worker-misconfig": func(t *rapid.T) { s.startWorker(t, true) },
		"worker-stop":      func(t *rapid.T) { s.stopWorker(t, "stop") },
		"worker-crash":     func(t *rapid.T) { s.stopWorker(t, "crash") },
		"worker-restart":   func(t *rapid.T) { s.stopWorker(t, "restart") },
		"worker-idle":      s.idle,
		"snapshot":         s.snapshot,
		"rollback":         s.rollback,
		"leaf":             s.leaf,
		"race-giveback":    s.raceGiveBack,
	}
	out := map[string]func(*rapid.T){"": s.check}
	for name, f := range all {
		base := strings.TrimRight(name, "0123456789")
		if skipped(base) {
			continue
		}
		out[name] = func(t *rapid.T) {
			f(t)
			s.steps++
			s.e.count(s.e.actions, base)
		}
	}
	return out
}

// check is the invariant, after every step.
func (s *system) check(t *rapid.T) {
	if len(s.violations) > 0 {
		t.Fatalf("%d violations after %d actions:\n%s", len(s.violations), s.steps, strings.Join(s.violations, "\n"))
	}
	if n := s.rollbacks.Load(); n > 0 && s.rollbackActions == 0 {
		s.rollbackMu.Lock()
		log := strings.Join(s.rollbackLog, "\n")
		s.rollbackMu.Unlock()
		t.Fatalf("false rollback alarm after %d actions: %d rollbacks reported, none made:\n%s", s.steps, n, log)
	}
}

func (s *system) violate(format string, args ...any) {
	v := fmt.Sprintf(format, args...)
	s.t.Log("VIOLATION: " + v)
	s.violations = append(s.violations, v)
}

// record adds IDs handed out by who under key.
func (s *system) record(key, who string, ids ...int64) {
	m := s.plain[key]
	if m == nil {
		m = map[int64]string{}
		s.plain[key] = m
	}
	for _, id := range ids {
		if prev, ok := m[id]; ok {
			s.violate("ID %d of %s handed out twice: by %s and by %s", id, key, prev, who)
			continue
		}
		m[id] = who
	}
}

// recordText adds formatted numbers of tag handed out by who.
func (s *system) recordText(tag, who string, texts []string) {
	m := s.formatted[tag]
	if m == nil {
		m = map[string]string{}
		s.formatted[tag] = m
	}
	for _, x := range texts {
		// The Go client's check (client.Formatted): what it refuses
		// with ErrBadReply, after the IDs were taken.
		if len(x) < 1 || len(x) > protocol.MaxFormattedBytes || strings.ContainsFunc(x, func(r rune) bool { return r <= ' ' || r > '~' }) {
			s.violate("formatted number %q of %s (by %s) is one the client refuses", x, tag, who)
		}
		if prev, ok := m[x]; ok {
			s.violate("formatted number %q of %s handed out twice: by %s and by %s", x, tag, prev, who)
			continue
		}
		m[x] = who
	}
}

func ids(runs []segment.Run) []int64 {
	var out []int64
	for _, r := range runs {
		for id := r.First; ; id++ {
			out = append(out, id)
			if id == r.Last {
				break
			}
		}
	}
	return out
}

// Tag names: few, so that actions meet on them.
var tagNames = []string{"a", "b", "c"}

func (s *system) pickWorker(t *rapid.T, ok func(*worker) bool) *worker {
	var ws []*worker
	for _, w := range s.workers {
		if ok == nil || ok(w) {
			ws = append(ws, w)
		}
	}
	if len(ws) == 0 {
		t.Skip("no such worker")
	}
	return ws[rapid.IntRange(0, len(ws)-1).Draw(t, "worker")]
}

func (s *system) pickTag(t *rapid.T, ok func(tagmodel.Tag) bool) tagmodel.Tag {
	var names []string
	for _, n := range tagNames {
		if tg, exists := s.tags[n]; exists && (ok == nil || ok(tg)) {
			names = append(names, n)
		}
	}
	if len(names) == 0 {
		t.Skip("no such tag")
	}
	return s.tags[rapid.SampledFrom(names).Draw(t, "tag")]
}

// periodKey is the key under which the IDs of tg taken at now are
// recorded: the tag, or its period's name.
func periodKey(tg tagmodel.Tag, now time.Time) string {
	if tg.Reset == tagmodel.ResetNone {
		return tg.Name
	}
	loc, err := tagmodel.LoadLocation(tg.TimeZone)
	if err != nil {
		return tg.Name + "?"
	}
	return tagmodel.PeriodName(tg.Name, tg.Reset.PeriodAt(now, loc).Key)
}

// take is a request: plain single, batch, or formatted.
func (s *system) take(t *rapid.T, kind string) {
	w := s.pickWorker(t, nil)
	tg := s.pickTag(t, nil)
	n := 1
	switch kind {
	case "batch":
		n = rapid.IntRange(2, 40).Draw(t, "n")
	case "formatted":
		n = rapid.IntRange(1, 4).Draw(t, "n")
	}
	ctx, cancel := ctxT()
	defer cancel()
	before := w.now()
	var runs []segment.Run
	var num segment.Numbering
	var err error
	if kind == "formatted" {
		var p *segment.Pending
		runs, num, p, err = w.alloc.TakeNowNumbered(tg.Name, n, nil)
		if err == nil && p != nil {
			runs, err = p.Wait(ctx)
			num = p.Numbering()
		}
	} else {
		runs, err = w.alloc.Take(ctx, tg.Name, n, nil)
	}
	after := w.now()
	who := fmt.Sprintf("%s %s request of %d at %s", w, kind, n, before.Format(time.RFC3339))
	if err != nil {
		t.Logf("%s for %s: %v", who, tg.Name, err)
		s.e.count(s.e.refused, "request: "+errName(err))
		return
	}
	got := ids(runs)
	key, keyAfter := periodKey(tg, before), periodKey(tg, after)
	t.Logf("%s for %s (%s): IDs %v", who, tg.Name, key, shorten(got))
	if key == keyAfter && !w.stale {
		s.record(key, who, got...)
	}
	if kind == "formatted" {
		text := string(num.Append(nil, runs))
		texts := strings.Split(text, "\n")
		t.Logf("  formatted %q", texts)
		if len(texts) != len(got) {
			s.violate("%s: %d formatted numbers for %d IDs: %q", who, len(texts), len(got), text)
		}
		s.recordText(tg.Name, who, texts)
	}
}

// takeUnknown is a request for a tag the model does not know, to a worker
// with --auto-create-tags: the worker creates it with --auto-create-step
// (on its own store only, in per-region mode) and hands out its IDs.
func (s *system) takeUnknown(t *rapid.T) {
	w := s.pickWorker(t, func(w *worker) bool { return w.autoStep > 0 })
	var names []string
	for _, n := range tagNames {
		if _, ok := s.tags[n]; !ok {
			names = append(names, n)
		}
	}
	if len(names) == 0 {
		t.Skip("every tag exists")
	}
	name := rapid.SampledFrom(names).Draw(t, "unknown-tag")
	ctx, cancel := ctxT()
	defer cancel()
	n := rapid.IntRange(1, 3).Draw(t, "n")
	runs, err := w.alloc.Take(ctx, name, n, nil)
	who := fmt.Sprintf("%s auto-create request of %d at %s", w, n, w.now().Format(time.RFC3339))
	if err != nil {
		t.Logf("%s for %s: %v", who, name, err)
		s.e.count(s.e.refused, "request: "+errName(err))
		return
	}
	got := ids(runs)
	t.Logf("%s for %s: IDs %v", who, name, shorten(got))
	if !w.stale {
		s.record(name, who, got...)
	}
	s.reload(t, name)
	if _, ok := s.tags[name]; !ok {
		// Created in another region's store than the one the model reads
		// back: known as a plain tag from now on.
		s.tags[name] = tagmodel.Tag{Name: name, Step: w.autoStep, MaxID: 1}
	}
}

func shorten(ids []int64) string {
	if len(ids) <= 6 {
		return fmt.Sprint(ids)
	}
	return fmt.Sprintf("%v…%v (%d)", ids[:3], ids[len(ids)-2:], len(ids))
}

// errName is a short name of err for the counters.
func errName(err error) string {
	for _, e := range []error{segment.ErrOrdered, segment.ErrNoFormat, tagmodel.ErrPeriodExpired, tagmodel.ErrUnknownTag,
		tagmodel.ErrInvalidArgument, segment.ErrUnavailable, tagmodel.ErrExhausted, tagmodel.ErrRegionMismatch,
		tagmodel.ErrTagExists, tagmodel.ErrInvalidStep, tagmodel.ErrInvalidTag, segment.ErrClosed} {
		if errors.Is(err, e) {
			return e.Error()
		}
	}
	return "other"
}

// The operator's choices.
var (
	steps      = []int64{1, 2, 3, 10, 100, 1000}
	starts     = []int64{1, 1, 2, 50, 1000}
	resets     = []string{"none", "none", "day", "day", "month", "year", "week"}
	zones      = []string{"", "UTC", "Europe/Berlin", "Europe/London", "America/New_York", "Asia/Shanghai", "Pacific/Kiritimati", "Australia/Lord_Howe", "America/Santiago", "Africa/Cairo", "Mars/Olympus"}
	retentions = []int{0, 1, 2, 7, 30, 400, 3660, -1, 4000}
	prefixes   = []string{"", "ORD-", "A", "A1", "X_"}
	layouts    = []string{"20060102", "060102", "Mon0102", "2006-01-_2", "_2Jan06", "200601", "2006", "06", "Jan06", "0102", "2006002", "Monday", "2006-01"}
	seqs       = []string{"{seq}", "{seq:2}", "{seq:4}", "{seq:6}"}
	descs      = []string{"", "orders", "bad\x00text"}
)

// drawFormat draws a format template, valid or not.
func drawFormat(t *rapid.T, withDate bool) string {
	if choose(t, "no-format", []bool{false, true}) {
		return ""
	}
	f := choose(t, "prefix", prefixes)
	if withDate || choose(t, "date-anyway", []bool{false, false, false, true}) {
		f += "{date:" + choose(t, "layout", layouts) + "}" + choose(t, "sep", []string{"", "-"})
	}
	return f + choose(t, "seq", seqs)
}

// admin runs an operator's command on every store of the system, each
// with the operator's region flags for it, as `dispenser tags` does:
// tagmodel.CheckRegions, then f on a store object opened for it.
func (s *system) admin(t *rapid.T, what string, f func(ctx context.Context, a tagmodel.Admin) error) bool {
	ctx, cancel := ctxT()
	defer cancel()
	ok := false
	for _, b := range s.stores {
		st, _, err := b.open(ctx)
		if err == nil {
			if rs, isRS := st.(tagmodel.RegionStore); isRS {
				err = tagmodel.CheckRegions(ctx, rs, b.regions)
			}
		}
		if err == nil {
			err = f(ctx, st.(tagmodel.Admin))
		}
		if err != nil {
			t.Logf("%s on store %d: refused: %v", what, b.region, err)
			s.e.count(s.e.refused, what+": "+errName(err))
			continue
		}
		ok = true
	}
	return ok
}

// reload reads tag's settings as the store holds them and has every
// worker refresh, so that the model and the workers agree on them.
func (s *system) reload(t *rapid.T, name string) {
	ctx, cancel := ctxT()
	defer cancel()
	st, _, err := s.stores[0].open(ctx)
	if err == nil {
		var tg tagmodel.Tag
		if tg, err = st.Tag(ctx, name); err == nil {
			s.tags[name] = tg
		}
	}
	if err != nil {
		t.Logf("reading tag %s back: %v", name, err)
	}
	for _, w := range s.workers {
		if err := w.alloc.Refresh(ctx); err != nil {
			t.Logf("%s: refresh: %v", w, err)
			w.stale = true
		}
	}
}

func (s *system) createTag(t *rapid.T) {
	name := rapid.SampledFrom(tagNames).Draw(t, "name")
	tg := tagmodel.Tag{
		Name:        name,
		Step:        choose(t, "step", steps),
		MaxID:       choose(t, "start", starts),
		Description: choose(t, "description", descs),
		Ordered:     choose(t, "ordered", []bool{false, false, false, true}),
		Reset:       tagmodel.Reset(choose(t, "reset", resets)),
	}
	if tg.Reset != "none" || choose(t, "zone-anyway", []bool{false, false, true}) {
		tg.TimeZone = choose(t, "zone", zones)
		tg.RetentionDays = choose(t, "retention", retentions)
	}
	tg.Format = drawFormat(t, tg.Reset != "none")
	if tg.Reset == "none" {
		tg.Reset = tagmodel.ResetNone
	}
	what := fmt.Sprintf("tags create %s step %d start %d ordered %v reset %s zone %q retention %d format %q description %q",
		name, tg.Step, tg.MaxID, tg.Ordered, tg.Reset, tg.TimeZone, tg.RetentionDays, tg.Format, tg.Description)
	t.Log(what)
	if s.admin(t, "tags create", func(ctx context.Context, a tagmodel.Admin) error { return a.CreateTag(ctx, tg) }) {
		s.reload(t, name)
	}
}

func (s *system) updateTag(t *rapid.T) {
	old := s.pickTag(t, nil)
	var u tagmodel.Update
	var what []string
	maybe := func(label string) bool { return choose(t, "update-"+label, []bool{false, false, true}) }
	if maybe("step") {
		v := choose(t, "step", steps)
		u.Step = &v
		what = append(what, fmt.Sprintf("step %d", v))
	}
	if maybe("description") {
		v := choose(t, "description", descs)
		u.Description = &v
		what = append(what, fmt.Sprintf("description %q", v))
	}
	if maybe("ordered") {
		v := choose(t, "ordered", []bool{false, true})
		u.Ordered = &v
		what = append(what, fmt.Sprintf("ordered %v", v))
	}
	if maybe("reset") {
		v := tagmodel.Reset(choose(t, "reset", resets))
		u.Reset = &v
		what = append(what, fmt.Sprintf("reset %s", v))
	}
	if maybe("zone") {
		v := choose(t, "zone", zones)
		u.TimeZone = &v
		what = append(what, fmt.Sprintf("zone %q", v))
	}
	if maybe("retention") {
		v := choose(t, "retention", retentions)
		u.RetentionDays = &v
		what = append(what, fmt.Sprintf("retention %d", v))
	}
	if maybe("format") {
		v := drawFormat(t, old.Reset != tagmodel.ResetNone || u.Reset != nil)
		u.Format = &v
		what = append(what, fmt.Sprintf("format %q", v))
	}
	if len(what) == 0 {
		t.Skip("nothing to change")
	}
	t.Logf("tags update %s: %s", old.Name, strings.Join(what, ", "))
	if s.admin(t, "tags update", func(ctx context.Context, a tagmodel.Admin) error { return a.UpdateTag(ctx, old.Name, u) }) {
		s.reload(t, old.Name)
	}
}

// clock sets the system's clock jump: years and days from now.
func (s *system) clock(t *rapid.T) {
	y := choose(t, "years", []int64{0, 0, 1, 6, 11, 28, 100, -1})
	d := choose(t, "days", []int64{0, 0, 1, -1, -2, -30, -40, 3, 183})
	s.years.Store(y)
	s.days.Store(d)
	t.Logf("clock: now %+d years %+d days: %s", y, d, s.now().Format(time.RFC3339))
}

func (s *system) pickStore(t *rapid.T) *backend {
	return s.stores[rapid.IntRange(0, len(s.stores)-1).Draw(t, "store")]
}

func (s *system) prune(t *rapid.T) {
	b := s.pickStore(t)
	ctx, cancel := ctxT()
	defer cancel()
	st, _, err := b.open(ctx)
	if err != nil {
		t.Fatalf("open store: %v", err)
	}
	n, err := st.(tagmodel.PeriodPruner).PrunePeriods(ctx)
	t.Logf("prune store %d: %d rows, %v", b.region, n, err)
}

// startWorker starts a worker of a random region as the mode says, or a
// misconfigured one: any store, any region settings.
func (s *system) startWorker(t *rapid.T, misconf bool) {
	if len(s.workers) >= 5 {
		t.Skip("enough workers")
	}
	w := &worker{sys: s, misconf: misconf}
	w.region = rapid.IntRange(0, s.regions-1).Draw(t, "region")
	w.be = s.stores[0]
	if s.mode == modePerRegion {
		w.be = s.stores[w.region]
	}
	w.regions = w.be.regions
	if misconf {
		if len(s.tags) == 0 && s.mode != modePerRegion {
			// Per-region settings recorded on the one store before its
			// first tag refuse every worker and command of the mode:
			// nothing more to see in this run.
			t.Skip("a misconfigured worker on a new store of one region")
		}
		w.be = s.pickStore(t)
		w.regions = choose(t, "misconfig-regions", []tagmodel.Regions{{}, {Count: 2, Region: 0}, {Count: 2, Region: 1}, {Count: 3, Region: 2}})
		if w.regions == w.be.regions {
			t.Skip("not misconfigured")
		}
	}
	w.wbucket = s.witnessBucket(w.region)
	w.offset = choose(t, "offset", []time.Duration{0, 0, time.Hour, -time.Hour, -25 * time.Hour, 25 * time.Hour, -30 * 24 * time.Hour})
	w.idle = choose(t, "idle", []bool{false, false, true})
	w.maxStep = choose(t, "max-step", []int64{0, 0, 1, 5, 2000})
	w.maxDepth = choose(t, "max-depth", []int64{0, 0, 1, 3})
	w.prefetch = choose(t, "prefetch-ratio", []float64{0, 0, 0.5, 1})
	w.bufferTime = choose(t, "buffer-time", []time.Duration{0, 0, time.Second})
	if !misconf {
		// Not a misconfigured worker: one with another region's settings
		// on a new store of per-region mode records them there, and
		// creating tags on first use it hands out the IDs of the region
		// it names (an open hole: nothing ties a region to one store;
		// seed 14697643093769617685 of TestModel/kv with
		// DISPENSER_MODEL_CHECKS=40 showed it before this exclusion).
		w.autoStep = choose(t, "auto-create-step", []int64{0, 0, 1, 7})
	}
	s.nextID++
	w.id = s.nextID
	if err := s.start(w); err != nil {
		t.Logf("%s refused: %v", w, err)
		s.e.count(s.e.refused, "worker start: "+errName(err))
		return
	}
	t.Logf("%s started", w)
	s.workers = append(s.workers, w)
}

// start opens w's stores and allocator, as a worker process does.
func (s *system) start(w *worker) error {
	ctx, cancel := ctxT()
	defer cancel()
	st, raiser, err := w.be.open(ctx)
	if err != nil {
		return err
	}
	if rs, ok := st.(tagmodel.RegionStore); ok {
		if err := tagmodel.CheckRegions(ctx, rs, w.regions); err != nil {
			return err
		}
	}
	if w.wbucket != "" {
		ws, err := witness.Open(ctx, s.e.js, raiser, witness.Settings{Bucket: w.wbucket, Logger: discard, OnRollback: s.onRollback})
		if err != nil {
			return err
		}
		st = ws
	}
	idle := time.Duration(-1)
	if w.idle {
		idle = 60 * time.Millisecond
	}
	a, err := segment.New(segment.Settings{
		Store: st, Now: w.now, Regions: w.regions, Logger: discard,
		RefreshInterval: time.Hour, IdleTimeout: idle,
		MaxWait: 500 * time.Millisecond, ColdWait: 2 * time.Second, FetchTimeout: 5 * time.Second,
		MaxStep: w.maxStep, MaxDepth: w.maxDepth, PrefetchRatio: w.prefetch, BufferTime: w.bufferTime,
		AutoCreateStep: w.autoStep,
	})
	if err != nil {
		return err
	}
	select {
	case <-a.Loaded():
	case <-ctx.Done():
		a.Close(context.Background())
		return fmt.Errorf("tag list not loaded: %w", ctx.Err())
	}
	w.alloc, w.stale = a, false
	return nil
}

// stopWorker stops a worker with give-back, crashes it (no give-back), or
// restarts it (stop, then start with the same settings).
func (s *system) stopWorker(t *rapid.T, how string) {
	w := s.pickWorker(t, nil)
	ctx, cancel := ctxT()
	if how == "crash" {
		cancel() // Close's give-backs fail at once: nothing is given back
	}
	err := w.alloc.Close(ctx)
	cancel()
	t.Logf("%s: %s (%v)", w, how, err)
	i := slices.Index(s.workers, w)
	s.workers = slices.Delete(s.workers, i, i+1)
	if how != "restart" {
		return
	}
	if err := s.start(w); err != nil {
		t.Logf("%s: restart refused: %v", w, err)
		s.e.count(s.e.refused, "worker start: "+errName(err))
		return
	}
	s.workers = append(s.workers, w)
}

// idle leaves an idle-prone worker alone until it released a tag.
func (s *system) idle(t *rapid.T) {
	w := s.pickWorker(t, func(w *worker) bool { return w.idle })
	before := w.alloc.Released()
	deadline := time.Now().Add(time.Second)
	for w.alloc.Released() == before && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	t.Logf("%s idle: released %d tags", w, w.alloc.Released()-before)
}

// rows reads every row's max_id of b (tags' and periods'), not the
// region record.
func (b *backend) rows(ctx context.Context) (map[string]int64, error) {
	q := "SELECT biz_tag, max_id FROM leaf_alloc WHERE biz_tag NOT LIKE '%.%'"
	out := map[string]int64{}
	read := func(rows interface {
		Next() bool
		Scan(...any) error
		Err() error
	}) error {
		for rows.Next() {
			var name string
			var v int64
			if err := rows.Scan(&name, &v); err != nil {
				return err
			}
			out[name] = v
		}
		return rows.Err()
	}
	switch b.sys.e.kind {
	case "postgres":
		rows, err := b.pool.Query(ctx, q)
		if err != nil {
			return nil, err
		}
		defer rows.Close()
		return out, read(rows)
	case "mysql":
		rows, err := b.db.QueryContext(ctx, q+" UNION ALL SELECT biz_tag, max_id FROM dispenser_period")
		if err != nil {
			return nil, err
		}
		defer rows.Close()
		return out, read(rows)
	}
	return nil, errors.New("no rows in a KV store")
}

// snapshot records the store's rows, for a later rollback.
func (s *system) snapshot(t *rapid.T) {
	if !s.witness {
		t.Skip("rollbacks only with the witness")
	}
	b := s.pickStore(t)
	ctx, cancel := ctxT()
	defer cancel()
	rows, err := b.rows(ctx)
	if err != nil {
		t.Fatalf("snapshot: %v", err)
	}
	s.snapshots = append(s.snapshots, snapshot{be: b, rows: rows})
	t.Logf("snapshot %d of store %d: %v", len(s.snapshots)-1, b.region, rows)
}

// rollback makes a store lose its writes since a snapshot, as a failover
// to a replica that missed them does: each row's max_id back to the
// snapshot's, periods' rows created since deleted. Only with the witness:
// without it, duplicates after a rollback are documented.
func (s *system) rollback(t *rapid.T) {
	if !s.witness || len(s.snapshots) == 0 || s.leafActions > 0 {
		// Leaf has no witness: its IDs are not protected from a rollback.
		t.Skip("no snapshot, or Leaf beside")
	}
	snap := s.snapshots[rapid.IntRange(0, len(s.snapshots)-1).Draw(t, "snapshot")]
	ctx, cancel := ctxT()
	defer cancel()
	now, err := snap.be.rows(ctx)
	if err != nil {
		t.Fatalf("rollback: %v", err)
	}
	s.rollbackActions++
	var done []string
	for name, v := range now {
		old, ok := snap.rows[name]
		period := strings.Contains(name, tagmodel.PeriodSep)
		if ok && old >= v || !ok && !period {
			continue
		}
		var q string
		var args []any
		switch {
		case s.e.kind == "postgres" && ok:
			q, args = "UPDATE leaf_alloc SET max_id = $1 WHERE biz_tag = $2", []any{old, name}
		case s.e.kind == "postgres":
			q, args = "DELETE FROM leaf_alloc WHERE biz_tag = $1", []any{name}
		case ok && period:
			q, args = "UPDATE dispenser_period SET max_id = ? WHERE biz_tag = ?", []any{old, name}
		case ok:
			q, args = "UPDATE leaf_alloc SET max_id = ? WHERE biz_tag = ?", []any{old, name}
		default:
			q, args = "DELETE FROM dispenser_period WHERE biz_tag = ?", []any{name}
		}
		if s.e.kind == "postgres" {
			_, err = snap.be.pool.Exec(ctx, q, args...)
		} else {
			_, err = snap.be.db.ExecContext(ctx, q, args...)
		}
		if err != nil {
			t.Fatalf("rollback %s: %v", q, err)
		}
		done = append(done, fmt.Sprintf("%s %d→%d", name, v, old))
	}
	sort.Strings(done)
	t.Logf("rollback of store %d to a snapshot: %v", snap.be.region, done)
}

// leaf is a Leaf server beside dispenser on a MariaDB store: Leaf's own
// transaction on a plain tag's row, its whole segment handed out. Not
// after a rollback (Leaf has no witness).
func (s *system) leaf(t *rapid.T) {
	if s.e.kind != "mysql" || s.rollbackActions > 0 {
		t.Skip("Leaf beside MariaDB, without rollbacks")
	}
	tg := s.pickTag(t, func(tg tagmodel.Tag) bool { return tg.Reset == tagmodel.ResetNone })
	b := s.pickStore(t)
	ctx, cancel := ctxT()
	defer cancel()
	start, end, err := leafsql.Fetch(ctx, b.db, tg.Name, 0)
	if err != nil {
		t.Logf("leaf on store %d: %v", b.region, err)
		return
	}
	s.leafActions++
	t.Logf("leaf on store %d: %s [%d, %d)", b.region, tg.Name, start, end)
	var got []int64
	for v := start; v < end && v-start < 2000; v++ {
		got = append(got, v)
	}
	s.record(tg.Name, fmt.Sprintf("Leaf on store %d", b.region), got...)
}

// hookRaiser runs before() ahead of the inner store's GiveBack.
type hookRaiser struct {
	witness.Raiser
	before func()
}

func (h *hookRaiser) GiveBack(ctx context.Context, tag string, end, firstUnissued int64) (bool, error) {
	if h.before != nil {
		h.before()
	}
	return h.Raiser.GiveBack(ctx, tag, end, firstUnissued)
}

// raceGiveBack: worker A fetches a segment of a plain tag, hands out part
// of it and gives the rest back; between its witness lowering the mark and
// its store update, worker B fetches, hands out part and gives back.
func (s *system) raceGiveBack(t *rapid.T) {
	if !s.witness {
		t.Skip("a witness race")
	}
	tg := s.pickTag(t, func(tg tagmodel.Tag) bool { return tg.Reset == tagmodel.ResetNone && !tg.Ordered })
	region := rapid.IntRange(0, s.regions-1).Draw(t, "region")
	b := s.stores[0]
	if s.mode == modePerRegion {
		b = s.stores[region]
	}
	ctx, cancel := ctxT()
	defer cancel()
	open := func(hook *hookRaiser) *witness.Store {
		_, raiser, err := b.open(ctx)
		if err != nil {
			t.Fatalf("open: %v", err)
		}
		if hook != nil {
			hook.Raiser = raiser
			raiser = hook
		}
		w, err := witness.Open(ctx, s.e.js, raiser, witness.Settings{Bucket: s.witnessBucket(region), Logger: discard, OnRollback: s.onRollback})
		if err != nil {
			t.Fatalf("witness: %v", err)
		}
		return w
	}
	hook := &hookRaiser{}
	wa, wb := open(hook), open(nil)
	hand := func(who string, a tagmodel.Allocation) int64 {
		k := rapid.Int64Range(0, a.End-a.Start-1).Draw(t, "handed")
		var got []int64
		for v := a.Start; v < a.Start+k; v++ {
			got = append(got, b.regions.ID(v))
		}
		s.record(tg.Name, who, got...)
		return a.Start + k
	}
	a, err := wa.Fetch(ctx, tg.Name, 0)
	if err != nil {
		t.Logf("race: A's fetch: %v", err)
		return
	}
	firstA := hand("race worker A", a)
	hook.before = func() {
		hook.before = nil
		bs, err := wb.Fetch(ctx, tg.Name, 0)
		if err != nil {
			t.Logf("race: B's fetch: %v", err)
			return
		}
		firstB := hand("race worker B", bs)
		ok, err := wb.GiveBack(ctx, tg.Name, bs.End, firstB)
		t.Logf("race: B fetched [%d, %d), gave back from %d: %v %v", bs.Start, bs.End, firstB, ok, err)
	}
	ok, err := wa.GiveBack(ctx, tg.Name, a.End, firstA)
	t.Logf("race: A fetched [%d, %d), gave back from %d: %v %v", a.Start, a.End, firstA, ok, err)
}
