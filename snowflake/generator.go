package snowflake

import (
	"fmt"
	"log/slog"
	"math/rand/v2"
	"slices"
	"sync"
	"time"
)

// Bit layout of DefaultLayout; Layout's methods give them for any layout.
const (
	TimeBits     = 41
	WorkerBits   = 10
	SequenceBits = 12

	// MaxWorkerID is the largest worker ID.
	MaxWorkerID = 1<<WorkerBits - 1
	// MaxSequence is the largest sequence number within a millisecond.
	MaxSequence = 1<<SequenceBits - 1
	// MaxTimestamp is the largest number of milliseconds since the epoch.
	MaxTimestamp = 1<<TimeBits - 1

	// MaxCount is the largest batch one call can ask for in DefaultLayout
	// (16 ms of sequence space for one worker), and the most in any layout
	// (Layout.MaxCount).
	MaxCount = 1 << 16

	// DefaultMaxBackwards is how far the clock may go back before issuing
	// fails instead of waiting.
	DefaultMaxBackwards = 5 * time.Millisecond
	// DefaultMaxBorrow is how far ahead of the clock timestamps may run when
	// milliseconds fill up.
	DefaultMaxBorrow = 100 * time.Millisecond

	// RandomSequenceSpan bounds the random first sequence number of a
	// millisecond when Settings.RandomSequence is set: 0..RandomSequenceSpan-1
	// (in a layout with fewer than 4096 sequence numbers, a sixteenth of
	// them: 8 in JSLayout).
	RandomSequenceSpan = 256

	// maxAttempts bounds how often one call waits for the clock.
	maxAttempts = 3
	// maxWait bounds one wait for the clock.
	maxWait = 100 * time.Millisecond
)

// DefaultEpoch is the epoch used when none is configured:
// 2026-01-01T00:00:00Z. IDs run out 2^41 ms later, in September 2095.
var DefaultEpoch = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

// Settings configure a Generator. The zero value of every field means its
// documented default. Settings are read once, by New.
type Settings struct {
	// Epoch is the time of timestamp 0. It must be a whole millisecond, not
	// in the future and less than 2^TimeBits ms in the past (2^41 in both
	// named layouts). Zero means DefaultEpoch.
	Epoch time.Time
	// Layout is the bit layout of the IDs. The zero value means
	// DefaultLayout; JSLayout keeps IDs below 2^53.
	Layout Layout
	// WorkerID is the worker ID put into every ID, 0..Layout.MaxWorkerID().
	// A Node picks it from its lease instead (NodeSettings refuses one).
	WorkerID int
	// RandomSequence starts each new millisecond's sequence at a random
	// number in 0..RandomSequenceSpan-1 (a sixteenth of the sequence space
	// if that is less) instead of 0, so that id%n spreads evenly at low
	// rates (Leaf does the same). Off by default. Borrowed milliseconds
	// always start at 0.
	RandomSequence bool
	// MaxBackwards is how far the clock may go back and be waited out. A
	// larger step makes issuing fail with ErrClockBackwards until the clock
	// has caught up. Zero means DefaultMaxBackwards; negative means never
	// wait.
	MaxBackwards time.Duration
	// MaxBorrow is how far ahead of the clock timestamps may run when
	// milliseconds fill up; beyond it a call waits for the clock. Zero means
	// DefaultMaxBorrow; negative means no borrowing.
	MaxBorrow time.Duration
	// Now returns the wall-clock time. Nil means time.Now.
	Now func() time.Time
	// Logger receives clock and lease events. Nil means slog.Default().
	Logger *slog.Logger

	// mono returns monotonic time for lease fencing; nil means the
	// monotonic clock. Tests inject it.
	mono func() time.Duration
	// sleep waits for the clock; nil means time.Sleep. Tests inject it.
	sleep func(time.Duration)
}

// Generator issues IDs for one worker ID. It is safe for concurrent use.
type Generator struct {
	layout      Layout
	seqBits     uint  // layout.SequenceBits: the worker ID's shift
	timeShift   uint  // layout.WorkerBits + layout.SequenceBits
	maxSeq      int64 // layout.MaxSequence()
	maxTs       int64 // layout.MaxTimestamp()
	maxCount    int   // layout.MaxCount()
	randomSpan  int   // layout.randomSpan()
	epoch       time.Time
	epochMs     int64
	now         func() time.Time
	realClock   bool // now is time.Now: one reading gives wall and monotonic time
	monoBase    time.Time
	mono        func() time.Duration
	sleep       func(time.Duration)
	log         *slog.Logger
	randomSeq   bool
	maxBackMs   int64
	maxBorrowMs int64
	leased      bool // issuing is bounded by a lease (Node)
	stall       func()

	// mu protects the issuing state below. A Node calls in here (assign,
	// renew, revoke, stats) while holding its own mu: lock order Node.mu,
	// then Generator.mu, never the other way (nothing here calls back
	// into the Node under mu; stall only sends on a buffered channel).
	mu          sync.Mutex
	worker      int64         // worker ID << seqBits
	lastMs      int64         // timestamp of the last ID issued (or the floor); -1: none
	seq         int64         // sequence of the last ID issued at lastMs
	clockMs     int64         // highest clock reading used, ms since epoch
	boundMs     int64         // leased: no timestamp above this
	validUntil  time.Duration // leased: monotonic time the lease is trusted until
	refusal     error         // non-nil: refuse with it (ErrFenced while unclaimed, ErrClosed)
	backwards   bool          // in a clock-backwards episode
	fenced      bool          // in a fenced episode (lease timed out or bound reached)
	issued      uint64
	backEvents  uint64
	backWaits   uint64
	fenceEvents uint64
}

