package ownership

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sort"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/dispenser-dev/dispenser/internal/kvbucket"
	"github.com/dispenser-dev/dispenser/lease"
)

// checkStream refuses a bucket whose stream is not the one Open found; on
// the first mismatch it drops every lease held.
func (l *Leases) checkStream(ctx context.Context) error {
	if l.recreated.Load() {
		return ErrBucketRecreated
	}
	err := l.stream.Check(ctx)
	switch {
	case err == nil:
		return nil
	case !errors.Is(err, lease.ErrRecreated):
		return fmt.Errorf("ownership: %w", err) // unreadable or gone: nothing is written
	}
	if !l.recreated.Swap(true) {
		l.log.Error("ownership: the bucket's stream was deleted and created again while this worker ran; "+
			"it no longer serves or claims ordered tags: restart it", "err", err)
		l.mu.Lock()
		owned := make(map[string]*held, len(l.owned))
		for tag, h := range l.owned {
			owned[tag] = h
		}
		l.mu.Unlock()
		for tag, h := range owned {
			l.lose(tag, h, "the bucket was deleted and recreated")
		}
	}
	return fmt.Errorf("%w: %w", ErrBucketRecreated, err)
}

// run renews the held leases every Heartbeat until Close, and a round that
// failed for want of an answer again after lease.Settings.Retry
// (lease.Holder.Run).
func (l *Leases) run() {
	defer close(l.done)
	l.holder.Run(nil, l.heartbeat)
}

// heartbeat renews every held lease once, or releases it (Plain). It first
// checks that the bucket is the one Open found and that the longest lease
// recorded covers ours; if either fails, no lease is renewed this round.
// It reports whether the round failed for want of an answer, and should
// be tried again soon. Each of its requests waits at most
// lease.Settings.Attempt (why: lease.Holder).
func (l *Leases) heartbeat() (retry bool) {
	l.mu.Lock()
	tags := make([]string, 0, len(l.owned))
	for tag := range l.owned {
		tags = append(tags, tag)
	}
	l.mu.Unlock()
	if len(tags) == 0 {
		return false
	}
	sort.Strings(tags)
	ctx, cancel := context.WithTimeout(l.hbCtx, l.terms.Attempt())
	err := l.checkStream(ctx)
	cancel()
	if err != nil {
		if errors.Is(err, ErrBucketRecreated) || l.hbCtx.Err() != nil {
			return false
		}
		l.holder.Failed(err)
		return true
	}
	ctx, cancel = context.WithTimeout(l.hbCtx, l.terms.Attempt())
	_, err = l.raiseLongest(ctx)
	cancel()
	if err != nil {
		if l.hbCtx.Err() != nil {
			return false
		}
		l.holder.Failed(err)
		return true
	}
	for _, tag := range tags {
		if l.cfg.hooks.plain != nil && l.cfg.hooks.plain(tag) {
			l.log.Info("ownership: releasing a tag that is no longer ordered", "tag", tag)
			l.Release(tag)
			continue
		}
		if l.renew(tag) {
			retry = true
		}
	}
	if !retry {
		l.holder.Succeeded()
	}
	return retry
}

// renew renews one lease (lease.Holder.Renew): a compare-and-swap on the
// revision last written, the fence extended from the send time of the
// write. It reports whether it should be tried again soon: it got no
// answer, or it found that a write of its own whose answer was lost had
// landed after all, which it adopts without extending the fence.
func (l *Leases) renew(tag string) (retry bool) {
	l.mu.Lock()
	h := l.owned[tag]
	var rev uint64
	if h != nil {
		rev = h.rev
	}
	l.mu.Unlock()
	if h == nil || l.recreated.Load() {
		return false
	}
	var rec record
	r := l.holder.Renew(l.hbCtx, tag, rev, func(now time.Time) ([]byte, error) {
		rec = l.newRecord(now)
		return json.Marshal(rec)
	}, "tag", tag)
	switch r.Outcome {
	case lease.Renewed:
		newRev := r.Grant.Rev
		l.mu.Lock()
		h.rev, h.rec = newRev, rec
		l.rememberLocked(tag, seen{rev: newRev, rec: rec, put: true})
		newer := l.routes[tag].rev > newRev
		l.mu.Unlock()
		if newer {
			l.lose(tag, h, "its key changed right after the heartbeat")
			return false
		}
		h.fence.Extend(r.Grant, l.cfg.Lease)
		h.expired.Store(false) // after Extend: Cached trusts the holding again
		return false
	case lease.Closing:
		return false
	case lease.Gone:
		l.lose(tag, h, "its key was deleted or purged")
		return false
	case lease.Failed, lease.Behind:
		return true
	case lease.Adopted:
		s := seenOf(r.Entry)
		l.mu.Lock()
		if s.rev > h.rev {
			h.rev, h.rec = s.rev, s.rec
		}
		l.rememberLocked(tag, s)
		l.mu.Unlock()
		return true
	}
	l.lose(tag, h, "its key was rewritten, deleted or purged")
	return false
}

