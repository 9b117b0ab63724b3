// Package witness records, before any of its IDs is served, every segment
// fetched from a tagmodel.Store that can lose writes (PostgreSQL after a
// failover to a replica that missed them, a restored backup, a max_id
// lowered by hand) in a JetStream key-value bucket that does not roll back
// with the database.
//
// # Invariant
//
// Per tag the bucket holds a high-water mark M. Every segment [start, end)
// that any worker serves was first recorded by a compare-and-swap that
// raised the mark from m to end, and only when start >= m. So every served
// segment lies below the mark, and two recorded segments never overlap:
// whatever the database forgets, a segment it hands out again lies below the
// mark and is refused. A refused segment means the store lost writes (or,
// rarely, that another worker recorded a later segment first): the worker
// then moves the tag's max_id above the mark in one statement and fetches
// again, and logs and counts a rollback when the database was behind.
//
// A compare-and-swap that gets no reply (a JetStream leader election) may
// have landed or not: the writer reads the mark, and its write counts only
// if the record carries the token of that very write; else it is sent
// again, on the revision it was based on. So a fetch rides out an election
// with the segment it took, and a landed write is never taken for someone
// else's (which would look like a rollback).
//
// Give-back lowers the mark, but only from exactly the end of the giver's
// own last segment (which is then the mark, so nobody recorded after it) to
// the giver's first unissued ID, by compare-and-swap, and only then lowers
// the store's max_id. A give-back is therefore never mistaken for a
// rollback (the mark moves down first), and a rollback is never mistaken
// for a give-back (a rollback does not touch the mark; nothing lowers the
// mark but the worker whose segment ends there). The store's give-back in
// turn applies only if nobody wrote max_id since the giver's own fetch (not
// merely if max_id equals end again), so that a slow give-back cannot lower
// max_id below a mark that other workers raised and lowered meanwhile.
// A fetch that loses the race to record against a worker that fetched
// after it and then gave its whole segment back finds its own segment
// ending exactly at the mark; the record says what was served (Start,
// Prev, Empty), so that this race is not counted as a rollback while a
// store that hands out again IDs that were served is (lostWrites).
//
// # Operator mistakes
//
// A deleted or purged mark stops its tag (ErrMarkDeleted). A tag without a
// mark is taken for a new one only while the bucket holds its proof record
// (package internal/kvbucket's Guard): a purged bucket stops every tag
// without a mark (kvbucket.ErrPurged). After every write the bucket's stream
// is checked again: one deleted and created again since Open
// (kvbucket.ErrRecreated) or given a TTL or limits that drop marks
// (kvbucket.ErrTTL, kvbucket.ErrLimits) serves nothing more.
package witness

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/dispenser-dev/dispenser/internal/kvbucket"
	"github.com/dispenser-dev/dispenser/tagmodel"
)

// DefaultBucket is the witness bucket's default name.
const DefaultBucket = "dispenser_witness"

// Errors of the witness, wrapped with the tag and what to do; test with
// errors.Is.
var (
	// ErrMarkDeleted means a tag's mark was deleted or purged from the
	// bucket: the witness no longer knows what was served, so the tag is
	// not served until an operator puts the mark back.
	ErrMarkDeleted = errors.New("witness: mark deleted")
	// ErrConflict means the mark kept changing under concurrent workers
	// beyond the retries of one fetch; the fetch is retried later.
	ErrConflict = errors.New("witness: mark kept changing")
)

// Raiser is a tagmodel.Store that can, in one atomic statement, move a tag's
// max_id to at least floor and fetch a segment from there.
type Raiser interface {
	tagmodel.Store
	// FetchAbove sets max_id to greatest(max_id, floor) + step (the tag's
	// own step if step <= 0) and returns the segment from the greater of
	// the two, and max_id as it was before.
	FetchAbove(ctx context.Context, tag string, floor, step int64) (a tagmodel.Allocation, before int64, err error)
}

// Settings configure a Store. Zero values mean the documented defaults.
type Settings struct {
	// Bucket is the JetStream KV bucket of the marks, created if missing.
	// Default DefaultBucket.
	Bucket string
	// Replicas of the bucket when it is created. Default 1; use 3 on a
	// cluster. An existing bucket with fewer replicas is refused.
	Replicas int
	// Cluster, if not empty, is the NATS cluster a new bucket is created
	// in (JetStream placement): the region's own (docs/regions.md).
	Cluster string
	// Logger receives rollbacks (error) and deleted marks. Default
	// slog.Default().
	Logger *slog.Logger
	// OnRollback, if set, is called for every detected rollback: the
	// store's max_id was maxID, below the mark.
	OnRollback func(tag string, mark, maxID int64)
}

