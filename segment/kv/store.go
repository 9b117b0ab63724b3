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
//   - a bucket that went back while the Store runs (its server's store
//     restored from an older backup, or nats stream restore of a backup
//     that keeps the creation time): a write landed at or below a sequence
//     the Store saw before sending it (kvbucket.Guard.CheckWrite), and from
//     then on nothing is returned (ErrBucketRecreated);
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
	"math/rand/v2"
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
		base := s.guard.Seen()
		uctx, cancel := context.WithTimeout(ctx, kvbucket.WriteAttempt)
		newRev, err := s.kv.Update(uctx, tag, b, rev)
		cancel()
		if err == nil {
			// The swap went to the bucket's stream of now; only if that
			// is still the stream opened, and did not go back, did it
			// follow the value read.
			if err := s.guard.CheckWrite(ctx, base, newRev); err != nil {
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
