package snowflake

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	mrand "math/rand/v2"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/dispenser-dev/dispenser/internal/kvbucket"
	"github.com/dispenser-dev/dispenser/lease"
	"github.com/nats-io/nats.go/jetstream"
)

// Node defaults.
const (
	DefaultBucket = "dispenser_workers"
	// DefaultLease and DefaultHeartbeat are package lease's, sized from
	// JetStream leader elections.
	DefaultLease     = lease.DefaultLease
	DefaultHeartbeat = lease.DefaultHeartbeat
)

// NodeSettings configure a Node. The zero value of every field means its
// documented default. They are read once, by Start.
type NodeSettings struct {
	// Settings are the generator's: Epoch, Layout, RandomSequence,
	// MaxBackwards, MaxBorrow, Now and Logger as documented there; but
	// WorkerID must be zero, since a Node leases its worker ID. The epoch
	// and the layout are recorded in the bucket by the first node to use
	// it; a node configured with others refuses to start
	// (ErrEpochMismatch, ErrLayoutMismatch).
	Settings
	// Bucket is the JetStream key-value bucket holding the leases, created
	// if missing. Default DefaultBucket.
	Bucket string
	// Replicas of the bucket when it is created, and the fewest an
	// existing bucket may have (ErrBucketReplicas); more are accepted.
	// Default 1.
	Replicas int
	// Cluster, if not empty, is the NATS cluster the bucket is created in
	// (JetStream placement): a region's own cluster, so that its leases
	// never wait on another region. Default: where JetStream places it.
	Cluster string
	// Region is the node's region, 0..Layout.MaxRegion(): it claims
	// only the worker IDs whose top Layout.RegionBits are Region
	// (Layout.RegionWorkerIDs). It is recorded in the bucket with the
	// layout; a node of another region is refused (ErrRegionMismatch),
	// because each region leases from a bucket of its own. Default 0.
	Region int
	// Instance names this process in the leases. A restart with the same
	// name prefers its previous worker ID once that is claimable: at once
	// after a graceful Close, about two leases after a crash (meanwhile it
	// takes another). Default: host name, "-", and six random characters
	// (so a restart does not find its old ID).
	Instance string
	// Lease is how long a lease lives without a heartbeat. Default
	// DefaultLease.
	Lease time.Duration
	// Heartbeat is the interval between lease renewals; it must be shorter
	// than Lease. Default DefaultHeartbeat, or Lease/3 if that is shorter.
	Heartbeat time.Duration

	// shuffle orders candidate worker IDs; nil means math/rand/v2.Shuffle.
	// Tests inject a seeded one.
	shuffle func(n int, swap func(i, j int))
	// manual leaves heartbeats and claims to the test (no background
	// loop).
	manual bool
}

// normalize fills in defaults and validates.
func (s NodeSettings) normalize() (NodeSettings, error) {
	if s.Bucket == "" {
		s.Bucket = DefaultBucket
	}
	if s.Replicas == 0 {
		s.Replicas = 1
	}
	if s.Replicas < 1 || s.Replicas > 5 {
		return s, fmt.Errorf("%w: Replicas %d not in 1..5", ErrInvalidSettings, s.Replicas)
	}
	if s.WorkerID != 0 {
		return s, fmt.Errorf("%w: WorkerID %d: a Node leases its worker ID from the bucket; leave WorkerID zero", ErrInvalidSettings, s.WorkerID)
	}
	if s.Instance == "" {
		host, err := os.Hostname()
		if err != nil || host == "" {
			host = "snowflake"
		}
		s.Instance = host + "-" + strings.ToLower(rand.Text()[:6])
	}
	ls, err := (lease.Settings{Lease: s.Lease, Heartbeat: s.Heartbeat}).Check() // fills in the defaults
	if err != nil {
		return s, fmt.Errorf("%w: %w", ErrInvalidSettings, err)
	}
	s.Lease, s.Heartbeat = ls.Lease, ls.Heartbeat
	if s.Epoch.IsZero() {
		s.Epoch = DefaultEpoch
	}
	s.Epoch = s.Epoch.UTC()
	if s.Now == nil {
		s.Now = time.Now
	}
	if s.Logger == nil {
		s.Logger = slog.Default()
	}
	if s.shuffle == nil {
		s.shuffle = mrand.Shuffle
	}
	return s, nil
}

