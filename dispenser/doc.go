// Package dispenser is the NATS service of the dispenser workers: it serves
// unique IDs as a micro service named "dispenser" (Name), segment IDs on
// <prefix>.segment.<tag> and snowflake IDs on <prefix>.snowflake, in a
// queue group so that many workers share the load. It holds the whole NATS
// request path: the endpoints and their queue groups (endpoint.go), micro
// discovery, the handlers (handlers.go), the reading of a request (one
// call of protocol.Request.Read, ReadRequest in place, per request), the
// replies (reply.go), the one mapping from errors to reply codes
// (errors.go: a table keyed by sentinel error), and the ordered tags:
// routing to the owner, forwarding in batches, the owner's side of
// forwarded requests and the direct subject (ordered.go, forward.go). The
// allocator (package segment), the snowflake generator (package
// snowflake) and the ownership leases (package ownership) are given to it
// in Config.
//
// An ordered request is followed from the handler to the reply by plain
// calls: handleSegment → orderedTags.serve → takeOwned (owner) or
// enqueueForward → runForwarder → NATS → the owner's handleForwarded →
// takeOwned → Service.replyOwned → Service.reply.
//
// # Invariants
//
//   - Nothing is taken for a request whose reply subject is refused: every
//     handler (and handleForwarded, handleDirect for each request) calls
//     admitReply first; a refused request is counted, logged at a bounded
//     rate, and gets no answer.
//   - Every admitted request is answered exactly once: with IDs
//     (Service.reply, replier.respond) or an error (replier.fail), by the
//     handler, by the goroutine its request was parked on, by the owner
//     it was forwarded to, or by the worker it was handed on to (handOff
//     passes that worker's reply on, or fails it itself). A request held
//     while it waits (a segment, an owner) is held by one goroutine of one
//     worker at a time; Stop waits for them.
//   - A request is read before anything is taken: its token, format, count
//     and whether its reply fits in a message of the server
//     (protocol.ReadRequest); one that fails gets its 400 and changes
//     nothing. Every reply to a request whose protocol.TokenHeader is
//     readable, with IDs or an error, echoes it.
//   - A worker takes only requests it can serve (endpoint.go;
//     docs/reliability.md, "A worker that cannot serve is not asked"): it
//     joins the segment endpoint's queue group only once the tag list has
//     loaded, and is in the snowflake endpoint's only while the generator
//     can issue (watchSnowflake). A request it finds it cannot serve after
//     all (no segment within the wait, the generator unable to issue) is
//     handed on to another worker of the group (handOff), whose reply it
//     passes on: still one answer.
//   - Only the owner of an ordered tag serves it: see below.
//   - Errors are mapped to reply codes in one place (Service.Classify, the
//     table errorCodes); a 503 or 500 does not carry the store's or the
//     network's details.
//
// # Ordered tags: why no ID is handed out out of order
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
//     ownership.Open wires the leases to the allocator so that the tag's
//     buffers are reset (segment.Allocator.Reset) when ownership is gained, before
//     Owns reports it, and again when it is lost, after Owns stopped
//     reporting it. A segment fetched under an earlier ownership is never
//     installed (the allocator's generations), so every ID an owner hands
//     out is above every ID any earlier owner handed out.
//  3. IDs are served only if taken while owning. orderedTags takes IDs
//     with segment.Allocator.TakeOwned (orderedTags.takeOwned) and then
//     checks, in this order, that Owns holds (both clocks read then, at
//     t2) and that the buffer the IDs came from is still current
//     (segment.Source.Current, orderedTags.owns); otherwise the IDs are
//     skipped (never handed out) and the request is routed again. A
//     request that waited for a segment is checked the same way when the
//     wait ends. If both hold, no Reset of the tag came between the take
//     and the second check, so the IDs come from a buffer made after the
//     Reset of the claim of the lease Owns found valid (2): from segments
//     fetched after that claim, above every ID an earlier owner handed
//     out; and since that lease was valid at t2, no other worker had
//     claimed the tag by then (1), so every ID a later owner hands out is
//     above them. The request, answered after t2, is therefore in order
//     with every request that completed before it was sent and every one
//     sent after its answer, whatever paused this worker before t2: a lease
//     lost and claimed again between the take and the check is a later
//     ownership than the one the IDs were taken under, and Current sees
//     the Resets in between. This check after taking is the one the
//     argument rests on. The check that routes a request here before
//     taking (Owners.Cached's Self) reads no clock: it says that this
//     worker holds the lease and that no check found it run out, so it
//     may still say so a moment after the lease ran out by the clocks; such
//     a request takes IDs and skips them, and once a check found the lease
//     run out Cached reads the clocks too (until a renewal), so only the
//     requests before that check take any. A request served from memory
//     is therefore one reading of both clocks (lease.Clock.Read).
//     Forwarded requests are served only while Owns holds. One that
//     comes while this worker's claim of the tag is under way (its write
//     landed, so the sender saw this worker as the owner, but the Reset
//     of 2 has not returned and Owns does not hold yet) waits for the
//     claim's outcome, for at most the route wait (Owners' ClaimWaiter,
//     orderedTags.awaitClaim), and is then served as any other, with the
//     check after taking, if Owns holds, or routed from here if not.
//     Otherwise forwarded requests fail with ErrOwnershipMoving (503), and
//     the requester retries.
//  4. Direct requests are served exactly like forwarded ones: only while
//     Owns holds, through the same TakeOwned and check after taking. A
//     worker's direct subject names the worker, not the tag's owner: a
//     request on it reaching a worker that does not own the tag (it lost
//     it, never had it, or the tag is not ordered) is refused with
//     ErrNotOwner (protocol.CodeMisdirected) before anything is taken
//     (after the claim's outcome, if its claim of the tag is under way), and
//     the requester asks the queue group again. One lost while taking is
//     routed again, as in 3. So a client that still sends to a former
//     owner gets no ID from it: every ID still comes from the owner of the
//     moment, from segments fetched while it owned the tag (1, 2), and a
//     move costs the client one more round trip, never an ID out of order.
//     The direct subject is requester input: its reply subject must pass
//     admitReply, its tag token must be valid and its count and format
//     readable before any of it is used.
//  5. A tag made ordered while it was served as plain: workers that have
//     not seen the change yet may serve it as plain for a switch window
//     (segment.Allocator.SwitchWindow); the owner drops segments made
//     before the window ended, so everything it serves afterwards is
//     above what was served as plain.
//
// A request may fail (503) while ownership moves; it is never answered
// with an ID out of order.
package dispenser