// Store is a tagmodel.Store that records every fetched segment in the
// witness bucket before returning it. It is safe for concurrent use.
type Store struct {
	Raiser
	kv         jetstream.KeyValue
	guard      *kvbucket.Guard // nil for a Store from New
	log        *slog.Logger
	onRollback func(tag string, mark, before int64)
	rollbacks  atomic.Uint64

	mu sync.Mutex // protects marks
	// marks caches, per tag, the mark and revision this Store last wrote
	// or read, so that a fetch costs one KV round trip; a stale entry
	// fails its compare-and-swap and is read again.
	marks map[string]mark
}

// mark is a tag's witness value and its revision (0: no value), with
// what the record says of the segment that set it (record's Start, Prev
// and Empty). The cache keeps one per tag served, so it holds no more: not
// the token of the write that set it (record.By), which only the bucket's
// copy is checked for.
type mark struct {
	end   int64
	rev   uint64
	start int64
	prev  *int64
	empty bool
}

// servedBelow bounds the IDs ever served of the tag: every one is below
// it. Every served ID is below the mark (the invariant); after a give-back
// of the whole segment that set the mark, every served ID is also below
// that segment's Prev. A record of an earlier version says only the mark.
func (m mark) servedBelow() int64 {
	if m.empty && m.prev != nil {
		return min(*m.prev, m.end)
	}
	return m.end
}

// record is the JSON value under a tag's key. By is a token unique to the
// write that set the mark (absent in records of earlier versions), so that
// a writer whose reply was lost recognises its own write. Start and Prev
// describe the segment whose record set the mark, and are kept by a
// give-back: Start is its first ID, Prev bounds every ID served before it
// was recorded (the servedBelow of the record it replaced). Empty says that
// a give-back returned all of it. Records of earlier versions have none of
// them (0, nil, false): lostWrites then counts as before.
type record struct {
	Mark  int64  `json:"mark"`
	By    string `json:"by,omitempty"`
	Start int64  `json:"start,omitempty"`
	Prev  *int64 `json:"prev,omitempty"`
	Empty bool   `json:"empty,omitempty"`
}

// mark returns the cache entry of r at revision rev.
func (r record) mark(rev uint64) mark {
	return mark{end: r.Mark, rev: rev, start: r.Start, prev: r.Prev, empty: r.Empty}
}

// maxAttempts bounds the compare-and-swap rounds of one fetch.
const maxAttempts = 8

// Open creates the witness bucket or opens an existing one, refuses a
// bucket that can drop values (kvbucket.Check), and returns a Store that
// records the segments of inner.
func Open(ctx context.Context, js jetstream.JetStream, inner Raiser, s Settings) (*Store, error) {
	if s.Bucket == "" {
		s.Bucket = DefaultBucket
	}
	if s.Replicas == 0 {
		s.Replicas = 1
	}
	if s.Replicas < 1 || s.Replicas > 5 {
		return nil, fmt.Errorf("witness: Replicas %d not in 1..5", s.Replicas)
	}
	if s.Logger == nil {
		s.Logger = slog.Default()
	}
	kv, guard, err := kvbucket.OpenGuarded(ctx, js, jetstream.KeyValueConfig{
		Bucket:      s.Bucket,
		Description: "dispenser: high-water marks of served segments",
		History:     1,
		Replicas:    s.Replicas,
		Storage:     jetstream.FileStorage,
		Placement:   kvbucket.Placement(s.Cluster),
	}, "witness marks", s.Logger)
	if err != nil {
		return nil, fmt.Errorf("witness: %w", err)
	}
	w := New(kv, inner, s)
	w.guard = guard
	return w, nil
}

// New returns a Store that records the segments of inner in kv, which the
// caller has checked, without Open's guard against a purged or re-created
// bucket: for reading marks (Mark). Serve from a Store from Open.
func New(kv jetstream.KeyValue, inner Raiser, s Settings) *Store {
	if s.Logger == nil {
		s.Logger = slog.Default()
	}
	return &Store{Raiser: inner, kv: kv, log: s.Logger, onRollback: s.OnRollback, marks: map[string]mark{}}
}

// Bucket returns the witness bucket's name.
func (w *Store) Bucket() string { return w.kv.Bucket() }

// Rollbacks returns how many rollbacks this Store detected.
func (w *Store) Rollbacks() uint64 { return w.rollbacks.Load() }