// New validates s and returns a Generator for s.WorkerID.
func New(s Settings) (*Generator, error) {
	g, err := newGenerator(s, false)
	if err != nil {
		return nil, err
	}
	if maxID := g.layout.MaxWorkerID(); s.WorkerID < 0 || s.WorkerID > maxID {
		return nil, fmt.Errorf("%w: %d not in 0..%d (layout %s)", ErrInvalidWorkerID, s.WorkerID, maxID, g.layout)
	}
	g.worker = int64(s.WorkerID) << g.seqBits
	return g, nil
}

// newGenerator validates s. A leased generator refuses with ErrFenced until
// assign installs a lease.
func newGenerator(s Settings, leased bool) (*Generator, error) {
	if s.Epoch.IsZero() {
		s.Epoch = DefaultEpoch
	}
	if s.Epoch.Nanosecond()%int(time.Millisecond) != 0 {
		return nil, fmt.Errorf("%w: Epoch %s is not a whole millisecond", ErrInvalidSettings, s.Epoch.Format(time.RFC3339Nano))
	}
	l := s.Layout.orDefault()
	if err := l.check(); err != nil {
		return nil, err
	}
	g := &Generator{
		layout:     l,
		seqBits:    uint(l.SequenceBits),
		timeShift:  uint(l.WorkerBits + l.SequenceBits),
		maxSeq:     l.MaxSequence(),
		maxTs:      l.MaxTimestamp(),
		maxCount:   l.MaxCount(),
		randomSpan: l.randomSpan(),
		epoch:      s.Epoch.UTC(),
		epochMs:    s.Epoch.UnixMilli(),
		now:        s.Now,
		mono:       s.mono,
		sleep:      s.sleep,
		log:        s.Logger,
		randomSeq:  s.RandomSequence,
		leased:     leased,
		lastMs:     -1,
		seq:        l.MaxSequence(),
	}
	if g.now == nil {
		g.now = time.Now
		g.realClock = s.mono == nil
	}
	g.monoBase = time.Now()
	if g.sleep == nil {
		g.sleep = time.Sleep
	}
	if g.log == nil {
		g.log = slog.Default()
	}
	switch {
	case s.MaxBackwards == 0:
		g.maxBackMs = DefaultMaxBackwards.Milliseconds()
	case s.MaxBackwards > 0:
		g.maxBackMs = s.MaxBackwards.Milliseconds()
	}
	switch {
	case s.MaxBorrow == 0:
		g.maxBorrowMs = DefaultMaxBorrow.Milliseconds()
	case s.MaxBorrow > 0:
		g.maxBorrowMs = s.MaxBorrow.Milliseconds()
	}
	nowMs := g.now().UnixMilli() - g.epochMs
	if nowMs < 0 {
		return nil, fmt.Errorf("%w: epoch %s", ErrEpochInFuture, g.epoch.Format(time.RFC3339))
	}
	if nowMs > g.maxTs {
		return nil, fmt.Errorf("%w: epoch %s (layout %s)", ErrOverTimeLimit, g.epoch.Format(time.RFC3339), g.layout)
	}
	g.clockMs = nowMs
	if leased {
		g.refusal = ErrFenced
	} else {
		g.boundMs = g.maxTs
	}
	return g, nil
}

// Epoch returns the time of timestamp 0.
func (g *Generator) Epoch() time.Time { return g.epoch }

// Layout returns the bit layout of the IDs.
func (g *Generator) Layout() Layout { return g.layout }

// Decode returns g.Layout().Decode(id, g.Epoch()).
func (g *Generator) Decode(id int64) Parts { return g.layout.Decode(id, g.epoch) }

// WorkerID returns the worker ID the generator issues for.
func (g *Generator) WorkerID() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return int(g.worker >> g.seqBits)
}

// Next returns one ID.
func (g *Generator) Next() (int64, error) {
	var buf [1]int64
	ids, err := g.AppendIDs(buf[:0], 1)
	if err != nil {
		return 0, err
	}
	return ids[0], nil
}

