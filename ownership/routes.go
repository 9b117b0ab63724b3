package ownership

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/dispenser-dev/dispenser/internal/kvbucket"
)

// watch keeps the route cache current with every change of the bucket, so
// that a release or a takeover redirects this worker's requests at once,
// and makes a holder whose key changed under it stop at once.
func (l *Leases) watch(w jetstream.KeyWatcher) {
	for {
		for e := range w.Updates() {
			if e != nil {
				l.observe(e)
			}
		}
		w.Stop()
		for {
			if l.ctx.Err() != nil {
				return
			}
			var err error
			if w, err = l.kv.WatchAll(l.ctx, jetstream.UpdatesOnly()); err == nil {
				break
			}
			select {
			case <-l.ctx.Done():
				return
			case <-time.After(time.Second):
			}
		}
	}
}

// observe applies one change of the bucket. An event no newer than what
// this worker already knows of the key (a late delivery) changes nothing.
func (l *Leases) observe(e jetstream.KeyValueEntry) {
	tag := e.Key()
	if strings.Contains(tag, ".") {
		return // LeasesKey
	}
	s := seenOf(e)
	l.mu.Lock()
	l.rememberLocked(tag, s)
	h := l.owned[tag]
	var mine uint64
	if h != nil {
		mine = h.rev
	}
	l.mu.Unlock()
	if h == nil || s.rev <= mine {
		return
	}
	switch {
	case e.Operation() != jetstream.KeyValuePut:
		l.lose(tag, h, "its key was "+kvbucket.MarkerVerb(e.Operation())+" by hand")
	case !s.put || s.rec.Session != l.session:
		l.lose(tag, h, "its key was rewritten by another worker")
	}
}

// rememberLocked caches s for tag unless a newer revision is cached. l.mu
// must be held.
func (l *Leases) rememberLocked(tag string, s seen) {
	if cur, ok := l.routes[tag]; ok && cur.rev > s.rev {
		return
	} else if ok && cur.rev == s.rev && !s.stale && s.claimable.IsZero() {
		s.claimable = cur.claimable
	}
	l.routes[tag] = s
}

func (l *Leases) remember(tag string, s seen) {
	l.mu.Lock()
	l.rememberLocked(tag, s)
	l.mu.Unlock()
}

func (l *Leases) mono() time.Duration { return l.terms.Mono() }

// Owns reports whether this worker holds a valid lease for tag now: the
// only condition under which it may serve the tag. Valid means both before
// the lease's end by the monotonic clock and before the record's expiry by
// the wall clock (the monotonic clock stops while the machine is
// suspended).
func (l *Leases) Owns(tag string) bool {
	l.mu.Lock()
	h := l.owned[tag]
	l.mu.Unlock()
	return h != nil && l.valid(h)
}

// valid reports whether h's lease is valid now on both clocks; if not, it
// marks h expired, so that Cached checks the clocks too until a renewal
// extends the lease.
func (l *Leases) valid(h *held) bool {
	if h.fence.Valid(l.terms.Clock) {
		return true
	}
	if !h.expired.Load() {
		h.expired.Store(true)
	}
	l.fencedHits.Add(1)
	return false
}

// Route says where tag's requests go now, from what this worker last saw
// of the tag's key (reading it once if never).
func (l *Leases) Route(ctx context.Context, tag string) (Route, error) {
	if l.Owns(tag) {
		return Route{Self: true}, nil
	}
	s, ok := l.cached(tag)
	if !ok {
		var err error
		if s, err = l.read(ctx, tag); err != nil {
			return Route{}, err
		}
	}
	return l.routeOf(s), nil
}

// routeOf is where requests go by s: a live owner other than this worker,
// or none.
func (l *Leases) routeOf(s seen) Route {
	r := s.rec
	if s.put && r.Owner != "" && r.Owner != l.cfg.Owner && !r.Released && l.cfg.Now().Before(r.Expires) {
		return Route{Owner: r.Owner, Subject: r.Subject}
	}
	return Route{}
}

// cached returns what this worker knows of tag's key, if it may be trusted.
func (l *Leases) cached(tag string) (seen, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	s, ok := l.routes[tag]
	return s, ok && !s.stale && !l.closed // closed: the watcher no longer keeps the cache
}

// read reads tag's key, once for all concurrent callers, and caches it.
func (l *Leases) read(ctx context.Context, tag string) (seen, error) {
	ch := l.flights.DoChan("read "+tag, func() (any, error) {
		rctx, cancel := context.WithTimeout(l.ctx, l.cfg.Lease)
		defer cancel()
		var e jetstream.KeyValueEntry
		var err error
		for {
			actx, acancel := l.attempt(rctx)
			e, err = l.latest(actx, tag)
			acancel()
			if err == nil || !kvbucket.NoReply(err) || rctx.Err() != nil {
				break
			}
			select { // no reply (a leader election): read again
			case <-time.After(l.terms.Retry()):
			case <-rctx.Done():
			}
		}
		if err != nil {
			return seen{}, fmt.Errorf("ownership: read %q: %w", tag, err)
		}
		s := seenOf(e)
		l.remember(tag, s)
		return s, nil
	})
	select {
	case r := <-ch:
		if r.Err != nil {
			return seen{}, r.Err
		}
		return r.Val.(seen), nil
	case <-ctx.Done():
		return seen{}, ctx.Err()
	}
}

// latest reads the newest message under key, counting the read.
func (l *Leases) latest(ctx context.Context, key string) (jetstream.KeyValueEntry, error) {
	l.lookups.Add(1)
	return kvbucket.Latest(ctx, l.kv, key)
}

func seenOf(e jetstream.KeyValueEntry) seen {
	if e == nil {
		return seen{}
	}
	s := seen{rev: e.Revision()}
	if e.Operation() == jetstream.KeyValuePut {
		s.put = json.Unmarshal(e.Value(), &s.rec) == nil
		s.stale = !s.put
	}
	return s
}

// Cached says where tag's requests go from what this worker already knows,
// without I/O; ok is false when it knows of no live owner (then use Route).
//
// Self is not Owns: it says that this worker holds tag's lease (acquired
// after the Serving's Reset, not lost since) and that no check found the
// lease run out since it was last extended, and it reads no clock when
// none did. So the lease may have run out by the clocks a moment ago: a
// caller may take IDs on it, but may serve them only if Owns holds after
// it took them (package dispenser's safety argument, step 3), and skips
// them otherwise. Once Owns (or Cached) found the lease run out, Cached
// reads the clocks too, until a renewal extends the lease: a worker whose
// lease ran out takes (and skips) IDs only for the requests that came
// before its first check after that.
func (l *Leases) Cached(tag string) (r Route, ok bool) {
	l.mu.Lock()
	h := l.owned[tag]
	l.mu.Unlock()
	if h != nil && (!h.expired.Load() || l.valid(h)) {
		return Route{Self: true}, true
	}
	s, ok := l.cached(tag)
	if !ok {
		return Route{}, false
	}
	r = l.routeOf(s)
	return r, r.Subject != ""
}

// Forget makes the next Route read tag's key again (for example after a
// forwarded request went unanswered). A read older than what was cached
// does not replace it.
func (l *Leases) Forget(tag string) {
	l.mu.Lock()
	if s, ok := l.routes[tag]; ok {
		s.stale = true
		l.routes[tag] = s
	}
	l.mu.Unlock()
}
