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
// before ordered tags existed) is a plain tag.
//
// Every change is a compare-and-swap on the key's revision, so any number of
// Stores in any number of processes may share one bucket.
package kv

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"sync"
	"time"

	"github.com/dispenser-dev/dispenser/internal/kvbucket"
	"github.com/dispenser-dev/dispenser/segment"
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
}

// Store implements segment.Store and segment.Admin over a JetStream
// key-value bucket. It is safe for concurrent use, and any number of Stores
// in any number of processes may share one bucket: every change is a
// compare-and-swap on the tag's key, retried on conflict, so two fetches
// never return overlapping allocations.
type Store struct {
	kv jetstream.KeyValue

	mu sync.Mutex // protects last
	// last holds, per tag, the value and revision this Store last read or
	// wrote, so that a change usually takes one round trip (a
	// compare-and-swap on the remembered revision) instead of two. A stale
	// entry only costs a failed swap and a fresh read.
	last map[string]entry
}

type entry struct {
	v   value
	rev uint64
}

var (
	_ segment.Store = (*Store)(nil)
	_ segment.Admin = (*Store)(nil)
)

// New returns a Store over the bucket that s names, creating the bucket
// with s's replicas and storage if it does not exist. An existing bucket is
// used as it is, its data and configuration untouched, provided it keeps its
// values: a bucket with a TTL (ErrBucketTTL), with limits that drop values
// (ErrBucketLimits), kept in memory while s asks for file storage
// (ErrBucketMemory) or with fewer replicas than s asks for
// (ErrBucketReplicas) is refused. More replicas, another history or
// discard-new limits are accepted.
func New(ctx context.Context, js jetstream.JetStream, s Settings) (*Store, error) {
	cfg := jetstream.KeyValueConfig{
		Bucket:      cmp.Or(s.Bucket, DefaultBucket),
		Description: "dispenser segment store",
		Replicas:    cmp.Or(s.Replicas, 1),
		Storage:     s.Storage,
	}
	kv, err := kvbucket.Open(ctx, js, cfg)
	if err != nil {
		return nil, fmt.Errorf("kv: %w", err)
	}
	return &Store{kv: kv, last: map[string]entry{}}, nil
}

// Ping checks that the bucket answers.
func (s *Store) Ping(ctx context.Context) error {
	if _, err := s.kv.Status(ctx); err != nil {
		return fmt.Errorf("kv: ping: %w", err)
	}
	return nil
}

// value is the JSON value of a tag's key.
type value struct {
	MaxID       int64     `json:"max_id"`
	Step        int64     `json:"step"`
	Description string    `json:"description"`
	Ordered     bool      `json:"ordered,omitempty"` // absent: a plain tag
	UpdateTime  time.Time `json:"update_time"`       // RFC 3339 with nanoseconds
}

// errNoChange makes modify return without writing.
var errNoChange = errors.New("no change")

// read returns the tag's value and revision; an unknown or deleted tag
// yields segment.ErrUnknownTag.
func (s *Store) read(ctx context.Context, tag string) (value, uint64, error) {
	e, err := s.kv.Get(ctx, tag)
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return value{}, 0, segment.ErrUnknownTag
	}
	if err != nil {
		return value{}, 0, err
	}
	var v value
	if err := json.Unmarshal(e.Value(), &v); err != nil {
		return value{}, 0, fmt.Errorf("malformed value at revision %d: %w", e.Revision(), err)
	}
	return v, e.Revision(), nil
}

