package snowflake

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/dispenser-dev/dispenser/lease"
	"github.com/nats-io/nats.go/jetstream"
)

// run renews the lease every Heartbeat, and claims a new worker ID when the
// old one is lost, until Close cancels w.ctx (lease.Holder.Run: kicks come
// from refused requests, spaced so that a storm of them does not hammer
// NATS; a failed heartbeat is tried again after lease.Settings.Retry).
func (w *Node) run() {
	defer close(w.done)
	w.holder.Run(w.kick, w.round)
}

// round is one turn of the loop: a heartbeat while a worker ID is held, a
// write-back owed, or a claim. It reports whether to try again soon.
func (w *Node) round() (retry bool) {
	if w.paused.Load() {
		return false
	}
	w.mu.Lock()
	held, owed, gone := w.id >= 0, w.owed != nil, w.gone != nil
	w.mu.Unlock()
	switch {
	case gone:
		// Stopped for good; Close ends the loop.
	case held:
		return w.heartbeat()
	case owed:
		ctx, cancel := context.WithTimeout(w.ctx, w.cfg.Lease)
		if w.writeBack(ctx) {
			w.poke()
		}
		cancel()
	default:
		w.reclaim()
	}
	return false
}

// checkBucket makes sure the bucket is the one the worker started on. A
// bucket deleted (and maybe created again) while the worker runs has lost
// every bound; in a new one revisions restart, so a compare-and-swap on a
// revision of the old one could succeed against someone else's record. So
// the worker stops for good (stop), loudly, and checkBucket returns
// ErrBucketDeleted. It returns another error if the bucket could not be
// read (the caller then acts as on any failed write: not at all).
func (w *Node) checkBucket(ctx context.Context) error {
	w.mu.Lock()
	gone := w.gone
	w.mu.Unlock()
	if gone != nil {
		return gone
	}
	err := w.stream.Check(ctx)
	switch {
	case errors.Is(err, lease.ErrBucketDeleted):
		w.stop(fmt.Errorf("%w: bucket %q no longer exists (nats kv rm / nats stream rm); every lease bound in it is lost",
			ErrBucketDeleted, w.cfg.Bucket))
	case errors.Is(err, lease.ErrRecreated):
		w.stop(fmt.Errorf("%w: bucket %q was deleted and created again (its stream was created at %s, now another); "+
			"every lease bound in it is lost and its revisions restarted: %w", ErrBucketDeleted, w.cfg.Bucket,
			w.stream.Created().UTC().Format(TimeLayout), err))
	case err != nil:
		return fmt.Errorf("snowflake: read lease bucket %q: %w", w.cfg.Bucket, err)
	default:
		return nil
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.gone
}

// stop stops the worker for good after the bucket was deleted or
// recreated: it issues nothing more and writes nothing more.
func (w *Node) stop(err error) {
	w.mu.Lock()
	first := w.gone == nil
	if first {
		w.gone = err
		w.id = -1
		w.owed = nil
	}
	w.mu.Unlock()
	if !first {
		return
	}
	w.gen.revoke(err)
	w.log.Error("snowflake: the lease bucket was deleted or replaced while this worker ran; it stops issuing IDs for good. "+
		"Stop every worker of the bucket and start them again only after twice the longest lease has passed "+
		"since the last one stopped (the bounds that kept successors above the IDs issued are gone)", "error", err)
}

// heartbeat renews the lease (lease.Holder.Renew): a CAS write of the
// current time and a bound at least a lease ahead. Only after the write
// succeeded may the generator use the new bound, so the recorded bound
// always covers what was issued. It reports whether it failed for want of
// an answer, and should be tried again soon. The whole round waits at most
// lease.Settings.Attempt (why: lease.Holder).
func (w *Node) heartbeat() (retry bool) {
	ctx, cancel := context.WithTimeout(w.ctx, w.terms.Attempt())
	defer cancel()
	// Before writing on a revision, make sure the bucket is the one that
	// revision belongs to.
	if err := w.checkBucket(ctx); err != nil {
		if !errors.Is(err, ErrBucketDeleted) {
			id, _ := w.WorkerID()
			w.holder.Failed(err, "worker", id)
			return true
		}
		return false
	}
	w.mu.Lock()
	id, rev := w.id, w.rev
	oldBoundMs := w.rec.Bound.UnixMilli() - w.gen.epochMs
	w.mu.Unlock()
	if id < 0 {
		return false
	}
	var rec leaseRecord
	r := w.holder.Renew(ctx, workerKey(id), rev, func(now time.Time) ([]byte, error) {
		nowMs := now.UnixMilli() - w.gen.epochMs
		rec = w.newRecord(id, now, max(oldBoundMs, nowMs+w.cfg.Lease.Milliseconds()))
		return json.Marshal(rec)
	}, "worker", id)
	switch r.Outcome {
	case lease.Renewed:
		w.mu.Lock()
		w.rev, w.rec = r.Grant.Rev, rec
		w.heartbeats++
		w.holder.Succeeded()
		w.gen.renew(rec.Bound.UnixMilli()-w.gen.epochMs, r.Grant.Mono+w.cfg.Lease)
		w.mu.Unlock()
		return false
	case lease.Closing:
		return false
	case lease.Gone:
		w.holder.Failed(r.Err, "worker", id)
		return true
	case lease.Failed, lease.Behind:
		return true
	case lease.Adopted:
		var cur leaseRecord
		_ = json.Unmarshal(r.Entry.Value(), &cur) // Ours decoded it
		w.mu.Lock()
		w.rev, w.rec = r.Entry.Revision(), cur
		w.mu.Unlock()
		w.poke()
		return false
	}
	e := r.Entry
	if e != nil && e.Operation() == jetstream.KeyValuePut {
		var cur leaseRecord
		_ = json.Unmarshal(e.Value(), &cur)
		w.gen.revoke(ErrFenced)
		w.mu.Lock()
		w.id = -1
		w.losses++
		w.mu.Unlock()
		w.log.Warn("snowflake: lost worker ID to another holder; claiming a new one", "worker", id, "holder", cur.Instance)
		w.poke()
		return false
	}
	// Deleted or purged (a marker), or gone without a trace (the stream
	// was purged). Our bound is the only record left of what we may have
	// issued: stop issuing, then write it back over the marker so that a
	// successor starts above it.
	lastMs := w.gen.revoke(ErrFenced)
	w.mu.Lock()
	owed := w.owedLocked(e, lastMs)
	w.id = -1
	w.losses++
	w.owed = owed
	w.mu.Unlock()
	w.log.Error("snowflake: this worker's lease key was "+owed.what+" while it held it; "+
		"stopped issuing under it and writing back the last timestamp it used, so that a successor starts above it; "+
		"then claiming a worker ID", "worker", id, "bound", owed.rec.Bound)
	if w.writeBack(ctx) {
		w.poke()
	}
	return false
}

// reclaim claims a worker ID after the old one was lost.
func (w *Node) reclaim() {
	ctx, cancel := context.WithTimeout(w.ctx, max(w.cfg.Lease, 5*time.Second))
	defer cancel()
	c, err := w.claim(ctx)
	if err != nil {
		if w.ctx.Err() != nil || errors.Is(err, ErrBucketDeleted) {
			return
		}
		class := "other"
		for _, e := range []error{ErrNoWorkerID, ErrEpochLost, ErrEpochMismatch, ErrLayoutMismatch} {
			if errors.Is(err, e) {
				class = e.Error()
			}
		}
		w.mu.Lock()
		w.claimFailures++
		log := w.claimFailures == 1 || class != w.claimErr || w.claimFailures%100 == 0
		w.claimErr = class
		w.mu.Unlock()
		if errors.Is(err, ErrEpochLost) || errors.Is(err, ErrEpochMismatch) || errors.Is(err, ErrLayoutMismatch) {
			// Refuse with the reason, not a bare ErrFenced.
			w.gen.revoke(fmt.Errorf("%w: %w", ErrFenced, err))
			if log {
				w.log.Error("snowflake: cannot claim a worker ID; refusing to issue IDs until the bucket is repaired", "error", err)
			}
			return
		}
		if log {
			w.log.Warn("snowflake: claiming a worker ID failed; will retry", "error", err)
		}
		return
	}
	w.mu.Lock()
	w.claimFailures = 0
	w.claimErr = ""
	w.mu.Unlock()
	w.install(c)
}
