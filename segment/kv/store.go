// Package kv keeps dispenser's tags in a NATS JetStream key-value bucket,
// for deployments that run NATS and no database. Data lives as long as the
// bucket does: with file storage (the default) it survives restarts of the
// NATS server, embedded or not.
//
// Each tag is one key, named after the tag, whose value is JSON:
//
//	{"max_id":1001,"step":1000,"description":"order numbers","ordered":true,"update_time":"2025-01-02T03:04:05.123456789Z"}
//
// "ordered" is left out for a plain tag, so a value without it (written
// before ordered tags existed) is a plain tag. A tag with a reset period
// also has "reset", and may have "time_zone", "format" and
// "retention_days" (left out when empty); each of its periods is a key of
// its own, named tag=KEY, with "period_end" (see fetchPeriod).
//
// Every change is a compare-and-swap on the key's revision, so any number of
// Stores in any number of processes may share one bucket.
//
// # Operator mistakes
//
// The bucket is the only record of what was handed out, so the Store refuses
// to act on a bucket that may have forgotten it (package internal/kvbucket's
// Guard), loudly, with an error and a log line that say what happened and
// how to recover:
//
//   - a bucket purged (nats stream purge) or whose values expired: the
//     bucket's proof record (key "dispenser.bucket", written before anything
//     else) is gone, and no tag is created in it (ErrBucketPurged);
//   - a bucket deleted and created again while the Store runs: its
//     stream's creation time changed (ErrBucketRecreated), checked after
//     every write, so no segment written to another stream is returned;
//   - a TTL or limits that drop values added after start-up: the
//     configuration is checked again after every write (ErrBucketTTL,
//     ErrBucketLimits);
//   - a tag's key deleted or purged by hand (nats kv del): the tag is not
//     created again over its delete marker (tagmodel.ErrTagDeleted) until
//     its value is put back;
//   - a tag's max_id lowered by hand below what this Store wrote: its
//     fetches are refused (ErrMaxIDLowered).
package kv

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"math/rand/v2"
	"slices"
	"sync"
	"time"

	"github.com/dispenser-dev/dispenser/internal/kvbucket"
	"github.com/dispenser-dev/dispenser/tagmodel"
	"github.com/nats-io/nats.go/jetstream"
)

// Errors of New about a bucket that cannot be trusted to keep its values:
// a tag whose value the server drops would, created again, hand out its IDs
// a second time. They are the values of package internal/kvbucket, which the
// snowflake lease bucket is checked with too. New wraps them with %w and a
// message saying what to change; the other errors of this store are those of
// package segment, wrapped likewise.
var (
	// ErrBucketTTL means the bucket expires values: a TTL (max age) or
	// per-message TTLs.
	ErrBucketTTL = kvbucket.ErrTTL
	// ErrBucketLimits means limits that drop values: a message or byte
	// limit with the discard-old policy, or a retention policy other than
	// limits.
	ErrBucketLimits = kvbucket.ErrLimits
	// ErrBucketMemory means an existing bucket kept in memory only, while
	// Settings.Storage asks for file storage.
	ErrBucketMemory = kvbucket.ErrMemoryStorage
	// ErrBucketReplicas means an existing bucket with fewer replicas than
	// Settings.Replicas.
	ErrBucketReplicas = kvbucket.ErrReplicas
	// ErrBucketPurged means the bucket has held values but its proof record
	// is gone: purged, expired or deleted by hand. No tag is created in it.
	ErrBucketPurged = kvbucket.ErrPurged
	// ErrBucketRecreated means the bucket was deleted and created again
	// (or restored) since the Store opened it.
	ErrBucketRecreated = kvbucket.ErrRecreated
	// ErrMaxIDLowered means a tag's max_id is below the one this Store last
	// wrote, which no other worker does: it was lowered by hand (or the
	// bucket lost writes). The tag's fetches fail until the value is put
	// back above every ID handed out, or the Store is opened again.
	ErrMaxIDLowered = errors.New("kv: max_id lowered by hand")
)

