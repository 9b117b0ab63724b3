// Package snowflake issues time-ordered, unique 64-bit IDs.
//
// # Layout
//
// An ID of DefaultLayout is, from the most significant bit:
//
//	1 bit   sign, always 0
//	41 bits milliseconds since the epoch (DefaultEpoch, 2026-01-01T00:00:00Z,
//	        unless configured; runs out about 69 years later)
//	10 bits worker ID (0..1023)
//	12 bits sequence within the millisecond (0..4095)
//
// JSLayout keeps every ID below 2^53, exact as a JavaScript number: 41 bits
// of milliseconds (as long as the default), 5 bits of worker ID (0..31) and
// 7 bits of sequence (0..127: 128,000 IDs per second per worker). Settings
// and NodeSettings choose the Layout; everything that depends on the bits
// follows it (the largest worker ID leased, timestamp, sequence and batch,
// Layout.MaxCount). A Node's layout is recorded in its lease bucket with
// the epoch and cannot be changed in place (ErrLayoutMismatch).
//
// Decode splits an ID of DefaultLayout into Parts; Layout.Decode an ID of
// any layout. Decoding needs the layout the ID was issued in.
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
// # Node and leases
//
// A Node leases its worker ID from a JetStream key-value bucket (default
// DefaultBucket) and issues through a Generator bounded by the lease. The
// bucket holds one key per worker ID, "worker.0000" to "worker.1023"
// ("worker.0031" in JSLayout), and a key "config" holding
// {"version":1,"epoch":"2026-01-01T00:00:00Z","layout":{"name":"default","time_bits":41,"worker_bits":10,"sequence_bits":12},"max_lease_ms":10000};
// a worker configured with another epoch refuses to start
// (ErrEpochMismatch), one with another layout too (ErrLayoutMismatch; a
// record without a layout, from an older version, is DefaultLayout).
// "max_lease_ms" is the longest lease any worker has claimed with: a worker
// raises it (compare-and-swap) before it claims with a longer lease, and
// nothing lowers it.
// A bucket created with a predecessor (NodeSettings.Predecessor: the
// bucket without region bits, for a region's bucket) also holds "floor",
// the predecessor's highest bound then: a never used worker ID starts
// above it, as a successor starts above the bound it takes over.
// The value under a worker key is JSON:
//
//	{
//	  "version": 1,
//	  "worker": 42,                               // the worker ID, as in the key
//	  "instance": "api-1",                        // holder's instance name
//	  "session": "JRWTMLA3SPXJ6E5UNXFB2CGCPF",    // random per Node value
//	  "epoch": "2026-01-01T00:00:00Z",
//	  "lease_ms": 10000,
//	  "heartbeat": "2026-03-01T12:00:00.123Z",    // holder's clock at the write
//	  "expires": "2026-03-01T12:00:10.123Z",      // heartbeat + lease
//	  "bound": "2026-03-01T12:00:10.123Z",        // highest timestamp the holder may use
//	  "released": false                           // true after a graceful Close
//	}
//
// Values expire through "expires", never through per-key TTLs, and workers
// never delete keys.
//
// The bucket must keep every value until a worker overwrites it. Start
// refuses a bucket that lets the server drop values: a TTL (max age) or
// per-message TTLs (ErrBucketTTL); a message or byte limit with the
// discard-old policy, or a retention policy other than limits
// (ErrBucketLimits; limits with discard-new only make writes fail and are
// accepted, as is any per-key history); memory storage (ErrBucketMemory);
// fewer replicas than NodeSettings.Replicas (ErrBucketReplicas; more are
// accepted). It also refuses a bucket whose "config" key carries a delete or
// purge marker, or is missing although the bucket has held values (it or
// the bucket was purged): ErrEpochLost. Only a bucket that has never held a
// value gets the configured epoch stored.
//
// Deleted keys: a worker key deleted or purged by an operator (its marker
// remains) while its holder runs is noticed by the holder at its next
// heartbeat or in Close: it stops issuing under it and writes back, by
// compare-and-swap on the marker's revision, a released lease with the last
// timestamp it used, so a successor starts above it. A deleted key without
// a write-back is claimed only after the others (never used, released,
// expired), with a floor derived from the marker's server timestamp: the
// marker's time plus DeletedKeyMargin or twice the longest lease known
// (the claimant's, every one in the bucket's values, and "max_lease_ms"),
// whichever is longer; UnknownLeaseMargin for a key deleted before
// "max_lease_ms" was first recorded (its marker's revision is at or below
// "max_lease_since"). It is claimable once the claimant's clock is a lease
// past that floor. A key removed without a trace while its holder cannot
// write back (markers purged with PurgeDeletes, the stream purged by
// subject) cannot be told from a never used one: do not do that while
// workers may run, or within a lease of their last stop.
//
// A running worker that must claim (at start or after losing its key) and
// finds the "config" key gone (the bucket or the key purged, or the key
// deleted) refuses with an error wrapping ErrFenced and ErrEpochLost until
// the epoch is restored. A worker whose bucket was deleted, or deleted and
// created again (the stream's creation time, read before every heartbeat,
// claim and release, changed), stops for good with ErrBucketDeleted: every
// bound was lost, and in a new bucket revisions restart, so its
// compare-and-swap writes could land on another worker's record.
//
// Claiming: a worker reads all keys and tries, in order, a claimable key last
// held by its own instance name, a key with no message at all, a released
// key, an expired key and a deleted key whose margin has passed, each by
// Update on the revision read (revision 0 for a key without a message, so a
// delete marker is never written over unseen). A key is claimable when
// released, or when by the claimant's clock both "expires" and "bound" plus
// "lease_ms" have passed. A lost race (wrong revision) moves on to the next
// key; if none is left, ErrNoWorkerID.
//
// Heartbeats: every Heartbeat (default 2 s; lease default 15 s) the worker
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
// as the bucket keeps its values (use replicas; the settings that would drop
// values are refused) and keys are not removed without a trace: a
// holder's IDs lie at or below the bound recorded before they were issued,
// and a successor only gets the key by compare-and-set on that record and
// starts above its bound. Two live workers do not hold the same worker ID at
// once (the old one has fenced itself before a successor may claim) as long
// as their clocks run at about the same rate and disagree by less than a
// lease; if they disagree more, the old holder may still issue for a while,
// but below the successor's IDs, and stops at its next heartbeat. A
// Node's own IDs strictly increase, also across worker IDs: when it loses
// its worker ID and claims another, it resumes above the last timestamp it
// used. For a deleted key whose holder could not write its bound back
// (crashed or cut off), the floor relies on the holder's clock having been
// within a lease (or DeletedKeyMargin minus a lease) of the NATS server's.
//
// # Errors
//
// errors.Is(err, ErrUnavailable) means "cannot issue now" (HTTP 503):
// ErrFenced, ErrClockBackwards, ErrOverloaded, ErrClosed, ErrNoWorkerID,
// ErrBucketDeleted.
// ErrInvalidCount is the caller's fault (400): a batch of fewer than 1 or
// more than MaxCount IDs. The rest are configuration or infrastructure
// errors (500, or refuse to start).
//
// # Concurrency
//
// Generator and Node are safe for concurrent use. Settings,
// NodeSettings and Parts are plain values.
package snowflake
