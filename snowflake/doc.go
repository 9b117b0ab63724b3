// Package snowflake issues time-ordered, unique 64-bit IDs.
//
// # Layout
//
// An ID is, from the most significant bit:
//
//	1 bit   sign, always 0
//	41 bits milliseconds since the epoch (DefaultEpoch, 2026-01-01T00:00:00Z,
//	        unless configured; runs out about 69 years later)
//	10 bits worker ID (0..1023)
//	12 bits sequence within the millisecond (0..4095)
//
// Decode splits an ID into Parts.
//
// # Generator
//
// A Generator issues IDs for one fixed worker ID. Its IDs strictly increase:
// the timestamp never goes below the last one used and no (timestamp,
// sequence) pair is used twice. A full millisecond borrows the next one, at
// most MaxBorrow ahead of the clock; beyond that a call waits briefly for the
// clock, and fails with ErrOverloaded if the clock does not move. A clock
// that steps back by at most MaxBackwards (5 ms) is waited out; further back,
// calls fail with ErrClockBackwards until the clock has caught up with the
// last reading used.
//
// # Worker and leases
//
// A Worker leases its worker ID from a JetStream key-value bucket (default
// DefaultBucket) and issues through a Generator bounded by the lease. The
// bucket holds one key per worker ID, "worker.0000" to "worker.1023", and a
// key "config" holding {"version":1,"epoch":"2026-01-01T00:00:00Z"}; a
// worker configured with another epoch refuses to start (ErrEpochMismatch).
// The value under a worker key is JSON:
//
//	{
//	  "version": 1,
//	  "worker": 42,                               // the worker ID, as in the key
//	  "instance": "api-1",                        // holder's instance name
//	  "session": "JRWTMLA3SPXJ6E5UNXFB2CGCPF",    // random per Worker value
//	  "epoch": "2026-01-01T00:00:00Z",
//	  "lease_ms": 10000,
//	  "heartbeat": "2026-03-01T12:00:00.123Z",    // holder's clock at the write
//	  "expires": "2026-03-01T12:00:10.123Z",      // heartbeat + lease
//	  "bound": "2026-03-01T12:00:10.123Z",        // highest timestamp the holder may use
//	  "released": false                           // true after a graceful Close
//	}
//
// Values expire through "expires", never through per-key TTLs, and keys are
// never deleted (a deleted key forgets its bound: do not delete or purge keys
// or the bucket while workers may run).
//
// Claiming: a worker reads all keys and tries, in order, a claimable key last
// held by its own instance name, a key never written (Create), a released key
// and an expired key (Update on the revision read). A key is claimable when
// released, or when by the claimant's clock both "expires" and "bound" plus
// "lease_ms" have passed. A lost race (key exists, wrong revision) moves on
// to the next key; if none is left, ErrNoWorkerID.
//
// Heartbeats: every Heartbeat (default 3 s; lease default 10 s) the worker
// writes, by compare-and-set on its last revision, its clock and a bound of
// at least its clock plus the lease. Only once that write has succeeded does
// the generator use the new bound, and it never issues a timestamp above
// the bound in effect; so the bound in the bucket always covers every ID
// issued. A successor starts above the bound it took over (and refuses with
// ErrClockBackwards while its clock is behind that bound); a graceful Close
// lowers the bound to the last timestamp actually used and marks the value
// released, so a successor may take it at once.
//
// Self-fencing: a worker whose last successful heartbeat started a lease ago
// or more, by the monotonic clock, refuses with ErrFenced until it renews. A
// worker that finds its key rewritten by someone else stops at once and
// claims another worker ID in the background.
//
// # What is guaranteed
//
// No ID is issued twice, whatever the clocks, pauses and network do, as long
// as the bucket keeps its values (use replicas) and keys are not deleted: a
// holder's IDs lie at or below the bound recorded before they were issued,
// and a successor only gets the key by compare-and-set on that record and
// starts above its bound. Two live workers do not hold the same worker ID at
// once (the old one has fenced itself before a successor may claim) as long
// as their clocks run at about the same rate and disagree by less than a
// lease; if they disagree more, the old holder may still issue for a while,
// but below the successor's IDs, and stops at its next heartbeat.
//
// # Errors
//
// errors.Is(err, ErrUnavailable) means "cannot issue now" (HTTP 503):
// ErrFenced, ErrClockBackwards, ErrOverloaded, ErrClosed, ErrNoWorkerID.
// ErrInvalidCount is the caller's fault (400). The rest are configuration or
// infrastructure errors (500, or refuse to start).
//
// # Concurrency
//
// Generator and Worker are safe for concurrent use. Settings,
// WorkerSettings and Parts are plain values.
package snowflake