// DefaultBucket is the bucket that New uses when Settings.Bucket is empty.
const DefaultBucket = "dispenser_segments"

// Settings configures New. Zero values mean the documented defaults.
type Settings struct {
	// Bucket names the key-value bucket. Default DefaultBucket.
	Bucket string
	// Replicas is the number of replicas of a new bucket, and the fewest
	// an existing bucket may have (ErrBucketReplicas); more are accepted.
	// Default 1.
	Replicas int
	// Storage is the storage of a new bucket. Default (the zero value)
	// jetstream.FileStorage, with which an existing bucket kept in memory
	// is refused (ErrBucketMemory).
	Storage jetstream.StorageType
	// Cluster, if not empty, is the NATS cluster a new bucket is created
	// in (JetStream placement): a region's own, in per-region mode
	// (docs/regions.md). Default: where JetStream places it.
	Cluster string
	// Logger receives the operator mistakes the Store refuses to act on.
	// Default slog.Default().
	Logger *slog.Logger
	// Now is the Store's clock, by which a missing period's row is
	// expired (tagmodel.PeriodExpired) and PrunePeriods prunes. Default
	// time.Now.
	Now func() time.Time
}

// Store implements tagmodel.Store and tagmodel.Admin over a JetStream
// key-value bucket. It is safe for concurrent use, and any number of Stores
// in any number of processes may share one bucket: every change is a
// compare-and-swap on the tag's key, retried on conflict, so two fetches
// never return overlapping allocations.
type Store struct {
	kv    jetstream.KeyValue
	js    jetstream.JetStream // for reads from the stream leader
	guard *kvbucket.Guard
	log   *slog.Logger
	now   func() time.Time

	mu sync.Mutex // protects last, wrote, description and logged
	// last holds, per tag, the value and revision this Store last wrote,
	// so that a change usually takes one round trip (a compare-and-swap on
	// the remembered revision) instead of two. A stale entry only costs a
	// failed swap and a fresh read. GiveBack takes it for the proof that
	// nobody wrote the key since this Store's fetch.
	last map[string]remembered
	// wrote holds, per tag, the max_id this Store last wrote and its
	// revision (kept when last is dropped): nobody else lowers max_id
	// below it (a give-back applies only on the giver's own last write,
	// and lowers max_id only to the giver's unissued IDs, above every
	// earlier fetch), so a value of a later revision below it was lowered
	// by hand.
	wrote map[string]written
	// description is the description last remembered: the next tag
	// remembered with the same one shares its string (tags created on
	// first use, or in bulk, all have the same) instead of keeping a
	// decoded copy of its own.
	description string
	// logged holds the delete markers already logged, by tag and revision,
	// so that requests for a deleted tag log it once.
	logged map[string]uint64
}

type entry struct {
	v   value
	rev uint64
}

// remembered is an entry as last keeps it, one per tag served: without
// the value's update time, which every write sets anew (48 bytes, where an
// entry takes 72).
//
// Every field of the value but the update time must survive the trip
// through remembered: modify and GiveBack write the value they rebuild
// from it back to the key.
type remembered struct {
	maxID, step int64
	description string
	rev         uint64
	ordered     bool
	rare        *rareFields // nil when all of them are zero (most tags)
}

// rareFields are the value's fields most tags leave empty: a tag's reset
// settings and a period's end.
type rareFields struct {
	reset, timeZone, format string
	retentionDays           int
	periodEnd               *time.Time
}

func (r remembered) entry() entry {
	v := value{MaxID: r.maxID, Step: r.step, Description: r.description, Ordered: r.ordered}
	if x := r.rare; x != nil {
		v.Reset, v.TimeZone, v.Format, v.RetentionDays, v.PeriodEnd = x.reset, x.timeZone, x.format, x.retentionDays, x.periodEnd
	}
	return entry{v, r.rev}
}