// NextN returns n new IDs in increasing order, n in 1..Layout().MaxCount().
func (g *Generator) NextN(n int) ([]int64, error) {
	if n < 1 || n > g.maxCount {
		return nil, fmt.Errorf("%w: %d not in 1..%d", ErrInvalidCount, n, g.maxCount)
	}
	return g.AppendIDs(make([]int64, 0, n), n)
}

// AppendIDs appends n new IDs in increasing order to dst, n in
// 1..Layout().MaxCount() (MaxCount in DefaultLayout), and returns the extended slice. It issues all n or none; on error dst is
// returned unchanged. It allocates only if dst lacks capacity for n more.
//
// It may wait for the clock, holding the generator's lock: up to
// MaxBackwards after a small backward step, and when the batch would run
// more than MaxBorrow ahead of the clock (at most a few short waits, then
// ErrOverloaded). Errors: ErrInvalidCount, ErrClockBackwards, ErrOverloaded,
// ErrOverTimeLimit, and for a Node's generator ErrFenced and ErrClosed.
func (g *Generator) AppendIDs(dst []int64, n int) ([]int64, error) {
	if n < 1 || n > g.maxCount {
		return dst, fmt.Errorf("%w: %d not in 1..%d", ErrInvalidCount, n, g.maxCount)
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	for attempt := 1; ; attempt++ {
		if g.refusal != nil {
			return dst, g.refusal
		}
		nowMs, mono := g.readLocked()
		if g.leased && mono >= g.validUntil {
			g.fenceLocked("no successful heartbeat within the lease")
			return dst, ErrFenced
		}
		if nowMs < g.clockMs {
			back := g.clockMs - nowMs
			if back > g.maxBackMs {
				if !g.backwards {
					g.backwards = true
					g.backEvents++
					g.log.Error("snowflake: clock is behind the last timestamp used; refusing to issue IDs until it catches up",
						"worker", g.worker>>g.seqBits, "behind", time.Duration(back)*time.Millisecond,
						"last", g.msTime(g.clockMs), "now", g.msTime(nowMs))
				}
				return dst, ErrClockBackwards
			}
			if attempt < maxAttempts {
				g.backWaits++
				g.sleep(time.Duration(back) * time.Millisecond)
				continue
			}
			// The clock stalls short of the last reading: go on from
			// the last reading, which never repeats a timestamp.
			nowMs = g.clockMs
		}
		if g.backwards {
			g.backwards = false
			g.log.Info("snowflake: clock caught up; issuing IDs again", "worker", g.worker>>g.seqBits)
		}
		g.clockMs = nowMs

		ts, seq := g.lastMs, g.seq
		if nowMs > ts {
			ts, seq = nowMs, -1
			if g.randomSeq {
				seq = int64(rand.IntN(g.randomSpan)) - 1
			}
		}
		// IDs go to linear positions seq+1..last of ts's sequence space;
		// position p is timestamp ts+p>>seqBits, sequence p&maxSeq.
		last := seq + int64(n)
		endMs := ts + last>>g.seqBits
		if endMs > g.maxTs {
			return dst, fmt.Errorf("%w: %s", ErrOverTimeLimit, g.msTime(endMs).Format(time.RFC3339))
		}
		if endMs > g.boundMs {
			g.fenceLocked("timestamp bound of the lease reached")
			return dst, ErrFenced
		}
		if endMs > nowMs+g.maxBorrowMs {
			wait := time.Duration(endMs-nowMs-g.maxBorrowMs) * time.Millisecond
			if attempt < maxAttempts && wait <= maxWait {
				g.sleep(wait)
				continue
			}
			return dst, ErrOverloaded
		}

		dst = slices.Grow(dst, n)
		out := dst[len(dst) : len(dst)+n]
		// One run of sequence numbers per millisecond: the layout's shifts
		// are fields, so they stay out of the per-ID loop.
		p := seq + 1
		ms, sq := ts+p>>g.seqBits, p&g.maxSeq
		for i := 0; i < n; ms, sq = ms+1, 0 {
			run := out[i:min(n, i+int(g.maxSeq-sq+1))]
			base := ms<<g.timeShift | g.worker | sq
			for j := range run {
				run[j] = base + int64(j)
			}
			i += len(run)
		}
		g.lastMs, g.seq = endMs, last&g.maxSeq
		g.issued += uint64(n)
		return dst[:len(dst)+n], nil
	}
}

// Servable reports whether AppendIDs can issue now, as far as the lease and
// the clock go: the generator is not refused (unleased, revoked, closed),
// not fenced (its lease's monotonic validity or its timestamp bound is
// passed), and its clock is not behind the last timestamp used by more than
// MaxBackwards. It does not foresee ErrOverloaded, which passes within
// milliseconds. A lease it finds run out starts a fenced episode, as a
// request would (stats, the log, a heartbeat asked for now).
func (g *Generator) Servable() bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.refusal != nil || g.fenced {
		return false
	}
	nowMs, mono := g.readLocked()
	if g.leased && mono >= g.validUntil {
		g.fenceLocked("no successful heartbeat within the lease")
		return false
	}
	if g.clockMs-nowMs > g.maxBackMs {
		return false
	}
	if max(nowMs, g.lastMs) >= g.boundMs {
		g.fenceLocked("timestamp bound of the lease reached")
		return false
	}
	return true
}

