package kv

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/dispenser-dev/dispenser/internal/kvbucket"
	"github.com/dispenser-dev/dispenser/tagmodel"
	"github.com/nats-io/nats.go/jetstream"
)

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
	base := s.guard.Seen()
	rev, err := s.kv.Update(ctx, t.Name, b, 0)
	if kvbucket.Conflict(err) {
		return s.createConflict(ctx, t.Name)
	}
	if err != nil {
		return fmt.Errorf("kv: create tag %q: %w", t.Name, err)
	}
	if err := s.guard.CheckWrite(ctx, base, rev); err != nil {
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