// Node issues IDs under a worker ID leased from a JetStream key-value
// bucket, and keeps the lease alive in the background. It is safe for
// concurrent use.
//
// A Node issues IDs only while it holds a lease it has renewed within the
// lease duration (by the monotonic clock), and never with a timestamp above
// the bound recorded in its lease value. If it loses its worker ID to
// another holder it stops issuing and claims a new one in the background;
// meanwhile AppendIDs returns ErrFenced.
type Node struct {
	gen     *Generator
	kv      jetstream.KeyValue
	cfg     NodeSettings
	log     *slog.Logger
	session string

	// ctx is owned by the Node and canceled by Close; background work
	// runs on it, never on a caller's context.
	ctx    context.Context
	cancel context.CancelFunc
	done   chan struct{} // closed when the background loop has exited
	kick   chan struct{} // asks the loop for a heartbeat or claim now

	paused    atomic.Bool // tests: skip heartbeats as if partitioned
	closeOnce sync.Once
	closeErr  error
	// terms are the lease's duration and clocks (the generator's
	// monotonic clock, which fences).
	terms lease.Settings
	// holder runs the heartbeats (on ctx) and logs their failures.
	holder *lease.Holder
	// stream is the bucket's stream when the worker started: another one
	// is a new bucket, whose revisions restart (checkBucket).
	stream *lease.Stream

	// mu protects the lease bookkeeping below. Lock order: mu, then gen.mu.
	mu     sync.Mutex
	id     int         // held worker ID; -1: none
	rev    uint64      // revision of our last write to the key
	rec    leaseRecord // our last write to the key
	closed bool
	// owed is a write-back still to be made: our key was deleted or
	// purged while we held it, and the bound we held must be written
	// back over the marker (writeBack). No claim is made before.
	owed *owedRecord
	// gone is set, for good, once the bucket was found deleted or
	// recreated: the worker neither issues nor writes any more.
	gone          error
	writeBacks    uint64
	claimErr      string // class of the last claim failure, for rate-limited logs
	heartbeats    uint64
	losses        uint64
	claims        uint64
	claimFailures uint64
}