// rememberedOf returns e as last keeps it.
func rememberedOf(e entry) remembered {
	r := remembered{maxID: e.v.MaxID, step: e.v.Step, description: e.v.Description, rev: e.rev, ordered: e.v.Ordered}
	if v := e.v; v.Reset != "" || v.TimeZone != "" || v.Format != "" || v.RetentionDays != 0 || v.PeriodEnd != nil {
		r.rare = &rareFields{reset: v.Reset, timeZone: v.TimeZone, format: v.Format, retentionDays: v.RetentionDays, periodEnd: v.PeriodEnd}
	}
	return r
}

// written is what wrote keeps of an entry.
type written struct {
	maxID int64
	rev   uint64
}

var (
	_ tagmodel.Store = (*Store)(nil)
	_ tagmodel.Admin = (*Store)(nil)
)

// New returns a Store over the bucket that s names, creating the bucket
// with s's replicas and storage if it does not exist. An existing bucket is
// used as it is, its data and configuration untouched, provided it keeps its
// values: a bucket with a TTL (ErrBucketTTL), with limits that drop values
// (ErrBucketLimits), kept in memory while s asks for file storage
// (ErrBucketMemory) or with fewer replicas than s asks for
// (ErrBucketReplicas) is refused. More replicas, another history or
// discard-new limits are accepted.
//
// A new bucket gets its proof record (see the package comment); a bucket
// that has held values but holds neither tags nor the record is refused
// (ErrBucketPurged), as is one whose record was deleted.
func New(ctx context.Context, js jetstream.JetStream, s Settings) (*Store, error) {
	cfg := jetstream.KeyValueConfig{
		Bucket:      cmp.Or(s.Bucket, DefaultBucket),
		Description: "dispenser segment store",
		Replicas:    cmp.Or(s.Replicas, 1),
		Storage:     s.Storage,
	}
	cfg.Placement = kvbucket.Placement(s.Cluster)
	log := cmp.Or(s.Logger, slog.Default())
	kv, guard, err := kvbucket.OpenGuarded(ctx, js, cfg, "segment store", log)
	if err != nil {
		return nil, fmt.Errorf("kv: %w", err)
	}
	now := s.Now
	if now == nil {
		now = time.Now
	}
	return &Store{kv: kv, js: js, guard: guard, log: log, now: now, last: map[string]remembered{}, wrote: map[string]written{}, logged: map[string]uint64{}}, nil
}

// Ping checks that the bucket answers.
func (s *Store) Ping(ctx context.Context) error {
	if _, err := s.kv.Status(ctx); err != nil {
		return fmt.Errorf("kv: ping: %w", err)
	}
	return nil
}

// value is the JSON value of a tag's key, or of a period's.
type value struct {
	MaxID       int64  `json:"max_id"`
	Step        int64  `json:"step"`
	Description string `json:"description"`
	Ordered     bool   `json:"ordered,omitempty"` // absent: a plain tag
	// The reset settings of a tag (tagmodel.Tag's), absent for a tag
	// without a reset period.
	Reset         string `json:"reset,omitempty"`
	TimeZone      string `json:"time_zone,omitempty"`
	Format        string `json:"format,omitempty"`
	RetentionDays int    `json:"retention_days,omitempty"`
	// PeriodEnd is the end of a period's period, on a period's key only.
	PeriodEnd  *time.Time `json:"period_end,omitempty"`
	UpdateTime time.Time  `json:"update_time"` // RFC 3339 with nanoseconds
}

// tag returns v as the tag name.
func (v value) tag(name string) tagmodel.Tag {
	return tagmodel.Tag{Name: name, MaxID: v.MaxID, Step: v.Step, Description: v.Description, Ordered: v.Ordered,
		Reset: tagmodel.Reset(v.Reset), TimeZone: v.TimeZone, Format: v.Format, RetentionDays: v.RetentionDays, UpdateTime: v.UpdateTime}
}

// errNoChange makes modify return without writing.
var errNoChange = errors.New("no change")