// Fetch fetches a segment from the inner store and records it in the
// witness; it returns only segments that lie wholly above every segment
// recorded before. Errors are the inner store's, ErrMarkDeleted,
// ErrConflict, or the bucket's (witness unreachable): no segment is served
// without being recorded.
func (w *Store) Fetch(ctx context.Context, tag string, step int64) (tagmodel.Allocation, error) {
	a, err := w.Raiser.Fetch(ctx, tag, step)
	if err != nil {
		return a, err
	}
	for range maxAttempts {
		m, cached, err := w.mark(ctx, tag)
		if err != nil {
			return tagmodel.Allocation{}, err
		}
		if a.Start < m.end {
			if cached {
				w.forget(tag) // maybe stale (a give-back lowered it): read it
				continue
			}
			// The store handed out a segment below what was served:
			// it lost writes, or another worker recorded a later
			// segment first. Move max_id above the mark and fetch again.
			refused := a
			var before int64
			a, before, err = w.Raiser.FetchAbove(ctx, tag, m.end, step)
			if err != nil {
				return tagmodel.Allocation{}, err
			}
			// A race leaves our segment wholly below the mark (the
			// segment that set it was fetched after ours); a store
			// still behind after our fetch, or a refused segment that
			// reaches the mark (overlapping the segment that set it),
			// means the store lost writes. Its max_id was refused.Start.
			// One race ends exactly at the mark: see lostWrites.
			if lostWrites(refused, m, before) {
				w.rollbacks.Add(1)
				w.log.Error("witness: the segment store lost writes (failover, restored backup, max_id lowered by hand, "+
					"or the tag's row deleted and created again); "+
					"moved max_id above the witness mark, no ID is handed out twice",
					"tag", tag, "max_id", refused.Start, "witness_mark", m.end, "bucket", w.kv.Bucket())
				if w.onRollback != nil {
					w.onRollback(tag, m.end, refused.Start)
				}
			}
			continue
		}
		served := m.servedBelow()
		err = w.swap(ctx, tag, m, record{Mark: a.End, Start: a.Start, Prev: &served})
		if err == nil {
			if err := w.check(ctx); err != nil {
				return tagmodel.Allocation{}, fmt.Errorf("witness: recorded segment %d..%d of tag %q, not served: %w", a.Start, a.End-1, tag, err)
			}
			return a, nil
		}
		if !kvbucket.Conflict(err) && !errors.Is(err, errMoved) {
			return tagmodel.Allocation{}, fmt.Errorf("witness: recording segment %d..%d of tag %q: %w", a.Start, a.End-1, tag, err)
		}
		w.forget(tag)
	}
	return tagmodel.Allocation{}, fmt.Errorf("%w: tag %q after %d attempts", ErrConflict, tag, maxAttempts)
}

// lostWrites reports whether a fetch that found its segment refused below
// the mark m (read from the bucket after the inner store answered),
// followed by a fetch above m that found the store's max_id at before,
// shows that the store lost writes.
//
// The store is behind the mark after our fetch (before < m.end), or our
// refused segment reaches past the mark (it overlaps what the segment that
// set the mark may have served): lost writes. A segment wholly below the
// mark (refused.End < m.end) is a race: another worker fetched after us
// and recorded first.
//
// A refused segment that ends exactly at the mark is either. Lost writes:
// the store handed out again IDs below a mark that nobody gave back to,
// which may have been served. A race (issue 34, point 8): A takes 1..10
// from the store; B takes 11..20, records it (mark 21) and gives all of it
// back (mark and max_id 11) before A records; A's segment then ends at
// the mark. The record tells them apart: a give-back of a whole segment
// says so (Empty), and every record keeps Prev, a bound on the IDs served
// before its segment was recorded; servedBelow bounds what was ever
// served. The refused segment is counted only if it starts below that
// bound, that is, may overlap a served ID.
//
// Safety argument. Not counting is safe: a refused segment that starts at
// or above every ID ever served (servedBelow) repeats none of them, and it
// is refused all the same (the fetch moves above the mark); the store lost
// nothing that was served. Not counting the race is right: in the race the
// segment that set the mark was fetched after ours, so it starts at or
// above our end (a consistent store hands out increasing segments, and no
// give-back crosses our fetch: a store's give-back applies only if nobody
// wrote the row since the giver's own write). Our end being the mark, it
// was given back whole (its first unissued ID is its start, our end), so
// the record is Empty. Every segment recorded between our fetch and its
// record either was fetched before ours (it ends at or below our start)
// or after ours and then given back whole too (else its first unissued ID
// above our end would stay a lower bound of the mark); so Prev, followed
// down that chain of whole give-backs (servedBelow takes the lesser of
// Prev and the mark), is at most our start.
func lostWrites(refused tagmodel.Allocation, m mark, before int64) bool {
	return before < m.end || refused.End > m.end || refused.End == m.end && refused.Start < m.servedBelow()
}

