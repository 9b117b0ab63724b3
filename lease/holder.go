package lease

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/dispenser-dev/dispenser/internal/kvbucket"
)

// Holder is the renewing side of one holder of leases in one bucket,
// written once for both users: the loop of renewal rounds (Run), one
// renewal of a held key (Renew) and the logging of failed rounds (Failed).
// Snowflake holds one worker ID's key with it, ownership every ordered tag
// it owns. A user keeps what is its own: its record, its stream check's
// consequences (Stream.Check: ownership drops every tag, snowflake stops
// for good), and what it does with a renewal's Outcome (extend its fence,
// take a write back over a marker, claim again).
//
// # Safety: why the loop may retry, and adopt, without a second holder
//
//   - A round first checks that the bucket's stream is the one the holder
//     started on (Stream.Check), before it writes on a revision it read
//     in it: a recreated bucket restarts its revisions, and a
//     compare-and-swap on an old one could land on a stranger's record.
//   - Every write is Settings.Write, a compare-and-swap on the revision
//     the holder last wrote, fenced on both clocks from before it was sent
//     (the package doc): a renewal can only extend a lease nobody else
//     took, and never for longer than a lease after it reached the server.
//   - Each request of a round waits at most Settings.Attempt. A request
//     lost in a partition, or sent to a JetStream leader that is gone,
//     gets no answer at all; waiting longer for it would hold the round
//     until the lease ran out, and a holder on the majority side of a
//     partition would be fenced by a leader election it could have ridden
//     out. A round that failed for want of an answer is tried again
//     Settings.Retry later (Run), not a whole Heartbeat later; every try
//     reads the clocks again, so no write fences on a failed one's send
//     time.
//   - A compare-and-swap that conflicts may be the holder's own earlier
//     write whose answer was lost: the key is read, and if it holds the
//     holder's own record (Ours: its session) at a newer revision, that
//     revision is adopted (Adopted), without extending the fence, since
//     that write's send time is not known here; the next renewal extends
//     it. A read no newer than the revision written is a follower behind
//     the write that conflicted: it proves nothing and is read again
//     (Behind). Anything else under the key (another holder's record, a
//     delete or purge marker, no message) is a lost lease (Lost), which
//     the user stops using at once.
//
// A failed round is logged once at the start of a streak and every
// hundredth time (Failed): retried every Retry, a partition would
// otherwise log several lines a second.
type Holder struct {
	// Settings are the holder's lease terms and clocks.
	Settings
	// KV is the bucket of the held keys.
	KV jetstream.KeyValue
	// Ctx is the loop's: Run returns once it ends, and a renewal that
	// fails after it ended is Closing, not Failed.
	Ctx context.Context
	// Ours reports whether a put under a held key is this holder's own
	// record (its session), still held: a write of its own whose answer
	// was lost.
	Ours func(e jetstream.KeyValueEntry) bool
	// Latest reads the newest message under a key; nil means
	// kvbucket.Latest (ownership counts its reads).
	Latest func(ctx context.Context, key string) (jetstream.KeyValueEntry, error)
	// Log, Warning and ErrKey are the logger, the message and the error's
	// attribute name of Failed's lines.
	Log     *slog.Logger
	Warning string
	ErrKey  string

	failures atomic.Uint64 // failed requests, in all
	streak   atomic.Uint64 // failed since the last Succeeded
}

// Run calls round every Heartbeat until Ctx ends; Retry after a round
// that reports it should be retried soon; and, if kick is not nil, when
// kick receives, but no sooner than Heartbeat/4 after the last round
// began, so that a storm of kicks (refused requests) does not hammer NATS.
func (h *Holder) Run(kick <-chan struct{}, round func() (retry bool)) {
	t := time.NewTicker(h.Heartbeat)
	defer t.Stop()
	spacing := h.Heartbeat / 4
	var last time.Time
	// retry fires a short pause after a failed round.
	var retry <-chan time.Time
	for {
		select {
		case <-h.Ctx.Done():
			return
		case <-t.C:
		case <-retry:
		case <-kick:
			if wait := spacing - time.Since(last); wait > 0 {
				select {
				case <-h.Ctx.Done():
					return
				case <-time.After(wait):
				}
			}
		}
		retry = nil
		last = time.Now()
		if round() {
			retry = time.After(h.Retry())
		}
	}
}

