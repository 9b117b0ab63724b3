// Package segment is the allocator engine: it hands out per-tag ID
// sequences in the style of Meituan's Leaf-segment. Each tag's range is
// taken from a tagmodel.Store one segment at a time, and two in-memory
// segments per tag (a double buffer) let the next segment arrive in the
// background while the current one is spent.
//
// What a tag is (its settings, periods, period keys, formats, regions) and
// what a store promises are package tagmodel's; this package owns the
// buffers, the tag map, the waits and the give-back.
//
// Invariants (each with its argument beside the code):
//   - An ID is handed out only from a segment the store allocated to this
//     allocator (Fetch returned it, and no other Fetch anywhere overlaps
//     it), and each ID of a segment at most once: buffer.take advances the
//     segment's cursor under the buffer's lock.
//   - A tag's IDs increase within one allocator: the next segment is used
//     only once the current one is spent, and the store's max_id only
//     grows (a give-back returns only IDs never handed out, and only if
//     nobody fetched since).
//   - A request waits at most MaxWait (ColdWait for a tag's first segment)
//     and then fails with ErrUnavailable; it never blocks a request of
//     another tag.
//   - An ordered tag is served only by TakeOwned, by the worker that owns
//     it (package ownership): its buffers are reset when ownership is gained
//     or lost, so no segment of an earlier ownership is ever served.
//   - A tag with a reset period is served from its current period's row
//     (tagmodel.PeriodName), never from the tag's own row, and a period
//     that ended longer ago than the tag's retention is not started again
//     (tagmodel.ErrPeriodExpired).
//
// Lock order (see Allocator for what each mutex protects):
// Allocator.refreshMu, then tagMap.mu, then Allocator.mu; a buffer's mu is
// a leaf, held only around the buffer's own fields.
package segment