// read returns the tag's value and revision; an unknown or deleted tag
// yields tagmodel.ErrUnknownTag.
//
// A "not found" from KeyValue.Get, which any replica may answer (one behind
// after a partition, or catching up), is checked with the stream leader
// (kvbucket.LeaderLast): a tag is unknown only if the leader says so, so
// that a lagging replica does not turn a tag's requests into 404s.
func (s *Store) read(ctx context.Context, tag string) (value, uint64, error) {
	e, err := s.kv.Get(ctx, tag)
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		if s.js == nil {
			return value{}, 0, tagmodel.ErrUnknownTag
		}
		l, err := kvbucket.LeaderLast(ctx, s.js, s.kv.Bucket(), tag)
		switch {
		case err != nil:
			return value{}, 0, err
		case l == nil || l.Op != jetstream.KeyValuePut:
			return value{}, 0, tagmodel.ErrUnknownTag
		}
		return decodeValue(l.Value, l.Revision)
	}
	if err != nil {
		return value{}, 0, err
	}
	return decodeValue(e.Value(), e.Revision())
}

func decodeValue(data []byte, rev uint64) (value, uint64, error) {
	var v value
	if err := json.Unmarshal(data, &v); err != nil {
		return value{}, 0, fmt.Errorf("malformed value at revision %d: %w", rev, err)
	}
	return v, rev, nil
}

// modify reads the tag, lets change alter the value (read at revision rev)
// and writes it back if the key has not changed since the read, else starts
// over after a short random pause. change may run several times;
// errNoChange from it ends modify with errNoChange and writes nothing.
func (s *Store) modify(ctx context.Context, tag string, change func(v *value, rev uint64) error) error {
	s.mu.Lock()
	r, cached := s.last[tag]
	s.mu.Unlock()
	e := r.entry()
	for attempt := 0; ; attempt++ {
		v, rev := e.v, e.rev
		if !cached {
			rctx, cancel := context.WithTimeout(ctx, kvbucket.WriteAttempt)
			var err error
			v, rev, err = s.read(rctx, tag)
			cancel()
			if err != nil {
				s.forget(tag)
				if kvbucket.NoReply(err) && ctx.Err() == nil {
					if err := pause(ctx, attempt); err != nil {
						return err
					}
					continue // a leader election: read again
				}
				return err
			}
		}
		if err := change(&v, rev); err != nil {
			if cached {
				cached = false // the remembered value may be stale: decide on a fresh read
				continue
			}
			return err
		}
		v.UpdateTime = time.Now().UTC()
		b, err := json.Marshal(v)
		if err != nil {
			return err
		}
		uctx, cancel := context.WithTimeout(ctx, kvbucket.WriteAttempt)
		newRev, err := s.kv.Update(uctx, tag, b, rev)
		cancel()
		if err == nil {
			// The swap went to the bucket's stream of now; only if that
			// is still the stream opened did it follow the value read.
			if err := s.guard.Check(ctx); err != nil {
				s.forget(tag)
				return err
			}
			s.remember(tag, entry{v, newRev})
			return nil
		}
		s.forget(tag)
		if kvbucket.NoReply(err) && ctx.Err() == nil {
			// Landed or not (a leader election): decide on a fresh
			// read. A write that landed is skipped as a gap.
			cached = false
			if err := pause(ctx, attempt); err != nil {
				return err
			}
			continue
		}
		if !kvbucket.Conflict(err) {
			return err
		}
		if cached {
			cached = false // lost to another writer: read and try again at once
			continue
		}
		if err := pause(ctx, attempt); err != nil {
			return err
		}
	}
}

// remember records e as this Store's write of tag, unless a later write (a
// higher revision) is recorded.
func (s *Store) remember(tag string, e entry) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if old, ok := s.last[tag]; !ok || old.rev < e.rev {
		if e.v.Description == s.description {
			e.v.Description = s.description
		} else {
			s.description = e.v.Description
		}
		s.last[tag] = rememberedOf(e)
	}
	if old, ok := s.wrote[tag]; !ok || old.rev < e.rev {
		s.wrote[tag] = written{e.v.MaxID, e.rev}
	}
}