// Outcome is what one renewal (Renew) found.
type Outcome int

// Outcomes of Renew.
const (
	// Renewed: the write landed; Renewal.Grant extends the fence.
	Renewed Outcome = iota
	// Failed: no answer, or another error (logged by Failed); try again
	// soon. The lease is still held until its fence runs out.
	Failed
	// Closing: Ctx ended; do nothing.
	Closing
	// Gone: the write was refused because the key was deleted
	// (jetstream.ErrKeyNotFound, ErrKeyDeleted); nothing was logged.
	Gone
	// Adopted: a write of the holder's own whose answer was lost had
	// landed; Renewal.Entry holds it, whose revision the holder adopts
	// without extending its fence.
	Adopted
	// Behind: the key read after a conflict is no newer than the revision
	// written (a follower behind): read again next round.
	Behind
	// Lost: the key holds another holder's record, a delete or purge
	// marker (Renewal.Entry), or no message at all (Entry nil).
	Lost
)

// Renewal is the result of Renew.
type Renewal struct {
	Outcome Outcome
	// Grant is the landed write's (Renewed).
	Grant Grant
	// Entry is the key's newest message read after a conflict (Adopted,
	// Lost; nil for none).
	Entry jetstream.KeyValueEntry
	// Err is the error of the write or read (Failed, Gone).
	Err error
}

// Renew writes key's record again by compare-and-swap on rev, the revision
// the holder last wrote or adopted, and on a conflict reads the key to
// tell its own lost write (Adopted) from a lost lease (Lost). Each of its
// requests waits at most Attempt, and no longer than ctx: a round bounded
// as a whole passes its own context, one whose requests each get an
// Attempt passes Ctx. A failed request is logged (Failed) with args.
func (h *Holder) Renew(ctx context.Context, key string, rev uint64, record func(now time.Time) ([]byte, error), args ...any) Renewal {
	wctx, cancel := context.WithTimeout(ctx, h.Attempt())
	g, err := h.Write(wctx, h.KV, key, rev, record)
	cancel()
	switch {
	case err == nil:
		return Renewal{Outcome: Renewed, Grant: g}
	case h.Ctx.Err() != nil:
		return Renewal{Outcome: Closing}
	case errors.Is(err, jetstream.ErrKeyNotFound) || errors.Is(err, jetstream.ErrKeyDeleted):
		return Renewal{Outcome: Gone, Err: err}
	case !kvbucket.Conflict(err):
		h.Failed(err, args...)
		return Renewal{Outcome: Failed, Err: err}
	}
	// The key changed under us. If our own earlier write landed after all
	// (its answer was lost), adopt its revision; else we lost the key, to
	// another holder or to an operator who deleted or purged it.
	rctx, cancel := context.WithTimeout(ctx, h.Attempt())
	defer cancel()
	latest := h.Latest
	if latest == nil {
		latest = func(ctx context.Context, key string) (jetstream.KeyValueEntry, error) {
			return kvbucket.Latest(ctx, h.KV, key)
		}
	}
	e, err := latest(rctx, key)
	switch {
	case err != nil && h.Ctx.Err() != nil:
		return Renewal{Outcome: Closing}
	case err != nil:
		err = fmt.Errorf("read lease: %w", err)
		h.Failed(err, args...)
		return Renewal{Outcome: Failed, Err: err}
	case e != nil && e.Revision() <= rev:
		return Renewal{Outcome: Behind, Entry: e}
	case e != nil && e.Operation() == jetstream.KeyValuePut && h.Ours(e):
		return Renewal{Outcome: Adopted, Entry: e}
	}
	return Renewal{Outcome: Lost, Entry: e}
}

// Failed counts a failed request of a round and logs the first of a
// streak and every hundredth, with args before the error.
func (h *Holder) Failed(err error, args ...any) {
	h.failures.Add(1)
	if n := h.streak.Add(1); n == 1 || n%100 == 0 {
		h.Log.Warn(h.Warning, append(args, h.ErrKey, err, "consecutive_failures", n)...)
	}
}

// Succeeded ends a streak of failures: the next one is logged again.
func (h *Holder) Succeeded() { h.streak.Store(0) }

// Failures returns how many requests of rounds failed, in all.
func (h *Holder) Failures() uint64 { return h.failures.Load() }