// Start opens (or creates) the lease bucket, checks the epoch stored
// in it, claims a worker ID and starts heartbeats. ctx bounds start-up only;
// heartbeats run until Close.
//
// It returns an error wrapping ErrBucketTTL, ErrBucketLimits,
// ErrBucketMemory or ErrBucketReplicas if the bucket can drop values,
// ErrEpochMismatch if the bucket has another epoch, ErrLayoutMismatch if it
// has another layout (a bucket without one has DefaultLayout), ErrEpochLost
// if its
// epoch was deleted or purged, ErrNoWorkerID if all worker IDs are held by
// live leases (or are deleted keys still within their margin), and
// ErrInvalidSettings, ErrEpochInFuture or ErrOverTimeLimit for bad settings.
//
// If the clock is behind the highest timestamp recorded for the claimed
// worker ID (a predecessor released it with a clock ahead of ours), it logs
// an error and returns a Node whose AppendIDs fails with ErrClockBackwards
// until the clock has caught up.
func Start(ctx context.Context, js jetstream.JetStream, s NodeSettings) (*Node, error) {
	cfg, err := s.normalize()
	if err != nil {
		return nil, err
	}
	gs := cfg.Settings
	gs.Now = s.Now // nil keeps the single-reading fast path
	gen, err := newGenerator(gs, true)
	if err != nil {
		return nil, err
	}
	if cfg.Region < 0 || cfg.Region > gen.layout.MaxRegion() {
		return nil, fmt.Errorf("%w: Region %d not in 0..%d (layout %s)", ErrInvalidSettings, cfg.Region, gen.layout.MaxRegion(), gen.layout)
	}
	kv, err := openBucket(ctx, js, &cfg)
	if err != nil {
		return nil, err
	}
	if err := checkEpoch(ctx, kv, cfg.Epoch, gen.layout, cfg.Region, cfg.Lease); err != nil {
		return nil, err
	}
	stream, err := lease.NewStream(ctx, kv)
	if err != nil {
		return nil, fmt.Errorf("snowflake: lease bucket %q: %w", cfg.Bucket, err)
	}
	w := &Node{
		terms:   lease.Settings{Lease: cfg.Lease, Heartbeat: cfg.Heartbeat, Clock: lease.Clock{Now: cfg.Now, Mono: gen.monoNow}},
		stream:  stream,
		gen:     gen,
		kv:      kv,
		cfg:     cfg,
		log:     cfg.Logger.With("instance", cfg.Instance, "bucket", cfg.Bucket),
		session: rand.Text(),
		done:    make(chan struct{}),
		kick:    make(chan struct{}, 1),
		id:      -1,
	}
	gen.log = w.log
	gen.stall = w.poke
	c, err := w.claim(ctx)
	if err != nil {
		return nil, err
	}
	w.install(c)
	w.ctx, w.cancel = context.WithCancel(context.WithoutCancel(ctx))
	w.holder = &lease.Holder{
		Settings: w.terms, KV: kv, Ctx: w.ctx, Log: w.log, Warning: "snowflake: heartbeat failed", ErrKey: "error",
		Ours: func(e jetstream.KeyValueEntry) bool {
			var cur leaseRecord
			return json.Unmarshal(e.Value(), &cur) == nil && cur.Session == w.session && !cur.Released
		},
	}
	if cfg.manual {
		close(w.done)
	} else {
		go w.run()
	}
	return w, nil
}

// poke asks the loop for a heartbeat or claim now. It never blocks.
func (w *Node) poke() {
	select {
	case w.kick <- struct{}{}:
	default:
	}
}

// install makes a won claim the current lease.
func (w *Node) install(c claim) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.id, w.rev, w.rec = c.id, c.rev, c.rec
	w.claims++
	boundMs := c.rec.Bound.UnixMilli() - w.gen.epochMs
	w.gen.assign(c.id, c.floorMs, boundMs, c.mono+w.cfg.Lease)
	nowMs := c.rec.Heartbeat.UnixMilli() - w.gen.epochMs
	attrs := []any{"worker", c.id, "lease_expires", c.rec.Expires, "bound", c.rec.Bound}
	if c.floorMs >= 0 {
		attrs = append(attrs, "previous_bound", w.gen.msTime(c.floorMs))
	}
	w.log.Info("snowflake: claimed worker ID", attrs...)
	if c.floorMs-nowMs > w.gen.maxBackMs {
		w.log.Error("snowflake: clock is behind the highest timestamp recorded for the claimed worker ID; "+
			"refusing to issue IDs until it catches up",
			"worker", c.id, "clock", c.rec.Heartbeat, "recorded", w.gen.msTime(c.floorMs),
			"behind", time.Duration(c.floorMs-nowMs)*time.Millisecond)
	}
}

// run renews the lease every Heartbeat, and claims a new worker ID when the
// old one is lost, until Close cancels w.ctx (lease.Holder.Run: kicks come
// from refused requests, spaced so that a storm of them does not hammer
// NATS; a failed heartbeat is tried again after lease.Settings.Retry).
func (w *Node) run() {
	defer close(w.done)
	w.holder.Run(w.kick, w.round)
}

// round is one turn of the loop: a heartbeat while a worker ID is held, a
// write-back owed, or a claim. It reports whether to try again soon.
func (w *Node) round() (retry bool) {
	if w.paused.Load() {
		return false
	}
	w.mu.Lock()
	held, owed, gone := w.id >= 0, w.owed != nil, w.gone != nil
	w.mu.Unlock()
	switch {
	case gone:
		// Stopped for good; Close ends the loop.
	case held:
		return w.heartbeat()
	case owed:
		ctx, cancel := context.WithTimeout(w.ctx, w.cfg.Lease)
		if w.writeBack(ctx) {
			w.poke()
		}
		cancel()
	default:
		w.reclaim()
	}
	return false
}