// forget drops the remembered value of tag.
func (s *Store) forget(tag string) {
	s.mu.Lock()
	delete(s.last, tag)
	s.mu.Unlock()
}

// pause waits a random time up to 1 ms doubled attempt times, at most
// 64 ms, or until ctx ends.
func pause(ctx context.Context, attempt int) error {
	t := time.NewTimer(rand.N(time.Millisecond<<min(attempt, 6) + 1))
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Fetch atomically advances the tag's max_id by step (the tag's own step if
// step <= 0) and returns the IDs in between. Errors: tagmodel.ErrInvalidTag,
// tagmodel.ErrInvalidStep (step above tagmodel.MaxStepLimit, or the stored
// step is not positive), tagmodel.ErrUnknownTag, tagmodel.ErrExhausted.
func (s *Store) Fetch(ctx context.Context, tag string, step int64) (tagmodel.Allocation, error) {
	if err := tagmodel.CheckName(tag); err != nil {
		return tagmodel.Allocation{}, fmt.Errorf("kv: fetch: %w", err)
	}
	if step > tagmodel.MaxStepLimit {
		return tagmodel.Allocation{}, fmt.Errorf("kv: fetch %q: %w %d: want at most %d", tag, tagmodel.ErrInvalidStep, step, tagmodel.MaxStepLimit)
	}
	if t, key, ok := tagmodel.SplitPeriodName(tag); ok {
		a, err := s.fetchPeriod(ctx, tag, t, key, step)
		if err != nil {
			return tagmodel.Allocation{}, fmt.Errorf("kv: fetch %q: %w", tag, err)
		}
		return a, nil
	}
	a, err := s.fetchKey(ctx, tag, step, nil)
	if errors.Is(err, tagmodel.ErrUnknownTag) {
		// A tag served until now is gone: a missing key means "deleted"
		// only in a bucket that still holds what it held.
		if herr := s.guard.CheckHeld(ctx); herr != nil {
			err = herr
		}
	}
	if err != nil {
		return tagmodel.Allocation{}, fmt.Errorf("kv: fetch %q: %w", tag, err)
	}
	return a, nil
}

// fetchKey advances the max_id of key, a tag's or (with its tag's value
// of) a period's, by compare-and-swap. A period takes its tag's step
// (as its default and TagStep, and stores it); a tag with a reset period
// hands out nothing from its own key.
func (s *Store) fetchKey(ctx context.Context, tag string, step int64, of *value) (tagmodel.Allocation, error) {
	var a tagmodel.Allocation
	var wrote written
	err := s.modify(ctx, tag, func(v *value, rev uint64) error {
		if of == nil && v.Reset != "" {
			return fmt.Errorf("%w: the tag has a reset period (%s): fetch its periods (%s)", tagmodel.ErrInvalidArgument, v.Reset, tagmodel.PeriodName(tag, "KEY"))
		}
		if of != nil {
			v.Step = of.Step
		}
		s.mu.Lock()
		w, ok := s.wrote[tag]
		s.mu.Unlock()
		// An older revision is a stale read (its swap fails); only a
		// later one below our write was lowered by another hand.
		if ok && rev > w.rev && v.MaxID < w.maxID {
			wrote = w
			return fmt.Errorf("%w: the key holds max_id %d (revision %d), below %d that this worker wrote (revision %d), "+
				"and no worker lowers it: someone put a lower value by hand (nats kv put) or the bucket lost writes; the tag "+
				"is not served here until its value is put back above every ID handed out (nats kv put %s %s "+
				"'{\"max_id\":N,\"step\":%d}')",
				ErrMaxIDLowered, v.MaxID, rev, wrote.maxID, wrote.rev, s.kv.Bucket(), tag, v.Step)
		}
		n := step
		if n <= 0 {
			n = v.Step
		}
		if n <= 0 {
			return fmt.Errorf("%w: the tag's stored step %d is not positive", tagmodel.ErrInvalidStep, v.Step)
		}
		if v.MaxID > math.MaxInt64-n {
			return fmt.Errorf("%w: max_id would overflow int64", tagmodel.ErrExhausted)
		}
		a = tagmodel.Allocation{Start: v.MaxID, End: v.MaxID + n, TagStep: v.Step}
		v.MaxID = a.End
		return nil
	})
	if errors.Is(err, ErrMaxIDLowered) {
		s.logOnce(tag, wrote.rev, "kv: refusing a fetch below what this worker handed out", "tag", tag, "err", err)
	}
	return a, err
}

// GiveBack sets the tag's max_id back to firstUnissued if this Store's last
// write of the tag left it at end and nobody wrote the key since (a
// compare-and-swap on that write's revision), and reports whether it did.
// A max_id that is end again after other workers fetched and gave back is
// not taken for it: the revision tells. An unknown tag, or one this Store
// has not written, reports false. firstUnissued must be in 1..end
// (tagmodel.ErrInvalidArgument).
func (s *Store) GiveBack(ctx context.Context, tag string, end, firstUnissued int64) (bool, error) {
	if err := tagmodel.CheckName(tag); err != nil {
		return false, fmt.Errorf("kv: give back: %w", err)
	}
	if err := tagmodel.CheckGiveBack(end, firstUnissued); err != nil {
		return false, fmt.Errorf("kv: give back %q: %w", tag, err)
	}
	s.mu.Lock()
	r, ok := s.last[tag]
	s.mu.Unlock()
	e := r.entry()
	if !ok || e.v.MaxID != end {
		return false, nil
	}
	v := e.v
	v.MaxID = firstUnissued
	// What this Store vouches for drops to firstUnissued before the write:
	// whether or not the write lands (its reply may be lost), a later read
	// at or above it is no value lowered by hand.
	s.mu.Lock()
	if w := s.wrote[tag]; w.rev <= e.rev { // else the swap below fails
		s.wrote[tag] = written{v.MaxID, e.rev}
	}
	s.mu.Unlock()
	v.UpdateTime = time.Now().UTC()
	b, err := json.Marshal(v)
	if err != nil {
		return false, fmt.Errorf("kv: give back %q: %w", tag, err)
	}
	rev, err := s.kv.Update(ctx, tag, b, e.rev)
	if err != nil {
		s.forget(tag)
		if kvbucket.Conflict(err) {
			return false, nil // somebody wrote the key after us
		}
		return false, fmt.Errorf("kv: give back %q: %w", tag, err)
	}
	if err := s.guard.Check(ctx); err != nil {
		s.forget(tag)
		return false, fmt.Errorf("kv: give back %q: %w", tag, err)
	}
	s.remember(tag, entry{v, rev})
	return true, nil
}

// Tags lists the names of all tags in byte order. Keys that are not valid
// tag names (put into the bucket by something else) are left out, since no
// operation of this Store accepts them.
func (s *Store) Tags(ctx context.Context) ([]string, error) {
	// Unlike KeyValue.Keys, this notices a listing cut short.
	w, err := s.kv.WatchAll(ctx, jetstream.IgnoreDeletes(), jetstream.MetaOnly())
	if err != nil {
		return nil, fmt.Errorf("kv: list tags: %w", err)
	}
	defer w.Stop()
	names := []string{}
	for {
		select {
		case e, ok := <-w.Updates():
			switch {
			case !ok:
				return nil, fmt.Errorf("kv: list tags: watcher stopped: %w", cmp.Or(ctx.Err(), errors.New("subscription closed")))
			case e == nil: // all current keys seen
				slices.Sort(names)
				return slices.Compact(names), nil
			case tagmodel.ValidTag(e.Key()):
				names = append(names, e.Key())
			}
		case <-ctx.Done():
			return nil, fmt.Errorf("kv: list tags: %w", ctx.Err())
		}
	}
}

// Tag looks up one tag. Errors: tagmodel.ErrInvalidTag,
// tagmodel.ErrUnknownTag.
func (s *Store) Tag(ctx context.Context, name string) (tagmodel.Tag, error) {
	if err := tagmodel.CheckTag(name); err != nil {
		return tagmodel.Tag{}, fmt.Errorf("kv: tag: %w", err)
	}
	v, _, err := s.read(ctx, name)
	if err != nil {
		return tagmodel.Tag{}, fmt.Errorf("kv: tag %q: %w", name, err)
	}
	return v.tag(name), nil
}

// CreateTag adds the tag t with step t.Step, first ID t.MaxID, t.Description
// and t.Ordered. A deleted tag may be created again; it then starts over at
// its new first ID. Errors: tagmodel.ErrInvalidTag, tagmodel.ErrInvalidStep
// (step not in 1..tagmodel.MaxStepLimit), tagmodel.ErrInvalidArgument (first
// ID < 1, description over tagmodel.MaxDescription characters or not UTF-8
// without NUL), tagmodel.ErrTagExists (nothing changes).
func (s *Store) CreateTag(ctx context.Context, t tagmodel.Tag) error {
	p, err := t.Check()
	if err != nil {
		return fmt.Errorf("kv: create tag: %w", err)
	}
	// A missing key is a new tag only in a bucket that still holds what
	// it held.
	if err := s.guard.CheckHeld(ctx); err != nil {
		return fmt.Errorf("kv: create tag %q: %w", t.Name, err)
	}
	b, err := json.Marshal(value{MaxID: t.MaxID, Step: t.Step, Description: t.Description, Ordered: t.Ordered,
		Reset: string(p.Reset), TimeZone: t.TimeZone, Format: t.Format, RetentionDays: t.RetentionDays, UpdateTime: time.Now().UTC()})
	if err != nil {
		return fmt.Errorf("kv: create tag %q: %w", t.Name, err)
	}
	// Update on revision 0 fails if the key has any message, a delete
	// marker included (Create would write over one).
	_, err = s.kv.Update(ctx, t.Name, b, 0)
	if kvbucket.Conflict(err) {
		return s.createConflict(ctx, t.Name)
	}
	if err != nil {
		return fmt.Errorf("kv: create tag %q: %w", t.Name, err)
	}
	if err := s.guard.Check(ctx); err != nil {
		return fmt.Errorf("kv: create tag %q: %w", t.Name, err)
	}
	return nil
}

// createConflict tells why a key could not be created: it holds a value
// (tagmodel.ErrTagExists) or a delete or purge marker (tagmodel.ErrTagDeleted,
// logged once per marker).
func (s *Store) createConflict(ctx context.Context, tag string) error {
	e, err := kvbucket.Latest(ctx, s.kv, tag)
	if err != nil {
		return fmt.Errorf("kv: create tag %q: %w", tag, err)
	}
	if e == nil || e.Operation() == jetstream.KeyValuePut {
		return fmt.Errorf("kv: create tag %q: %w", tag, tagmodel.ErrTagExists)
	}
	verb := kvbucket.MarkerVerb(e.Operation())
	err = fmt.Errorf("kv: create tag %q: %w: its key in bucket %q was %s at %s (nats kv del or purge, or DeleteTag), "+
		"and with it the record of the IDs it handed out; created again from its start it would hand them out again, "+
		"so it is not created; to serve it, put its value back above every ID it handed out: "+
		"nats kv put %s %s '{\"max_id\":N,\"step\":S}'",
		tag, tagmodel.ErrTagDeleted, s.kv.Bucket(), verb, e.Created().UTC().Format(time.RFC3339Nano), s.kv.Bucket(), tag)
	s.logOnce(tag, e.Revision(), "kv: refusing to create a tag whose key was deleted", "tag", tag, "err", err)
	return err
}

// logOnce logs msg at error level unless it was logged for tag and key
// before.
func (s *Store) logOnce(tag string, key uint64, msg string, args ...any) {
	s.mu.Lock()
	seen := s.logged[tag] == key+1
	if !seen {
		if len(s.logged) >= maxLogged {
			clear(s.logged)
		}
		s.logged[tag] = key + 1
	}
	s.mu.Unlock()
	if !seen {
		s.log.Error(msg, args...)
	}
}

// maxLogged bounds the entries of Store.logged.
const maxLogged = 10000

// UpdateTag sets the tag's fields of u that are not nil, in one
// compare-and-swap on the value it checked (tagmodel.ApplyUpdate: a reset
// period can be set, never changed or removed, and the settings are checked
// together). It does not move max_id. Errors: as for CreateTag, and
// tagmodel.ErrUnknownTag.
func (s *Store) UpdateTag(ctx context.Context, name string, u tagmodel.Update) error {
	if err := u.Check(name); err != nil {
		return fmt.Errorf("kv: update tag: %w", err)
	}
	err := s.modify(ctx, name, func(v *value, _ uint64) error {
		t, err := tagmodel.ApplyUpdate(v.tag(name), u)
		if err != nil {
			return err
		}
		v.Step, v.Description, v.Ordered = t.Step, t.Description, t.Ordered
		v.Reset, v.TimeZone, v.Format, v.RetentionDays = string(t.Reset), t.TimeZone, t.Format, t.RetentionDays
		return nil
	})
	if err != nil {
		return fmt.Errorf("kv: update tag %q: %w", name, err)
	}
	return nil
}

// DeleteTag removes a tag: it is no longer listed or served, and its key
// keeps a delete marker, so that CreateTag refuses to start it over
// (tagmodel.ErrTagDeleted) and hand out its IDs again; only a value put by
// hand (nats kv put) brings it back. Errors: tagmodel.ErrInvalidTag,
// tagmodel.ErrUnknownTag.
func (s *Store) DeleteTag(ctx context.Context, name string) error {
	if err := tagmodel.CheckTag(name); err != nil {
		return fmt.Errorf("kv: delete tag: %w", err)
	}
	if _, _, err := s.read(ctx, name); err != nil {
		return fmt.Errorf("kv: delete tag %q: %w", name, err)
	}
	if err := s.kv.Delete(ctx, name); err != nil {
		return fmt.Errorf("kv: delete tag %q: %w", name, err)
	}
	return nil
}

// Changes lists the tags written since revision cursor of the bucket
// (created, fetched, given back, updated or deleted), with their values, and
// returns the bucket's last revision as the next cursor: it reads only what
// changed. Cursor 0 lists nothing. A key written several times is listed
// once per write.
func (s *Store) Changes(ctx context.Context, cursor int64) ([]tagmodel.Change, int64, error) {
	info, err := kvbucket.StreamInfo(ctx, s.kv)
	if err != nil {
		return nil, 0, fmt.Errorf("kv: changes: %w", err)
	}
	last := int64(info.State.LastSeq)
	if cursor <= 0 || cursor >= last {
		return nil, last, nil
	}
	w, err := s.kv.WatchAll(ctx, jetstream.IncludeHistory(), jetstream.ResumeFromRevision(uint64(cursor)+1))
	if err != nil {
		return nil, 0, fmt.Errorf("kv: changes: %w", err)
	}
	defer w.Stop()
	var out []tagmodel.Change
	for {
		select {
		case e, ok := <-w.Updates():
			if !ok {
				return nil, 0, fmt.Errorf("kv: changes: watcher stopped: %w", cmp.Or(ctx.Err(), errors.New("subscription closed")))
			}
			if e == nil {
				return out, last, nil
			}
			if !tagmodel.ValidTag(e.Key()) {
				continue
			}
			c := tagmodel.Change{Tag: tagmodel.Tag{Name: e.Key()}}
			var v value
			switch {
			case e.Operation() != jetstream.KeyValuePut:
				c.Deleted = true
			case json.Unmarshal(e.Value(), &v) == nil:
				c.Tag = v.tag(e.Key())
			}
			out = append(out, c)
			if int64(e.Revision()) >= last {
				return out, last, nil
			}
		case <-ctx.Done():
			return nil, 0, fmt.Errorf("kv: changes: %w", ctx.Err())
		}
	}
}
