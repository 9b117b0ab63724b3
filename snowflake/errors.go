package snowflake

import (
	"errors"

	"github.com/dispenser-dev/dispenser/internal/kvbucket"
)

// Errors returned by this package. Calls wrap them with %w where they add
// detail, so test with errors.Is.
//
// How a service maps them:
//   - 503 (retry later, maybe on another instance): every error for which
//     errors.Is(err, ErrUnavailable) is true, that is ErrClockBackwards,
//     ErrFenced, ErrOverloaded, ErrClosed, ErrNoWorkerID and
//     ErrBucketDeleted.
//   - 400: ErrInvalidCount.
//   - 500 / refuse to start: ErrInvalidSettings, ErrInvalidWorkerID,
//     ErrEpochInFuture, ErrEpochMismatch, ErrLayoutMismatch, ErrRegionMismatch, ErrPredecessorInUse, ErrRegionBuckets, ErrEpochLost,
//     ErrOverTimeLimit,
//     ErrBucketTTL, ErrBucketLimits, ErrBucketMemory, ErrBucketReplicas,
//     and any error from NATS that wraps none of the above.
var (
	// ErrUnavailable is the umbrella for all "cannot issue right now"
	// conditions: errors.Is(err, ErrUnavailable) means 503.
	ErrUnavailable = errors.New("snowflake: unavailable")

	// ErrClockBackwards means the wall clock is more than MaxBackwards
	// behind the latest clock reading already used, or behind the highest
	// timestamp recorded for a reclaimed worker ID. Issuing resumes by
	// itself once the clock has caught up. Is ErrUnavailable.
	ErrClockBackwards error = &unavailableError{"snowflake: clock moved backwards"}

	// ErrFenced means the worker holds no valid lease right now: no
	// heartbeat has succeeded within the lease, the lease's timestamp bound
	// is reached, the worker ID was lost to another holder and a new one is
	// being claimed, or none has been claimed yet. Is ErrUnavailable.
	ErrFenced error = &unavailableError{"snowflake: no valid worker lease"}

	// ErrOverloaded means the sequence space is used up further than
	// MaxBorrow ahead of the clock and the clock did not catch up in a few
	// short waits (demand above the layout's sequence numbers per
	// millisecond, 4096 in DefaultLayout and 128 in JSLayout, or a stalled
	// clock). Is ErrUnavailable.
	ErrOverloaded error = &unavailableError{"snowflake: sequence space exhausted"}

	// ErrClosed means the worker has been closed. Is ErrUnavailable.
	ErrClosed error = &unavailableError{"snowflake: worker closed"}

	// ErrNoWorkerID means all worker IDs of the layout (1024 in
	// DefaultLayout, 32 in JSLayout) are held by live leases.
	// Is ErrUnavailable: leases of dead workers expire.
	ErrNoWorkerID error = &unavailableError{"snowflake: all worker IDs are taken"}

	// ErrBucketDeleted means the lease bucket was deleted, or deleted and
	// created again, while the Node ran: every bound in it is lost, and
	// in a new bucket revisions restart, so the Node's compare-and-swap
	// writes could land on someone else's record. The Node stops for
	// good (it issues nothing more and writes nothing more) and logs what
	// the operator did. Is ErrUnavailable: other instances may serve.
	ErrBucketDeleted error = &unavailableError{"snowflake: lease bucket deleted or recreated while the worker ran"}

	// ErrRegionMismatch means the lease bucket holds the worker IDs of
	// another region (NodeSettings.Region): each region leases from a
	// bucket of its own.
	ErrRegionMismatch = errors.New("snowflake: lease bucket belongs to another region")

	// ErrPredecessorInUse means a new lease bucket's predecessor
	// (NodeSettings.Predecessor) has a lease still held, or a key whose
	// last bound is unknown: the new bucket cannot know where to start.
	ErrPredecessorInUse = errors.New("snowflake: the lease bucket used before this one is in use")

	// ErrRegionBuckets means a bucket without region bits has region
	// buckets beside it (NodeSettings.RegionBuckets), whose worker IDs
	// overlap its own.
	ErrRegionBuckets = errors.New("snowflake: region lease buckets exist beside this one")

	// ErrInvalidCount means a batch asked for fewer than 1 or more than
	// MaxCount IDs.
	ErrInvalidCount = errors.New("snowflake: invalid count")

	// ErrInvalidSettings means a Settings or NodeSettings field is out of
	// range; the message names the field.
	ErrInvalidSettings = errors.New("snowflake: invalid settings")

	// ErrInvalidWorkerID means a worker ID outside 0..MaxWorkerID of the
	// layout.
	ErrInvalidWorkerID = errors.New("snowflake: invalid worker ID")

	// ErrEpochInFuture means the epoch is after the current time.
	ErrEpochInFuture = errors.New("snowflake: epoch is in the future")

	// ErrOverTimeLimit means the time since the epoch no longer fits in the
	// layout's time bits: 41 bits of milliseconds (about 69 years) in both
	// named layouts.
	ErrOverTimeLimit = errors.New("snowflake: time since epoch exceeds the layout's time bits")

	// ErrEpochMismatch means the epoch stored in the lease bucket differs
	// from the configured one; mixing epochs would let IDs collide.
	ErrEpochMismatch = errors.New("snowflake: epoch differs from the lease bucket's")

	// ErrLayoutMismatch means the layout recorded in the lease bucket (with
	// its epoch, when the bucket was first used) differs from the
	// configured one: the IDs of two layouts collide. A bucket without a
	// recorded layout (written by a version without layouts) has
	// DefaultLayout. A layout cannot be changed in place: a new layout
	// needs a new bucket (and a new epoch).
	ErrLayoutMismatch = errors.New("snowflake: layout differs from the lease bucket's")

	// ErrEpochLost means the lease bucket has no epoch although it has been
	// used: the "config" key was deleted or purged (it carries a delete or
	// purge marker), or is missing while the bucket has held other values
	// (the bucket or the key was purged). Whatever removed the epoch may
	// have removed lease bounds too, so Start refuses rather than
	// store its own epoch; the message says how to restore it.
	ErrEpochLost = errors.New("snowflake: lease bucket lost its epoch")

	// ErrBucketTTL, ErrBucketLimits, ErrBucketMemory and ErrBucketReplicas
	// refuse a lease bucket that can drop values on its own: a TTL (max age)
	// or per-message TTLs; a message or byte limit with the discard-old
	// policy, or a retention policy other than limits; memory storage; fewer
	// replicas than NodeSettings.Replicas. A lease whose value the server
	// drops loses the bound that keeps its successor above the IDs issued.
	// They are the values of package internal/kvbucket, which the segment
	// store's bucket is checked with too (segment/kv.ErrBucketTTL is
	// ErrBucketTTL, and so on).
	ErrBucketTTL      = kvbucket.ErrTTL
	ErrBucketLimits   = kvbucket.ErrLimits
	ErrBucketMemory   = kvbucket.ErrMemoryStorage
	ErrBucketReplicas = kvbucket.ErrReplicas
)

// unavailableError is a sentinel that also matches ErrUnavailable.
type unavailableError struct{ msg string }

func (e *unavailableError) Error() string { return e.msg }

func (e *unavailableError) Is(target error) bool { return target == ErrUnavailable }

// Unavailable reports whether err means "cannot issue right now, retry
// later" (HTTP 503): errors.Is(err, ErrUnavailable).
func Unavailable(err error) bool { return errors.Is(err, ErrUnavailable) }
