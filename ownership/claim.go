package ownership

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/dispenser-dev/dispenser/internal/kvbucket"
	"github.com/dispenser-dev/dispenser/lease"
)

// Claim makes this worker the tag's owner if nobody holds a live lease on
// it, and returns where its requests go afterwards. A lease this worker
// knows to have expired but not to be claimable yet answers without I/O,
// and so does a failed claim of the tag for retryAfterError; otherwise one
// claim per tag runs at a time, and concurrent callers share its outcome.
//
// Invariant: when Claim wins, it runs Serving.Reset (the allocator's)
// before the lease becomes visible to Owns, Cached and Route, so no
// request is served from buffers this worker held before the claim.
func (l *Leases) Claim(ctx context.Context, tag string) (Route, error) {
	if l.Owns(tag) {
		return Route{Self: true}, nil
	}
	now, mono := l.cfg.Now(), l.mono()
	l.mu.Lock()
	closed, f := l.closed || l.handingOver, l.failed[tag]
	s, known := l.routes[tag]
	known = known && !s.stale
	l.mu.Unlock()
	switch {
	case closed:
		return Route{}, ErrClosed
	case l.recreated.Load():
		return Route{}, ErrBucketRecreated
	case f.err != nil && mono < f.until:
		return Route{}, f.err
	}
	if known && l.settled(s, now) {
		// The watcher brings every change of the key, but one that
		// the server lost (a restart) comes back only seconds later
		// and misses what happened meanwhile, such as a takeover: read
		// the key again (at most every rereadEvery) rather than wait on
		// a cache that may be stale.
		l.mu.Lock()
		last, read := l.reread[tag]
		due := !read || mono-last >= rereadEvery
		if due {
			l.reread[tag] = mono
		}
		l.mu.Unlock()
		if !due {
			return Route{}, nil
		}
		fresh, err := l.read(ctx, tag)
		if err != nil {
			return Route{}, err
		}
		if rt := l.routeOf(fresh); rt.Subject != "" || l.settled(fresh, now) {
			return rt, nil
		}
	}
	ch := l.flights.DoChan("claim "+tag, func() (any, error) {
		done := make(chan struct{})
		l.mu.Lock()
		l.claiming[tag] = done
		l.mu.Unlock()
		rt, err := l.claim(tag)
		l.mu.Lock()
		if err != nil && !errors.Is(err, ErrClosed) {
			l.failed[tag] = failure{until: l.mono() + retryAfterError, err: err}
		} else {
			delete(l.failed, tag)
		}
		delete(l.claiming, tag)
		l.mu.Unlock()
		close(done)
		return rt, err
	})
	select {
	case r := <-ch:
		if r.Err != nil {
			return Route{}, r.Err
		}
		return r.Val.(Route), nil
	case <-ctx.Done():
		return Route{}, ctx.Err()
	}
}

// ClaimUnderway returns a channel closed when this worker's claim of tag
// that is under way ends, won or not, or nil if none is. A claim's
// compare-and-swap lands before Owns holds (the Serving's Reset comes
// between, see Claim): other workers may see this worker's record, and
// forward it requests, while its claim is still completing. Such a
// request may wait for the channel and then ask Owns, rather than fail:
// a won lease is in place, and Owns holds, before the channel is closed.
// Nothing is claimed by asking.
func (l *Leases) ClaimUnderway(tag string) <-chan struct{} {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.claiming[tag] // nil if none
}

// settled reports whether s decides a claim at now without reading the
// key: a lease that expired (or a key deleted) and is not claimable yet,
// so the caller waits. A change of the key since reaches the cache through
// the watcher. A live owner is read again (the caller asked Route first).
func (l *Leases) settled(s seen, now time.Time) bool {
	switch {
	case s.put:
		r := s.rec
		return r.Owner != l.cfg.Owner && !r.Released && !now.Before(r.Expires) && !r.terms().Claimable(now)
	default: // a delete or purge marker, or no message in a purged bucket
		return !s.claimable.IsZero() && !now.After(s.claimable)
	}
}

// claim is one claim of tag (claimOnce), tried again while a request of it
// gets no reply (kvbucket.NoReply: a leader election), for at most a
// lease. A compare-and-swap that landed unanswered left this worker's own
// record under the key, which the next try takes back at once.
func (l *Leases) claim(tag string) (Route, error) {
	ctx, cancel := context.WithTimeout(l.ctx, l.cfg.Lease)
	defer cancel()
	for {
		rt, err := l.claimOnce(ctx, tag)
		if err == nil || !kvbucket.NoReply(err) || ctx.Err() != nil {
			return rt, err
		}
		select {
		case <-time.After(l.terms.Retry()):
		case <-ctx.Done():
			return rt, err
		}
	}
}

// attempt returns a context for one request: it ends after
// lease.Settings.Attempt, or with ctx. A request sent to a stream leader
// that is gone gets no reply at all; waiting longer for it only delays the
// retry.
func (l *Leases) attempt(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, l.terms.Attempt())
}