// readLocked reads the clocks: wall time in ms since the epoch and, for a
// leased generator, monotonic time.
func (g *Generator) readLocked() (nowMs int64, mono time.Duration) {
	if g.realClock {
		t := time.Now()
		return t.UnixMilli() - g.epochMs, t.Sub(g.monoBase)
	}
	nowMs = g.now().UnixMilli() - g.epochMs
	if g.leased {
		mono = g.monoNow()
	}
	return nowMs, mono
}

// monoNow returns monotonic time.
func (g *Generator) monoNow() time.Duration {
	if g.mono != nil {
		return g.mono()
	}
	return time.Since(g.monoBase)
}

// fenceLocked starts a fenced episode: log once and ask for a heartbeat.
func (g *Generator) fenceLocked(why string) {
	if g.stall != nil {
		g.stall()
	}
	if g.fenced {
		return
	}
	g.fenced = true
	g.fenceEvents++
	g.log.Warn("snowflake: worker fenced; refusing to issue IDs until the lease is renewed",
		"worker", g.worker>>g.seqBits, "reason", why, "bound", g.msTime(g.boundMs))
}

// msTime converts ms since the epoch to a time.
func (g *Generator) msTime(ms int64) time.Time {
	return g.epoch.Add(time.Duration(ms) * time.Millisecond)
}

// assign installs a freshly claimed lease: worker ID, the floor (the
// highest timestamp a previous holder may have used, -1 for none), the
// recorded bound and the monotonic time the lease is valid until.
//
// The last timestamp used is kept across worker IDs, so that the IDs of a
// Node strictly increase even when it loses its worker ID and claims a
// lower one: under a new worker ID issuing resumes in the millisecond after
// the last one used (or the floor, if higher).
func (g *Generator) assign(worker int, floorMs, boundMs int64, validUntil time.Duration) {
	g.mu.Lock()
	defer g.mu.Unlock()
	w := int64(worker) << g.seqBits
	if w != g.worker {
		g.seq = g.maxSeq // the old worker ID's sequence says nothing about the new one
	}
	g.worker = w
	if floorMs >= g.lastMs {
		g.lastMs, g.seq = floorMs, g.maxSeq
	}
	// A floor ahead of our clock counts as the clock being behind.
	g.clockMs = max(g.clockMs, floorMs)
	g.boundMs = boundMs
	g.validUntil = validUntil
	g.refusal = nil
	g.fenced = false
}

// renew raises the bound and the validity after a successful heartbeat.
func (g *Generator) renew(boundMs int64, validUntil time.Duration) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.boundMs = max(g.boundMs, boundMs)
	g.validUntil = max(g.validUntil, validUntil)
	if g.fenced && g.refusal == nil && g.monoNow() < g.validUntil {
		g.fenced = false
		g.log.Info("snowflake: lease renewed; issuing IDs again", "worker", g.worker>>g.seqBits)
	}
}

// revoke stops issuing with err and returns the last timestamp used.
func (g *Generator) revoke(err error) (lastMs int64) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.refusal != ErrClosed {
		g.refusal = err
	}
	return g.lastMs
}

// genStats is a snapshot of the generator state.
type genStats struct {
	lastMs, boundMs               int64
	fenced, backwards             bool
	issued, backEvents, backWaits uint64
	fenceEvents                   uint64
}

func (g *Generator) stats() genStats {
	g.mu.Lock()
	defer g.mu.Unlock()
	nowMs, mono := g.readLocked()
	fenced := g.fenced || g.refusal != nil
	if g.leased && g.refusal == nil {
		fenced = fenced || mono >= g.validUntil
	}
	// Behind as AppendIDs would find it now, not g.backwards: that is
	// set and cleared only by calls to AppendIDs, and a Node whose clock
	// is behind gets none (its endpoint leaves the queue group, on
	// Servable), so it would stay false while the clock is behind, and
	// true after the clock caught up until a call came.
	backwards := g.clockMs-nowMs > g.maxBackMs
	return genStats{
		lastMs: g.lastMs, boundMs: g.boundMs,
		fenced: fenced, backwards: backwards,
		issued: g.issued, backEvents: g.backEvents, backWaits: g.backWaits,
		fenceEvents: g.fenceEvents,
	}
}