// GiveBack lowers the mark from end to firstUnissued if end is the mark,
// then gives the IDs back to the inner store. It reports whether the inner
// store took them.
func (w *Store) GiveBack(ctx context.Context, tag string, end, firstUnissued int64) (bool, error) {
	if err := tagmodel.CheckGiveBack(end, firstUnissued); err != nil {
		return false, fmt.Errorf("witness: give back %q: %w", tag, err)
	}
	w.forget(tag)
	m, _, err := w.mark(ctx, tag)
	if err != nil {
		return false, err
	}
	if m.end != end {
		return false, nil // somebody recorded after us
	}
	given := record{Mark: firstUnissued, Start: m.start, Prev: m.prev}
	// The whole of the segment that set the mark comes back: nothing of it
	// was served, and what was served lies below its Prev (lostWrites).
	given.Empty = m.start > 0 && firstUnissued <= m.start
	if err := w.swap(ctx, tag, m, given); err != nil {
		if kvbucket.Conflict(err) {
			return false, nil
		}
		return false, fmt.Errorf("witness: give back %q: %w", tag, err)
	}
	if err := w.check(ctx); err != nil {
		return false, fmt.Errorf("witness: give back %q: %w", tag, err)
	}
	return w.Raiser.GiveBack(ctx, tag, end, firstUnissued)
}

// check checks the bucket's stream after a write (kvbucket.Guard.Check).
func (w *Store) check(ctx context.Context) error {
	if w.guard == nil {
		return nil
	}
	if err := w.guard.Check(ctx); err != nil {
		w.forgetAll()
		return err
	}
	return nil
}

// Mark returns the tag's mark: the end of the highest segment recorded (0
// and false if none is).
func (w *Store) Mark(ctx context.Context, tag string) (int64, bool, error) {
	e, err := w.kv.Get(ctx, tag)
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return 0, false, nil
	}
	if err != nil {
		return 0, false, fmt.Errorf("witness: read mark of %q: %w", tag, err)
	}
	r, err := decode(tag, e.Value())
	if err != nil {
		return 0, false, err
	}
	return r.Mark, true, nil
}

// Changes passes through to the inner store if it is a
// tagmodel.ChangeLister, and fails with errors.ErrUnsupported otherwise (the
// allocator then lists all tags).
func (w *Store) Changes(ctx context.Context, cursor int64) ([]tagmodel.Change, int64, error) {
	cl, ok := w.Raiser.(tagmodel.ChangeLister)
	if !ok {
		return nil, 0, fmt.Errorf("witness: %T lists no changes: %w", w.Raiser, errors.ErrUnsupported)
	}
	return cl.Changes(ctx, cursor)
}

// PrunePeriods passes through to the inner store if it is a
// tagmodel.PeriodPruner, and fails with errors.ErrUnsupported otherwise.
// The marks of the periods pruned stay in the witness bucket (a period
// pruned is not fetched again, so they guard nothing, and cost a key
// each).
func (w *Store) PrunePeriods(ctx context.Context) (int, error) {
	p, ok := w.Raiser.(tagmodel.PeriodPruner)
	if !ok {
		return 0, fmt.Errorf("witness: %T prunes no periods: %w", w.Raiser, errors.ErrUnsupported)
	}
	return p.PrunePeriods(ctx)
}

// Ping checks that the inner store and the witness bucket answer.
func (w *Store) Ping(ctx context.Context) error {
	if p, ok := w.Raiser.(interface{ Ping(context.Context) error }); ok {
		if err := p.Ping(ctx); err != nil {
			return err
		}
	}
	if _, err := w.kv.Status(ctx); err != nil {
		return fmt.Errorf("witness: bucket %q: %w", w.kv.Bucket(), err)
	}
	return nil
}

// CreateTag and UpdateTag pass through to the inner store if it is a
// tagmodel.Admin.
func (w *Store) CreateTag(ctx context.Context, t tagmodel.Tag) error {
	a, ok := w.Raiser.(tagmodel.Admin)
	if !ok {
		return errors.New("witness: the inner store cannot create tags")
	}
	return a.CreateTag(ctx, t)
}