// claimOnce reads tag's key, and takes it over by compare-and-swap if it
// is free, released, expired a lease ago, or deleted a margin ago. Each
// request waits at most an attempt (attempt) within ctx.
func (l *Leases) claimOnce(ctx context.Context, tag string) (Route, error) {
	actx, cancel := l.attempt(ctx)
	err := l.checkStream(actx)
	cancel()
	if err != nil {
		return Route{}, err
	}
	actx, cancel = l.attempt(ctx)
	e, err := l.latest(actx, tag)
	cancel()
	if err != nil {
		return Route{}, fmt.Errorf("ownership: read %q: %w", tag, err)
	}
	now := l.cfg.Now()
	var rev uint64
	var prev *record
	var terms lease.Terms // of the key as this claimant counts them
	if e != nil {
		rev = e.Revision()
		if e.Operation() != jetstream.KeyValuePut {
			at := e.Created()
			actx, cancel := l.attempt(ctx)
			floor, err := l.deletedFloor(actx, at)
			cancel()
			if err != nil {
				return Route{}, err
			}
			terms = lease.Terms{Lease: l.cfg.Lease, Expires: floor}
			claimable := terms.ClaimableAt()
			l.remember(tag, seen{rev: rev, claimable: claimable})
			if !terms.Claimable(now) {
				return Route{}, nil
			}
			l.log.Warn("ownership: claiming a tag whose key was deleted or purged by hand, a margin after the marker",
				"tag", tag, "marker", kvbucket.MarkerVerb(e.Operation()), "at", at, "claimable_from", claimable)
			prev = &record{}
		} else {
			var r record
			if err := json.Unmarshal(e.Value(), &r); err != nil {
				return Route{}, fmt.Errorf("ownership: tag %q: unreadable lease %q", tag, e.Value())
			}
			prev = &r
			l.remember(tag, seen{rev: rev, rec: r, put: true})
			if r.Owner != l.cfg.Owner { // our own record we may take back at once
				terms = r.terms()
			}
			if !terms.Claimable(now) {
				if terms.Live(now) {
					return Route{Owner: r.Owner, Subject: r.Subject}, nil
				}
				return Route{}, nil // expired, not yet claimable: wait
			}
		}
	}
	// Record our lease as used in the bucket before we hold one.
	actx, cancel = l.attempt(ctx)
	lr, err := l.raiseLongest(actx)
	cancel()
	if err != nil {
		return Route{}, err
	}
	if e == nil && lr.Lost {
		// No message under the key in a bucket whose stream was purged
		// (the record, read after the key, says so): the key may have
		// been held, so it counts as deleted when the loss was found.
		actx, cancel := l.attempt(ctx)
		floor, err := l.deletedFloor(actx, lr.Since)
		cancel()
		if err != nil {
			return Route{}, err
		}
		terms = lease.Terms{Lease: l.cfg.Lease, Expires: floor}
		l.remember(tag, seen{claimable: terms.ClaimableAt()})
		if !terms.Claimable(now) {
			return Route{}, nil
		}
	}
	var rec record
	actx, cancel = l.attempt(ctx)
	defer cancel()
	g, err := l.terms.Claim(actx, l.kv, tag, rev, terms, func(now time.Time) ([]byte, error) {
		rec = l.newRecord(now)
		return json.Marshal(rec)
	})
	if errors.Is(err, lease.ErrNotClaimable) {
		return Route{}, nil // the wall clock stepped back since: wait
	}
	if kvbucket.Conflict(err) {
		// Somebody else was quicker: where did it go?
		s, err := l.read(ctx, tag)
		if err != nil {
			return Route{}, err
		}
		return l.routeOf(s), nil
	}
	if err != nil {
		return Route{}, fmt.Errorf("ownership: claim %q: %w", tag, err)
	}
	newRev := g.Rev
	h := &held{rev: newRev, rec: rec}
	h.fence.Extend(g, l.cfg.Lease)
	l.mu.Lock()
	closed := l.closed || l.handingOver
	l.mu.Unlock()
	if closed {
		l.release(tag, h)
		return Route{}, ErrClosed
	}
	// The invariant: the buffers are dropped before the lease is visible.
	if l.cfg.hooks.acquired != nil {
		l.cfg.hooks.acquired(tag)
	}
	l.mu.Lock()
	if l.closed || l.handingOver {
		l.mu.Unlock()
		l.release(tag, h)
		return Route{}, ErrClosed
	}
	l.owned[tag] = h
	l.rememberLocked(tag, seen{rev: newRev, rec: rec, put: true})
	newer := l.routes[tag].rev > newRev // the watcher saw the key change already
	l.mu.Unlock()
	if newer {
		l.lose(tag, h, "its key changed right after the claim")
		return Route{}, nil
	}
	l.claims.Add(1)
	if prev != nil && prev.Owner != "" && prev.Owner != l.cfg.Owner {
		l.handovers.Add(1)
	}
	l.log.Info("ownership: took tag", "tag", tag, "previous_owner", ownerOf(prev))
	return Route{Self: true}, nil
}

func ownerOf(r *record) string {
	if r == nil {
		return ""
	}
	return r.Owner
}

func (l *Leases) newRecord(now time.Time) record {
	now = now.UTC().Round(0)
	return record{
		Version: 1, Owner: l.cfg.Owner, Subject: l.cfg.Subject, Session: l.session,
		LeaseMS: l.cfg.Lease.Milliseconds(), Heartbeat: now, Expires: now.Add(l.cfg.Lease),
	}
}