// modify reads the tag, lets change alter the value and writes it back if
// the key has not changed since the read, else starts over after a short
// random pause. change may run several times; errNoChange from it ends
// modify with errNoChange and writes nothing.
func (s *Store) modify(ctx context.Context, tag string, change func(*value) error) error {
	s.mu.Lock()
	e, cached := s.last[tag]
	s.mu.Unlock()
	for attempt := 0; ; attempt++ {
		v, rev := e.v, e.rev
		if !cached {
			var err error
			if v, rev, err = s.read(ctx, tag); err != nil {
				s.forget(tag)
				return err
			}
		}
		if err := change(&v); err != nil {
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
		newRev, err := s.kv.Update(ctx, tag, b, rev)
		if err == nil {
			s.mu.Lock()
			s.last[tag] = entry{v, newRev}
			s.mu.Unlock()
			return nil
		}
		s.forget(tag)
		if !conflict(err) {
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

// forget drops the remembered value of tag.
func (s *Store) forget(tag string) {
	s.mu.Lock()
	delete(s.last, tag)
	s.mu.Unlock()
}

// conflict reports whether err says that a key's revision was not the
// expected one: 10071, or 10164 from a replicated bucket.
func conflict(err error) bool {
	var apiErr *jetstream.APIError
	return errors.Is(err, jetstream.ErrKeyRevisionMismatch) || errors.Is(err, jetstream.ErrKeyExists) ||
		errors.As(err, &apiErr) && (apiErr.ErrorCode == jetstream.JSErrCodeStreamWrongLastSequence ||
			apiErr.ErrorCode == jetstream.JSErrCodeStreamWrongLastSequenceConstant)
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
// step <= 0) and returns the IDs in between. Errors: segment.ErrInvalidTag,
// segment.ErrInvalidStep (step above segment.MaxStepLimit, or the stored
// step is not positive), segment.ErrUnknownTag, segment.ErrExhausted.
func (s *Store) Fetch(ctx context.Context, tag string, step int64) (segment.Allocation, error) {
	if err := segment.CheckTag(tag); err != nil {
		return segment.Allocation{}, fmt.Errorf("kv: fetch: %w", err)
	}
	if step > segment.MaxStepLimit {
		return segment.Allocation{}, fmt.Errorf("kv: fetch %q: %w %d: want at most %d", tag, segment.ErrInvalidStep, step, segment.MaxStepLimit)
	}
	var a segment.Allocation
	err := s.modify(ctx, tag, func(v *value) error {
		n := step
		if n <= 0 {
			n = v.Step
		}
		if n <= 0 {
			return fmt.Errorf("%w: the tag's stored step %d is not positive", segment.ErrInvalidStep, v.Step)
		}
		if v.MaxID > math.MaxInt64-n {
			return fmt.Errorf("%w: max_id would overflow int64", segment.ErrExhausted)
		}
		a = segment.Allocation{Start: v.MaxID, End: v.MaxID + n, TagStep: v.Step}
		v.MaxID = a.End
		return nil
	})
	if err != nil {
		return segment.Allocation{}, fmt.Errorf("kv: fetch %q: %w", tag, err)
	}
	return a, nil
}

// GiveBack sets the tag's max_id back to firstUnissued if it is still end,
// that is if nobody fetched since the fetch that ended at end, and reports
// whether it did. An unknown tag reports false. firstUnissued must be in
// 1..end (segment.ErrInvalidArgument).
func (s *Store) GiveBack(ctx context.Context, tag string, end, firstUnissued int64) (bool, error) {
	if err := segment.CheckTag(tag); err != nil {
		return false, fmt.Errorf("kv: give back: %w", err)
	}
	if err := segment.CheckGiveBack(end, firstUnissued); err != nil {
		return false, fmt.Errorf("kv: give back %q: %w", tag, err)
	}
	err := s.modify(ctx, tag, func(v *value) error {
		if v.MaxID != end {
			return errNoChange
		}
		v.MaxID = firstUnissued
		return nil
	})
	switch {
	case errors.Is(err, errNoChange), errors.Is(err, segment.ErrUnknownTag):
		return false, nil
	case err != nil:
		return false, fmt.Errorf("kv: give back %q: %w", tag, err)
	}
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
			case segment.ValidTag(e.Key()):
				names = append(names, e.Key())
			}
		case <-ctx.Done():
			return nil, fmt.Errorf("kv: list tags: %w", ctx.Err())
		}
	}
}

// Tag looks up one tag. Errors: segment.ErrInvalidTag,
// segment.ErrUnknownTag.
func (s *Store) Tag(ctx context.Context, name string) (segment.Tag, error) {
	if err := segment.CheckTag(name); err != nil {
		return segment.Tag{}, fmt.Errorf("kv: tag: %w", err)
	}
	v, _, err := s.read(ctx, name)
	if err != nil {
		return segment.Tag{}, fmt.Errorf("kv: tag %q: %w", name, err)
	}
	return segment.Tag{Name: name, MaxID: v.MaxID, Step: v.Step, Description: v.Description, Ordered: v.Ordered, UpdateTime: v.UpdateTime}, nil
}

// CreateTag adds the tag t with step t.Step, first ID t.MaxID, t.Description
// and t.Ordered. A deleted tag may be created again; it then starts over at
// its new first ID. Errors: segment.ErrInvalidTag, segment.ErrInvalidStep
// (step not in 1..segment.MaxStepLimit), segment.ErrInvalidArgument (first
// ID < 1, description over segment.MaxDescription characters or not UTF-8
// without NUL), segment.ErrTagExists (nothing changes).
func (s *Store) CreateTag(ctx context.Context, t segment.Tag) error {
	if err := segment.CheckTagFields(t.Name, &t.Step, &t.Description); err != nil {
		return fmt.Errorf("kv: create tag: %w", err)
	}
	if err := segment.CheckStart(t.MaxID); err != nil {
		return fmt.Errorf("kv: create tag %q: %w", t.Name, err)
	}
	b, err := json.Marshal(value{MaxID: t.MaxID, Step: t.Step, Description: t.Description, Ordered: t.Ordered, UpdateTime: time.Now().UTC()})
	if err != nil {
		return fmt.Errorf("kv: create tag %q: %w", t.Name, err)
	}
	_, err = s.kv.Create(ctx, t.Name, b)
	if conflict(err) {
		return fmt.Errorf("kv: create tag %q: %w", t.Name, segment.ErrTagExists)
	}
	if err != nil {
		return fmt.Errorf("kv: create tag %q: %w", t.Name, err)
	}
	return nil
}

// UpdateTag sets the tag's step, description and/or ordered flag, those of
// u that are not nil, in one compare-and-swap. It does not move max_id.
// Errors: as for CreateTag, and segment.ErrUnknownTag.
func (s *Store) UpdateTag(ctx context.Context, name string, u segment.TagUpdate) error {
	if err := segment.CheckTagFields(name, u.Step, u.Description); err != nil {
		return fmt.Errorf("kv: update tag: %w", err)
	}
	err := s.modify(ctx, name, func(v *value) error {
		if u.Step != nil {
			v.Step = *u.Step
		}
		if u.Description != nil {
			v.Description = *u.Description
		}
		if u.Ordered != nil {
			v.Ordered = *u.Ordered
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("kv: update tag %q: %w", name, err)
	}
	return nil
}

// DeleteTag removes a tag: it is no longer listed or served. Creating it
// again starts it over, so IDs it handed out may be handed out again.
// Errors: segment.ErrInvalidTag, segment.ErrUnknownTag.
func (s *Store) DeleteTag(ctx context.Context, name string) error {
	if err := segment.CheckTag(name); err != nil {
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
func (s *Store) Changes(ctx context.Context, cursor int64) ([]segment.TagChange, int64, error) {
	st, err := s.kv.Status(ctx)
	if err != nil {
		return nil, 0, fmt.Errorf("kv: changes: %w", err)
	}
	bs, ok := st.(*jetstream.KeyValueBucketStatus)
	if !ok {
		return nil, 0, fmt.Errorf("kv: changes: status of type %T", st)
	}
	last := int64(bs.StreamInfo().State.LastSeq)
	if cursor <= 0 || cursor >= last {
		return nil, last, nil
	}
	w, err := s.kv.WatchAll(ctx, jetstream.IncludeHistory(), jetstream.ResumeFromRevision(uint64(cursor)+1))
	if err != nil {
		return nil, 0, fmt.Errorf("kv: changes: %w", err)
	}
	defer w.Stop()
	var out []segment.TagChange
	for {
		select {
		case e, ok := <-w.Updates():
			if !ok {
				return nil, 0, fmt.Errorf("kv: changes: watcher stopped: %w", cmp.Or(ctx.Err(), errors.New("subscription closed")))
			}
			if e == nil {
				return out, last, nil
			}
			if !segment.ValidTag(e.Key()) {
				continue
			}
			c := segment.TagChange{Tag: segment.Tag{Name: e.Key()}}
			var v value
			switch {
			case e.Operation() != jetstream.KeyValuePut:
				c.Deleted = true
			case json.Unmarshal(e.Value(), &v) == nil:
				c.Tag = segment.Tag{Name: e.Key(), MaxID: v.MaxID, Step: v.Step, Description: v.Description, Ordered: v.Ordered, UpdateTime: v.UpdateTime}
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