// lose drops a lease this worker no longer holds: Owns turns false before
// the Serving's Reset runs.
func (l *Leases) lose(tag string, h *held, why string) {
	h.fence.Revoke()
	l.mu.Lock()
	if l.owned[tag] != h {
		l.mu.Unlock()
		return
	}
	delete(l.owned, tag)
	if s, ok := l.routes[tag]; ok {
		s.stale = true
		l.routes[tag] = s
	}
	l.mu.Unlock()
	l.losses.Add(1)
	l.log.Warn("ownership: lost tag", "tag", tag, "reason", why)
	if l.cfg.hooks.lost != nil {
		l.cfg.hooks.lost(tag)
	}
}

// Release hands tag over at once: this worker stops serving it and marks
// its lease released. The caller has stopped serving the tag.
func (l *Leases) Release(tag string) {
	l.mu.Lock()
	h := l.owned[tag]
	delete(l.owned, tag)
	l.mu.Unlock()
	if h != nil {
		h.fence.Revoke()
		l.release(tag, h)
		if l.cfg.hooks.lost != nil {
			l.cfg.hooks.lost(tag)
		}
	}
}

func (l *Leases) release(tag string, h *held) {
	l.mu.Lock()
	rec, rev := h.rec, h.rev
	l.mu.Unlock()
	if l.recreated.Load() {
		return // never write to a stranger's stream
	}
	ctx, cancel := context.WithTimeout(context.Background(), l.cfg.Lease)
	defer cancel()
	// Before writing on a revision, make sure the bucket is the one that
	// revision belongs to (lease.Holder's first rule, as for a renewal):
	// in a bucket deleted and created again the compare-and-swap could
	// land on another worker's live record and mark it released,
	// claimable at once while that worker serves
	// (TestReleaseIntoRecreatedBucket).
	if err := l.checkStream(ctx); err != nil {
		if !errors.Is(err, ErrBucketRecreated) {
			l.log.Warn("ownership: release failed; the tag moves once the lease expires", "tag", tag, "err", err)
		}
		return
	}
	for adopted := 0; ; adopted++ {
		g, err := l.terms.Write(ctx, l.kv, tag, rev, func(now time.Time) ([]byte, error) {
			rec.Heartbeat, rec.Expires, rec.Released = now, now, true
			return json.Marshal(rec)
		})
		if err == nil {
			l.remember(tag, seen{rev: g.Rev, rec: rec, put: true})
			return
		}
		if kvbucket.Conflict(err) && adopted < maxReleaseAdopts {
			// A renewal of this session that landed after its answer
			// was given up (Close and HandOver cancel a heartbeat round
			// under way) moved the key on: release at its revision.
			// Only this session's own record is adopted, by a
			// compare-and-swap on its revision, so nobody else's
			// lease is ever overwritten. Without this, the tag stayed
			// without an owner until the lease ran out and one more
			// (TestReleaseAfterALandedRenewal).
			e, rerr := l.latest(ctx, tag)
			if rerr == nil && e != nil && e.Operation() == jetstream.KeyValuePut {
				if s := seenOf(e); s.put && s.rec.Session == l.session && !s.rec.Released && s.rev > rev {
					rev, rec = s.rev, s.rec
					continue
				}
			}
		}
		l.log.Warn("ownership: release failed; the tag moves once the lease expires", "tag", tag, "err", err)
		return
	}
}

// maxReleaseAdopts bounds how many newer revisions of its own record a
// release adopts (one is what a cancelled renewal leaves).
const maxReleaseAdopts = 3
