package snowflake

import (
	"context"
	"crypto/rand"
	"encoding/json"
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
	// Predecessor, if not empty, is the bucket the deployment leased
	// from before this one, whose worker IDs this bucket's overlap: the
	// bucket without region bits (DefaultBucket) for a region's bucket,
	// when region bits are turned on later. The worker that creates this
	// bucket records the highest bound found there as the bucket's floor,
	// and every never used worker ID of this bucket starts above it, as a
	// successor starts above the bound it takes over; a predecessor with
	// a lease still held, deleted or unreadable is refused
	// (ErrPredecessorInUse). Without the floor a region's fresh bucket
	// would hand worker ID 0 to a host whose clock is behind the last ID
	// worker ID 0 issued without regions: the same IDs again
	// (TestRegionBitsTurnedOnLater). Read only when this bucket is
	// created; a missing predecessor is no floor.
	Predecessor string
	// Siblings, if not empty, is the name prefix of the other regions'
	// buckets (DefaultBucket+"_r" for a region's default bucket): the
	// worker that creates this bucket refuses (ErrLayoutMismatch) while a
	// bucket named Siblings and a number records another layout, for
	// other region bits would overlap the regions' worker IDs
	// (TestRegionBitsDifferBetweenRegions). Read only when this bucket is
	// created.
	Siblings string
	// RegionBuckets, if not empty, is the name prefix of the regions'
	// buckets whose worker IDs this bucket's hold too (DefaultBucket+"_r"
	// for DefaultBucket without region bits): Start refuses
	// (ErrRegionBuckets) while one exists, for their workers may hold this
	// bucket's worker IDs now, or have issued above its bounds
	// (TestRegionBitsTurnedOff).
	RegionBuckets string
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

	// mu protects the lease bookkeeping below. Lock order: mu, then
	// gen.mu (the only two mutexes of a Node; holder's counters are
	// atomic).
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
	var floor func(context.Context) (time.Time, error)
	if (cfg.Predecessor != "" && cfg.Predecessor != cfg.Bucket) || cfg.Siblings != "" {
		floor = func(ctx context.Context) (time.Time, error) {
			if cfg.Siblings != "" {
				if err := checkSiblings(ctx, js, cfg.Siblings, cfg.Bucket, gen.layout); err != nil {
					return time.Time{}, err
				}
			}
			if cfg.Predecessor == "" || cfg.Predecessor == cfg.Bucket {
				return time.Time{}, nil
			}
			return predecessorFloor(ctx, js, cfg.Predecessor, gen.layout.MaxWorkerID(), cfg.Now())
		}
	}
	if err := checkEpoch(ctx, kv, cfg.Epoch, gen.layout, cfg.Region, cfg.Lease, floor); err != nil {
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
	if cfg.RegionBuckets != "" {
		// After the claim, before the first ID: a region's bucket
		// created before the claim is found here, and the worker that
		// creates one after it finds the claim (predecessorFloor
		// refuses a held lease). The claim left behind expires.
		if err := checkNoRegionBuckets(ctx, js, cfg.RegionBuckets, cfg.Bucket); err != nil {
			return nil, err
		}
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
