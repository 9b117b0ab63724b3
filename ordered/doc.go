// Package ordered serves ordered tags: tags whose IDs increase
// linearizably across all workers. Exactly one worker at a time, the tag's
// owner, hands out its IDs; every other worker forwards the tag's requests
// to the owner, in batches, and the owner answers each requester directly.
// The owner's replies name its direct subject (protocol.DirectHeader), on
// which a client may send the tag's next requests to the owner itself,
// without the hop through another worker.
//
// # Why no ID is handed out out of order
//
// The argument is made here once; the code it names enforces it.
//
//  1. One owner at a time. Ownership is a lease in a JetStream KV bucket
//     (package ownership): taken and renewed by compare-and-swap, and held
//     by this worker only while both its monotonic and its wall clock say
//     the lease is valid (Owners.Owns), so a worker that was paused,
//     partitioned or suspended stops serving before anyone else may claim
//     the tag.
//  2. An owner serves only segments fetched while it owned the tag.
//     OpenLeases (ownership.Open) wires the leases to the allocator so that the tag's
//     buffers are reset (Allocator.Reset) when ownership is gained, before
//     Owns reports it, and again when it is lost, after Owns stopped
//     reporting it. A segment fetched under an earlier ownership is never
//     installed (the allocator's generations), so every ID an owner hands
//     out is above every ID any earlier owner handed out.
//  3. IDs are taken only while owning. Tags takes IDs with TakeOwned and
//     checks Owns after taking them: IDs taken across a loss are skipped
//     (never handed out) and the request is routed again. A request that
//     waited for a segment is checked the same way when the wait ends.
//     Forwarded requests are served only while Owns holds; otherwise they
//     fail with ErrOwnershipMoving (503), and the requester retries.
//  4. Direct requests are served exactly like forwarded ones: only while
//     Owns holds, through the same TakeOwned and check after taking. A
//     worker's direct subject names the worker, not the tag's owner: a
//     request on it reaching a worker that does not own the tag (it lost
//     it, never had it, or the tag is not ordered) is refused with
//     ErrNotOwner (protocol.CodeMisdirected) before anything is taken, and
//     the requester asks the queue group again. One lost while taking is
//     routed again, as in 3. So a client that still sends to a former
//     owner gets no ID from it: every ID still comes from the owner of the
//     moment, from segments fetched while it owned the tag (1, 2), and a
//     move costs the client one more round trip, never an ID out of order.
//     The direct subject is requester input: its reply subject must pass
//     Admit, its tag token must be valid and its count and format
//     readable before any of it is used.
//  5. A tag made ordered while it was served as plain: workers that have
//     not seen the change yet may serve it as plain for a switch window
//     (segment.Allocator.SwitchWindow); the owner drops segments made
//     before the window ended, so everything it serves afterwards is
//     above what was served as plain.
//
// A request may fail (503) while ownership moves; it is never answered
// with an ID out of order.
package ordered