// UpdateTag: see CreateTag.
func (w *Store) UpdateTag(ctx context.Context, name string, u tagmodel.Update) error {
	a, ok := w.Raiser.(tagmodel.Admin)
	if !ok {
		return errors.New("witness: the inner store cannot update tags")
	}
	return a.UpdateTag(ctx, name, u)
}

// mark returns the tag's mark, from the cache (cached true) or the bucket.
func (w *Store) mark(ctx context.Context, tag string) (_ mark, cached bool, _ error) {
	w.mu.Lock()
	m, ok := w.marks[tag]
	w.mu.Unlock()
	if ok {
		return m, true, nil
	}
	e, err := kvbucket.Latest(ctx, w.kv, tag)
	if err != nil {
		return mark{}, false, fmt.Errorf("witness: read mark of %q: %w", tag, err)
	}
	if e == nil {
		// No mark: a new tag, unless the bucket lost its marks.
		if w.guard != nil {
			if err := w.guard.CheckHeld(ctx); err != nil {
				return mark{}, false, fmt.Errorf("witness: tag %q has no mark: %w", tag, err)
			}
		}
		return mark{}, false, nil
	}
	if e.Operation() != jetstream.KeyValuePut {
		return mark{}, false, fmt.Errorf("%w: tag %q's mark in bucket %q was deleted or purged (revision %d); "+
			"it is not served until the mark is restored: nats kv put %s %s '{\"mark\":N}', "+
			"N above every ID ever handed out for it", ErrMarkDeleted, tag, w.kv.Bucket(), e.Revision(), w.kv.Bucket(), tag)
	}
	r, err := decode(tag, e.Value())
	if err != nil {
		return mark{}, false, err
	}
	m = r.mark(e.Revision())
	w.remember(tag, m)
	return m, false, nil
}

// swap sets the tag's record from m to rec by compare-and-swap on m's
// revision (0: the key has never been written; a delete marker makes it
// fail). A request that gets no reply (kvbucket.WriteAttempt) or a conflict is
// checked against the mark: a write that landed with this call's token
// counts; one still not landed is sent again; a mark moved by another
// writer is a conflict (kvbucket.Conflict).
func (w *Store) swap(ctx context.Context, tag string, m mark, rec record) error {
	token := rand.Text()
	rec.By = token
	data, err := json.Marshal(rec)
	if err != nil {
		return err
	}
	for {
		actx, cancel := context.WithTimeout(ctx, kvbucket.WriteAttempt)
		rev, err := w.kv.Update(actx, tag, data, m.rev)
		cancel()
		if err == nil {
			w.remember(tag, rec.mark(rev))
			return nil
		}
		conflict := kvbucket.Conflict(err)
		if !conflict && !kvbucket.NoReply(err) || ctx.Err() != nil {
			return err
		}
		actx, cancel = context.WithTimeout(ctx, kvbucket.WriteAttempt)
		e, rerr := kvbucket.Latest(actx, w.kv, tag)
		cancel()
		if rerr == nil && e != nil && e.Operation() == jetstream.KeyValuePut {
			if r, derr := decode(tag, e.Value()); derr == nil && r.By == token && r.Mark == rec.Mark {
				// Landed; its reply was lost (or this is a retry's conflict).
				w.remember(tag, rec.mark(e.Revision()))
				return nil
			}
		}
		if conflict {
			return err
		}
		if rerr == nil && (e == nil && m.rev != 0 || e != nil && e.Revision() != m.rev) {
			return fmt.Errorf("%w: the mark of %q moved while a write went unanswered", errMoved, tag)
		}
		// Not landed (or not known): send it again.
	}
}

// errMoved is a compare-and-swap that went unanswered while another
// writer moved the mark: a conflict, for Fetch's loop.
var errMoved = errors.New("witness: mark moved")

func (w *Store) remember(tag string, m mark) {
	w.mu.Lock()
	w.marks[tag] = m
	w.mu.Unlock()
}

func (w *Store) forget(tag string) {
	w.mu.Lock()
	delete(w.marks, tag)
	w.mu.Unlock()
}

func (w *Store) forgetAll() {
	w.mu.Lock()
	clear(w.marks)
	w.mu.Unlock()
}

func decode(tag string, data []byte) (record, error) {
	var r record
	if err := json.Unmarshal(data, &r); err != nil || r.Mark < 0 {
		return record{}, fmt.Errorf("witness: tag %q: unreadable mark %q", tag, data)
	}
	return r, nil
}
