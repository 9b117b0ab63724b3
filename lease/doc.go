// Package lease holds the rules dispenser's leases on JetStream key-value
// keys obey, once, for both of their users: snowflake worker IDs
// (package snowflake) and the owners of ordered tags (package ownership).
// Each user keeps its own record format, key names and what it does while
// it holds a lease; the claim, renewal, release, fencing, deleted-key and
// recreated-bucket rules are here.
//
// # Safety: two holders never both believe they hold a lease
//
// A lease is a record under one key: its holder's session, its lease
// duration, the holder's wall-clock time when it wrote it (Heartbeat) and
// Expires = Heartbeat + lease, and a Released flag. Every write of it is a
// compare-and-swap on the revision last read or written (Settings.Write,
// Claim): of two holders that read the same revision only one write lands,
// and the loser sees a conflict (kvbucket.Conflict). A holder that finds
// its key rewritten, deleted or purged stops at once (Fence.Revoke).
//
// The holder's side (Fence): before it sends a write it reads its
// monotonic clock, then its wall clock, and writes the wall time. Once the
// write succeeded, it counts the lease valid while both
//
//   - its monotonic clock is before that reading plus the lease, and
//   - its wall clock is before the Expires it wrote.
//
// Each check reads both clocks, at once (Clock.Read: with the real clocks
// one time.Now, which reads both).
//
// The monotonic clock alone is not enough: it stops while the machine is
// suspended, so a holder resumed after a long suspension would still
// trust a lease that expired meanwhile. The wall clock alone is not
// enough either: it steps. A lease never lives longer than either clock
// says, and since the monotonic reading was taken before the write was
// sent, never longer than a lease after the write reached the server.
//
// The claimant's side (Terms.ClaimableAt): a record not released may be
// taken over only once the claimant's wall clock is past Expires and past
// Until + lease, where Until is the last wall time its holder may act
// under it (Expires for ownership; the highest ID timestamp bound for
// snowflake). The extra lease is the clock skew tolerated: as long as two
// machines' wall clocks disagree by less than a lease, the old holder's
// wall clock has passed Expires (so it has stopped, on its wall-clock
// check) before the new holder's first write. A released record is
// claimable at once: its holder stopped before it wrote it.
//
// # Deleted keys and purged buckets
//
// An operator who deletes or purges a held key removes the only record of
// the holder's lease: the holder goes on until its next renewal finds the
// key changed (or, partitioned, until its lease ends). A claimant
// therefore counts a delete or purge marker as a record that expires
// DeletedMargin(longest) after the marker's server time (DeletedKeyMargin,
// or twice the longest lease any holder of the bucket may use, whichever
// is longer): one lease for the holder's remaining lease, one for its
// clock running ahead of the server's. So each user records the longest
// lease its workers use in a record of its own (ownership's
// config.leases, snowflake's config max_lease_ms), raised by
// compare-and-swap before a worker claims with a longer lease, and a
// missing record counts as the longest lease allowed. A purged bucket
// (every key gone, markers too) leaves nothing to count from: users detect
// it from the stream having held messages and treat every key as deleted
// when the loss was found.
//
// # Recreated buckets
//
// A bucket deleted and created again starts its revisions over, so a
// compare-and-swap on a revision read before could match a stranger's
// record. A holder remembers its bucket's stream creation time
// (NewStream) and checks it before every claim and renewal round
// (Stream.Check): ErrRecreated (or ErrBucketDeleted) means it must stop
// using every lease of the bucket and write nothing more into it.
//
// # What is not covered
//
// Wall clocks that disagree by more than a lease, a machine suspended
// whose wall clock then also steps back (both clocks wrong at once), and a
// JetStream that
// acknowledges a write it then loses (a bucket with fewer replicas than
// failures, or its server's store restored from an older backup while
// workers run: the stream keeps its creation time, so Stream.Check passes,
// and a key claimed since the backup may look released or expired again),
// are outside the argument; kvbucket.Check refuses buckets that drop
// values.
package lease