// checkBucket makes sure the bucket is the one the worker started on. A
// bucket deleted (and maybe created again) while the worker runs has lost
// every bound; in a new one revisions restart, so a compare-and-swap on a
// revision of the old one could succeed against someone else's record. So
// the worker stops for good (stop), loudly, and checkBucket returns
// ErrBucketDeleted. It returns another error if the bucket could not be
// read (the caller then acts as on any failed write: not at all).
func (w *Node) checkBucket(ctx context.Context) error {
	w.mu.Lock()
	gone := w.gone
	w.mu.Unlock()
	if gone != nil {
		return gone
	}
	err := w.stream.Check(ctx)
	switch {
	case errors.Is(err, lease.ErrBucketDeleted):
		w.stop(fmt.Errorf("%w: bucket %q no longer exists (nats kv rm / nats stream rm); every lease bound in it is lost",
			ErrBucketDeleted, w.cfg.Bucket))
	case errors.Is(err, lease.ErrRecreated):
		w.stop(fmt.Errorf("%w: bucket %q was deleted and created again (its stream was created at %s, now another); "+
			"every lease bound in it is lost and its revisions restarted: %w", ErrBucketDeleted, w.cfg.Bucket,
			w.stream.Created().UTC().Format(TimeLayout), err))
	case err != nil:
		return fmt.Errorf("snowflake: read lease bucket %q: %w", w.cfg.Bucket, err)
	default:
		return nil
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.gone
}

// stop stops the worker for good after the bucket was deleted or
// recreated: it issues nothing more and writes nothing more.
func (w *Node) stop(err error) {
	w.mu.Lock()
	first := w.gone == nil
	if first {
		w.gone = err
		w.id = -1
		w.owed = nil
	}
	w.mu.Unlock()
	if !first {
		return
	}
	w.gen.revoke(err)
	w.log.Error("snowflake: the lease bucket was deleted or replaced while this worker ran; it stops issuing IDs for good. "+
		"Stop every worker of the bucket and start them again only after twice the longest lease has passed "+
		"since the last one stopped (the bounds that kept successors above the IDs issued are gone)", "error", err)
}

// heartbeat renews the lease (lease.Holder.Renew): a CAS write of the
// current time and a bound at least a lease ahead. Only after the write
// succeeded may the generator use the new bound, so the recorded bound
// always covers what was issued. It reports whether it failed for want of
// an answer, and should be tried again soon. The whole round waits at most
// lease.Settings.Attempt (why: lease.Holder).
func (w *Node) heartbeat() (retry bool) {
	ctx, cancel := context.WithTimeout(w.ctx, w.terms.Attempt())
	defer cancel()
	// Before writing on a revision, make sure the bucket is the one that
	// revision belongs to.
	if err := w.checkBucket(ctx); err != nil {
		if !errors.Is(err, ErrBucketDeleted) {
			id, _ := w.WorkerID()
			w.holder.Failed(err, "worker", id)
			return true
		}
		return false
	}
	w.mu.Lock()
	id, rev := w.id, w.rev
	oldBoundMs := w.rec.Bound.UnixMilli() - w.gen.epochMs
	w.mu.Unlock()
	if id < 0 {
		return false
	}
	var rec leaseRecord
	r := w.holder.Renew(ctx, workerKey(id), rev, func(now time.Time) ([]byte, error) {
		nowMs := now.UnixMilli() - w.gen.epochMs
		rec = w.newRecord(id, now, max(oldBoundMs, nowMs+w.cfg.Lease.Milliseconds()))
		return json.Marshal(rec)
	}, "worker", id)
	switch r.Outcome {
	case lease.Renewed:
		w.mu.Lock()
		w.rev, w.rec = r.Grant.Rev, rec
		w.heartbeats++
		w.holder.Succeeded()
		w.gen.renew(rec.Bound.UnixMilli()-w.gen.epochMs, r.Grant.Mono+w.cfg.Lease)
		w.mu.Unlock()
		return false
	case lease.Closing:
		return false
	case lease.Gone:
		w.holder.Failed(r.Err, "worker", id)
		return true
	case lease.Failed, lease.Behind:
		return true
	case lease.Adopted:
		var cur leaseRecord
		_ = json.Unmarshal(r.Entry.Value(), &cur) // Ours decoded it
		w.mu.Lock()
		w.rev, w.rec = r.Entry.Revision(), cur
		w.mu.Unlock()
		w.poke()
		return false
	}
	e := r.Entry
	if e != nil && e.Operation() == jetstream.KeyValuePut {
		var cur leaseRecord
		_ = json.Unmarshal(e.Value(), &cur)
		w.gen.revoke(ErrFenced)
		w.mu.Lock()
		w.id = -1
		w.losses++
		w.mu.Unlock()
		w.log.Warn("snowflake: lost worker ID to another holder; claiming a new one", "worker", id, "holder", cur.Instance)
		w.poke()
		return false
	}
	// Deleted or purged (a marker), or gone without a trace (the stream
	// was purged). Our bound is the only record left of what we may have
	// issued: stop issuing, then write it back over the marker so that a
	// successor starts above it.
	lastMs := w.gen.revoke(ErrFenced)
	w.mu.Lock()
	owed := w.owedLocked(e, lastMs)
	w.id = -1
	w.losses++
	w.owed = owed
	w.mu.Unlock()
	w.log.Error("snowflake: this worker's lease key was "+owed.what+" while it held it; "+
		"stopped issuing under it and writing back the last timestamp it used, so that a successor starts above it; "+
		"then claiming a worker ID", "worker", id, "bound", owed.rec.Bound)
	if w.writeBack(ctx) {
		w.poke()
	}
	return false
}

// owedRecord is a write-back to make: rec (released, with the bound held)
// by compare-and-swap on rev, the revision of the marker found (0: the key
// had no message at all).
type owedRecord struct {
	rec  leaseRecord
	rev  uint64
	what string // what happened to the key, for logs
}

// owedLocked returns the write-back owed for our key, whose latest message
// is e (a delete or purge marker, or nil for none at all). The bound
// written is the last timestamp used, lastMs, read from the generator after
// it stopped issuing (revoke): the tight form of the bound we held, as on a
// graceful release, so that we may take the key back at once. Call with
// w.mu held.
func (w *Node) owedLocked(e jetstream.KeyValueEntry, lastMs int64) *owedRecord {
	o := &owedRecord{rec: w.rec, what: "removed without a marker (the bucket's stream was purged: nats stream purge)"}
	if e != nil {
		o.rev = e.Revision()
		cmd := "nats kv del"
		if e.Operation() == jetstream.KeyValuePurge {
			cmd = "nats kv purge"
		}
		o.what = fmt.Sprintf("%s (%s) at %s", kvbucket.MarkerVerb(e.Operation()), cmd, e.Created().UTC().Format(TimeLayout))
	}
	now := w.cfg.Now().UTC().Round(0)
	boundMs := max(lastMs, 0)
	o.rec.Heartbeat, o.rec.Expires = now, now
	o.rec.Bound = w.gen.msTime(boundMs)
	o.rec.Released = true
	return o
}

// writeBack makes the write-back owed, if any, and reports whether none is
// owed any more. The compare-and-swap on the marker's revision fails if
// anyone wrote the key since; then a successor holds it, which took it
// only a margin after the marker (deletedRecord), and there is nothing
// left to do.
func (w *Node) writeBack(ctx context.Context) bool {
	w.mu.Lock()
	o := w.owed
	w.mu.Unlock()
	if o == nil {
		return true
	}
	if err := w.checkBucket(ctx); err != nil {
		return errors.Is(err, ErrBucketDeleted)
	}
	key := workerKey(o.rec.Worker)
	data, err := json.Marshal(o.rec)
	if err != nil {
		w.log.Error("snowflake: encode lease", "error", err)
		return false
	}
	rev := o.rev
	for attempt := 1; ; attempt++ {
		_, err = w.kv.Update(ctx, key, data, rev)
		if attempt == 3 || !kvbucket.Conflict(err) {
			break
		}
		// The revision we found may have been a stale read, or the key
		// deleted again: only a value written since stops us.
		e, gerr := kvbucket.Latest(ctx, w.kv, key)
		if gerr != nil {
			err = gerr
			break
		}
		if e != nil && e.Operation() == jetstream.KeyValuePut {
			break
		}
		var next uint64
		if e != nil {
			next = e.Revision()
		}
		if next == rev {
			break
		}
		rev = next
	}
	switch {
	case err == nil:
		w.log.Warn("snowflake: wrote back a released lease over the deleted or purged key; a successor starts above its bound",
			"worker", o.rec.Worker, "bound", o.rec.Bound)
	case kvbucket.Conflict(err):
		w.log.Error("snowflake: could not write back the bound of a deleted or purged lease key: it was written since; "+
			"its new holder started above a floor derived from the deletion", "worker", o.rec.Worker, "bound", o.rec.Bound)
	default:
		w.log.Warn("snowflake: writing back the bound of a deleted or purged lease key failed; will retry",
			"worker", o.rec.Worker, "error", err)
		return false
	}
	w.mu.Lock()
	if w.owed == o {
		w.owed = nil
		if err == nil {
			w.writeBacks++
		}
	}
	w.mu.Unlock()
	return true
}

// reclaim claims a worker ID after the old one was lost.
func (w *Node) reclaim() {
	ctx, cancel := context.WithTimeout(w.ctx, max(w.cfg.Lease, 5*time.Second))
	defer cancel()
	c, err := w.claim(ctx)
	if err != nil {
		if w.ctx.Err() != nil || errors.Is(err, ErrBucketDeleted) {
			return
		}
		class := "other"
		for _, e := range []error{ErrNoWorkerID, ErrEpochLost, ErrEpochMismatch, ErrLayoutMismatch} {
			if errors.Is(err, e) {
				class = e.Error()
			}
		}
		w.mu.Lock()
		w.claimFailures++
		log := w.claimFailures == 1 || class != w.claimErr || w.claimFailures%100 == 0
		w.claimErr = class
		w.mu.Unlock()
		if errors.Is(err, ErrEpochLost) || errors.Is(err, ErrEpochMismatch) || errors.Is(err, ErrLayoutMismatch) {
			// Refuse with the reason, not a bare ErrFenced.
			w.gen.revoke(fmt.Errorf("%w: %w", ErrFenced, err))
			if log {
				w.log.Error("snowflake: cannot claim a worker ID; refusing to issue IDs until the bucket is repaired", "error", err)
			}
			return
		}
		if log {
			w.log.Warn("snowflake: claiming a worker ID failed; will retry", "error", err)
		}
		return
	}
	w.mu.Lock()
	w.claimFailures = 0
	w.claimErr = ""
	w.mu.Unlock()
	w.install(c)
}

// AppendIDs appends n new IDs in increasing order to dst, n in
// 1..Layout().MaxCount(). It issues all n or none. Errors: ErrInvalidCount (400); ErrFenced,
// ErrClockBackwards, ErrOverloaded, ErrClosed (all errors.Is ErrUnavailable:
// 503); ErrOverTimeLimit (500).
func (w *Node) AppendIDs(dst []int64, n int) ([]int64, error) {
	return w.gen.AppendIDs(dst, n)
}

// Next returns one new ID; errors as for AppendIDs.
func (w *Node) Next() (int64, error) { return w.gen.Next() }

// Servable reports whether the worker can issue IDs now (Generator.Servable):
// it holds a valid lease and its clock is not behind.
func (w *Node) Servable() bool { return w.gen.Servable() }

// Unavailable reports whether err means "cannot issue right now" (HTTP 503),
// that is errors.Is(err, ErrUnavailable).
func (w *Node) Unavailable(err error) bool { return Unavailable(err) }

// WorkerID returns the worker ID held; ok is false while none is (lost and
// re-claiming, or closed).
func (w *Node) WorkerID() (id int, ok bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.id, w.id >= 0
}

// Decode returns w.Layout().Decode(id, w.Epoch()) as a Parts value (for a
// decode endpoint that wants a JSON-marshalable any).
func (w *Node) Decode(id int64) any { return w.gen.Decode(id) }

// Layout returns the bit layout of the IDs.
func (w *Node) Layout() Layout { return w.gen.layout }

// Instance returns the instance name used in the leases.
func (w *Node) Instance() string { return w.cfg.Instance }

// Epoch returns the time of timestamp 0.
func (w *Node) Epoch() time.Time { return w.cfg.Epoch }

// NodeStats is the lease state reported by Stats.
type NodeStats struct {
	WorkerID int    `json:"worker_id"` // -1: none held
	Held     bool   `json:"held"`
	Instance string `json:"instance"`
	Bucket   string `json:"bucket"`
	// Epoch is the time of timestamp 0.
	Epoch time.Time `json:"epoch"`
	// Layout names the bit layout, e.g. "js (41+5+7 bits)".
	Layout string `json:"layout"`
	// LastHeartbeat is the wall time written by the last successful lease
	// write; LeaseExpires is it plus the lease.
	LastHeartbeat time.Time `json:"last_heartbeat"`
	LeaseExpires  time.Time `json:"lease_expires"`
	// Bound is the highest timestamp the worker may use under its lease.
	Bound time.Time `json:"bound"`
	// LastTimestamp is the timestamp of the last ID issued (or the floor
	// inherited from the previous holder).
	LastTimestamp time.Time `json:"last_timestamp"`
	// Fenced is true while issuing is refused for want of a valid lease.
	Fenced bool `json:"fenced"`
	// ClockBehind is true while issuing is refused because the clock is
	// behind.
	ClockBehind bool `json:"clock_behind"`
	Closed      bool `json:"closed"`
	// Issued counts IDs issued.
	Issued uint64 `json:"issued"`
	// ClockBackwards counts episodes of refusing because the clock was
	// more than MaxBackwards behind; ClockBackwardsWaits counts smaller
	// steps waited out.
	ClockBackwards      uint64 `json:"clock_backwards"`
	ClockBackwardsWaits uint64 `json:"clock_backwards_waits"`
	// FencedEpisodes counts episodes of refusing for want of a valid lease.
	FencedEpisodes uint64 `json:"fenced_episodes"`
	Heartbeats     uint64 `json:"heartbeats"`
	// HeartbeatFailures counts heartbeat writes that failed for other
	// reasons than losing the key.
	HeartbeatFailures uint64 `json:"heartbeat_failures"`
	// Claims counts worker IDs claimed; LostLeases counts worker IDs lost to
	// another holder.
	Claims     uint64 `json:"claims"`
	LostLeases uint64 `json:"lost_leases"`
	// WriteBacks counts released leases written back over the delete or
	// purge marker of our own key (an operator removed it while we held
	// it).
	WriteBacks uint64 `json:"write_backs"`
	// Stopped is set once the worker stopped for good because its lease
	// bucket was deleted or recreated: the reason.
	Stopped string `json:"stopped,omitempty"`
}

// Stats returns the lease state as a NodeStats (JSON-marshalable).
func (w *Node) Stats() any { return w.stats() }

func (w *Node) stats() NodeStats {
	w.mu.Lock()
	defer w.mu.Unlock()
	g := w.gen.stats()
	st := NodeStats{
		WorkerID:            w.id,
		Held:                w.id >= 0,
		Instance:            w.cfg.Instance,
		Bucket:              w.cfg.Bucket,
		Epoch:               w.cfg.Epoch,
		Layout:              w.gen.layout.String(),
		LastHeartbeat:       w.rec.Heartbeat,
		LeaseExpires:        w.rec.Expires,
		Bound:               w.rec.Bound,
		Fenced:              g.fenced && !w.closed,
		ClockBehind:         g.backwards,
		Closed:              w.closed,
		Issued:              g.issued,
		ClockBackwards:      g.backEvents,
		ClockBackwardsWaits: g.backWaits,
		FencedEpisodes:      g.fenceEvents,
		Heartbeats:          w.heartbeats,
		HeartbeatFailures:   w.holder.Failures(),
		Claims:              w.claims,
		LostLeases:          w.losses,
		WriteBacks:          w.writeBacks,
	}
	if w.gone != nil {
		st.Stopped = w.gone.Error()
	}
	if g.lastMs >= 0 {
		st.LastTimestamp = w.gen.msTime(g.lastMs)
	}
	return st
}

// Close stops issuing and heartbeats and releases the lease, recording the
// last timestamp used so that a successor may take the worker ID at once
// (and start above it). ctx bounds the release write. Close waits for the
// background loop to exit. Later calls return the first call's result.
func (w *Node) Close(ctx context.Context) error {
	w.closeOnce.Do(func() { w.closeErr = w.close(ctx) })
	return w.closeErr
}

func (w *Node) close(ctx context.Context) error {
	w.cancel()
	<-w.done // the loop's KV calls run on w.ctx and return promptly
	lastMs := w.gen.revoke(ErrClosed)
	w.mu.Lock()
	id, rev, gone := w.id, w.rev, w.gone
	w.id = -1
	w.closed = true
	w.mu.Unlock()
	if gone != nil {
		return fmt.Errorf("snowflake: release: %w", gone)
	}
	if !w.writeBack(ctx) {
		return fmt.Errorf("snowflake: write back the bound of a deleted or purged lease key: failed")
	}
	if id < 0 {
		return nil
	}
	if err := w.checkBucket(ctx); err != nil {
		return fmt.Errorf("snowflake: release worker ID %d: %w", id, err)
	}
	w.mu.Lock()
	rec := w.rec
	w.mu.Unlock()
	var data []byte
	_, err := w.terms.Write(ctx, w.kv, workerKey(id), rev, func(now time.Time) ([]byte, error) {
		rec.Heartbeat, rec.Expires = now, now
		rec.Bound = w.gen.msTime(max(lastMs, 0))
		rec.Released = true
		var err error
		data, err = json.Marshal(rec)
		return data, err
	})
	if kvbucket.Conflict(err) {
		// A heartbeat whose reply was lost (or that Close canceled after
		// it was sent) may have landed: if the key still holds our
		// session's lease, release it on its revision. If it was deleted
		// or purged, write the release back over the marker.
		e, gerr := kvbucket.Latest(ctx, w.kv, workerKey(id))
		if gerr != nil {
			return fmt.Errorf("snowflake: release worker ID %d: read lease: %w", id, gerr)
		}
		if e == nil || e.Operation() != jetstream.KeyValuePut {
			w.mu.Lock()
			w.owed = w.owedLocked(e, lastMs)
			what := w.owed.what
			w.mu.Unlock()
			w.log.Error("snowflake: this worker's lease key was "+what+" while it held it; "+
				"writing back the last timestamp used, so that a successor starts above it", "worker", id)
			if !w.writeBack(ctx) {
				return fmt.Errorf("snowflake: release worker ID %d: write back over the deleted key: failed", id)
			}
			return nil
		}
		var cur leaseRecord
		if json.Unmarshal(e.Value(), &cur) == nil && cur.Session == w.session && !cur.Released {
			_, err = w.kv.Update(ctx, workerKey(id), data, e.Revision())
		}
		if kvbucket.Conflict(err) {
			w.log.Warn("snowflake: worker ID was taken over before release", "worker", id)
			return nil
		}
	}
	if err != nil {
		return fmt.Errorf("snowflake: release worker ID %d: %w", id, err)
	}
	w.log.Info("snowflake: released worker ID", "worker", id, "last_timestamp", rec.Bound)
	return nil
}
