// Package chaos holds dispenser's chaos and availability tests. They build
// cmd/dispenser, run real worker processes against embedded nats-servers and
// throwaway PostgreSQL clusters, drive load from concurrent clients that
// record every ID returned, break processes and servers while the load runs,
// and then check the two promises of an ID service: no ID is ever handed out
// twice, and the service stays available.
//
//   - TestChaos: three workers, one nats-server, one PostgreSQL primary
//     with a streaming replica behind one multi-host URL
//     (target_session_attrs=read-write); load on three plain tags, one
//     ordered tag (--ordered, --ordered-lease 2s, four concurrent clients)
//     and snowflake; SIGKILL, SIGTERM, SIGSTOP beyond the snowflake lease,
//     SIGSTOP until a replacement takes the worker ID over, SIGKILL,
//     SIGTERM and SIGSTOP of the ordered tag's owner (found in the
//     segment endpoint's stats, "ordered" → "owned"), PostgreSQL crash and
//     stop, PostgreSQL failover to a replica that missed the last fetches,
//     nats-server restart, on a seeded random schedule. Each fault must
//     show its effect (a kill by SIGKILL, a clean exit, a fenced episode,
//     a lost lease, the ordered tag owned by another process, a failed
//     fetch, the primary's max_id moved past the replica's and a worker
//     logged the witness's "the segment store lost writes", every worker
//     reconnected), or the test fails. No duplicate, only IDs or 503 in
//     replies, per-worker order, no two processes issuing with one
//     snowflake worker ID at overlapping times, the ordered tag's replies
//     linearizably increasing (for any request A answered before B was
//     sent, max(A) < min(B), on the test's monotonic clock) and its
//     failures only 503 or timeouts, self-recovery; failed requests are
//     reported by fault, for all requests and for the ordered tag's. The
//     failover happens at most once per run: the promoted replica is the
//     primary from then on, and the later PostgreSQL faults break it.
//   - TestOrderedOwnerChanges: the chaos mode of ordered tags. Three
//     workers on the JetStream KV segment store, --ordered-lease 400ms,
//     --refresh-interval 200ms, eight clients on one tag that is switched
//     from plain to ordered and back every few seconds while they run; in
//     each ordered phase, one to three owner changes: SIGSTOP of the owner
//     until another took over, SIGTERM (handover at once) or SIGKILL of
//     the owner and restart, and a stalled claim: the logs of the workers
//     that may claim the tag stalled (their stdout and stderr are a pipe
//     the test stops draining and fills, so their next log line blocks)
//     while the owner is frozen, which holds the claimant between taking
//     the tag and dropping what it held of it. Every ordered phase is
//     checked for linearizable increase from the moment its switch settled
//     (every worker forwarded a request, and the owner serves from a
//     segment at or above the tag's max_id as it was then) until the
//     switch back. TestChaos did not catch a claimant serving from buffers
//     it held before it owned the tag: its ordered tag is ordered from
//     the start (no worker ever holds a plain segment of it), its owner
//     changes three times a run, twice by killing the owner with its
//     buffers, and the window is a few microseconds long.
//   - TestDatabaseOutage: PostgreSQL down for 10 s under load with steps
//     for 30 s of it: no failed request, and the workers refill their
//     buffers by themselves afterwards.
//   - TestRestartDuringDatabaseOutage: a worker restarted while PostgreSQL
//     is down must not fail requests that the others could serve.
//   - TestNATSClusterFailover: three clustered nats-servers, buckets with
//     three replicas, each server stopped in turn: no lease lost, no
//     duplicate, failures only while clients reconnect.
//   - TestPartitions: network faults (issue 23). A 3-node nats-server
//     cluster whose routes all go through faultnet links (no_advertise,
//     routes and clients pinged every 1 s), buckets with 3 replicas, three
//     workers each attached to its own node by a link of its own, and to
//     the PostgreSQL primary and replica through links; load clients on
//     every node (two plain tags, the ordered tag with two clients per
//     node, snowflake, batches of 1-8 IDs), one clock, checked together.
//     Faults on a seeded schedule: a node isolated (by seed the ordered
//     tag's owner's or the node of a snowflake worker ID's holder on
//     another node; long mode alternates), with a majority worker
//     SIGKILLed and restarted meanwhile, once the majority has elected
//     its JetStream leaders; the majority's traffic to one node cut in
//     one direction, with that
//     node's worker SIGSTOPped beyond its lease; a bridge (two nodes cut
//     from each other, both see the third); a node flapping (isolated
//     and healed every 1-3 s); PostgreSQL cut (black hole); a worker cut
//     from its NATS server; latency of 20-100 ms with jitter on every
//     route and worker link and one worker link limited to 64 KB/s,
//     while the next faults happen (in short mode only pg-cut: healing a
//     black hole under a latency costs toxiproxy seconds, see
//     faultnet.Link.Remove). Each fault must show its effect
//     (routes down in Routez, the isolated worker fenced and the ordered
//     tag owned on the majority, a fenced episode of the frozen worker, a
//     failed fetch, "nats disconnected" and "nats reconnected" logged).
//     Checks: the chaos checks (no duplicate, linearizable ordered tag
//     across all nodes, snowflake worker IDs, only IDs, 503 or timeouts;
//     "no responders" only on a cut side), no failure on the majority
//     side of an isolation or of a worker's NATS cut for requests sent
//     after the fault took effect (faultnet.RouteDetect or ClientDetect,
//     plus half a second) until the heal, but the ordered tag's when its
//     owner was cut off, and the ordered tag's and snowflake's with
//     leases under rideOutLease (short mode); no majority worker fenced (leases of rideOutLease or
//     more); after every heal every subject answered on every node within
//     healBound (two leases + the worker's reconnect time + the request
//     timeout); and the next fault begins only once the cluster has
//     recovered (JetStream healthy on every server, every worker holding
//     its snowflake lease). It logs the availability per fault, side and subject
//     (requests, failures, longest gap without an answer) and the time
//     from each heal to every subject answered on every node. Short
//     mode: each fault once on PostgreSQL, 3 s leases; long mode: default
//     leases, every fault once and a second isolation, then random faults
//     until DISPENSER_CHAOS_DURATION is over, on PostgreSQL and then on
//     the KV segment store. TestCheckSides, TestCheckHealed,
//     TestCheckFailureKinds and TestAvailabilityTable check its checks.
//   - TestSustainedLoad: 80% of the measured maximum for 10 s (60 s in long
//     mode): achieved (at least 90% of the offered rate), no failure, flat
//     resident memory.
//   - TestExitZeroWhenGiveBackAndReleaseFail: SIGTERM after the
//     nats-server went away: give-back and lease release fail, exit status
//     must still be 0.
//
// The checks are checked too: TestHarnessDetectsViolations,
// TestCheckSnowflakeWorkers, TestCheckUnique, TestCheckOrderedFailures
// and TestFaultEffects feed every branch of the checker a misbehaving fake
// (for linearizability: a fake ordered tag answered from two interleaved
// counters, unique and each increasing). The checkers of uniqueness,
// per-worker increase and linearizability themselves are package
// internal/tests/check's, with their self-tests there
// (TestCheckLinearizable among them). The nats-servers are testenv's
// (NATSServer, NATSCluster), the fault network faultnet's.
//
// Run it with
//
//	go test -race ./internal/tests/chaos/                 # short mode, 160-180 s on 2 cores
//	DISPENSER_CHAOS_LONG=1 go test -timeout 30m ./internal/tests/chaos/
//
// Environment variables:
//
//	DISPENSER_CHAOS_SEED      seed of the fault schedule (logged as "chaos seed: N"), to replay a run
//	DISPENSER_CHAOS_LONG      1: long mode, minutes of faults, a chaos run on the JetStream KV
//	                          segment store, three seeds of TestOrderedOwnerChanges (seed, +1,
//	                          +2), and 60 s of sustained load
//	DISPENSER_CHAOS_DURATION  length of the fault phase of TestChaos, and of each run of
//	                          TestOrderedOwnerChanges, in long mode (default 5m; short mode:
//	                          TestOrderedOwnerChanges 30 s)
//	DISPENSER_CHAOS_RACE      1 or 0: build the workers with or without -race
//	                          (default: like the test binary, which shares its build cache)
//
// A replay repeats the fault schedule; the timing of the processes, and so
// the details, differ. The tests need PostgreSQL's server
// programs (see testenv) and Go on PATH to build the binary; nothing is
// skipped. Worker logs are printed when a test fails.
package chaos
