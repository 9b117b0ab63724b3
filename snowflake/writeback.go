package snowflake

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/dispenser-dev/dispenser/internal/kvbucket"
	"github.com/nats-io/nats.go/jetstream"
)

// owedRecord is a write-back to make: rec (released, with the bound held)
// by compare-and-swap on rev, the revision of the marker found (0: the key
// had no message at all).
type owedRecord struct {
	rec  leaseRecord
	rev  uint64
	what string // what happened to the key, for logs
}

// owedLocked returns the write-back owed for our key, whose latest message
// is e (a delete or purge marker, or nil for none at all). The bound
// written is the last timestamp used, lastMs, read from the generator after
// it stopped issuing (revoke): the tight form of the bound we held, as on a
// graceful release, so that we may take the key back at once. Call with
// w.mu held.
func (w *Node) owedLocked(e jetstream.KeyValueEntry, lastMs int64) *owedRecord {
	o := &owedRecord{rec: w.rec, what: "removed without a marker (the bucket's stream was purged: nats stream purge)"}
	if e != nil {
		o.rev = e.Revision()
		cmd := "nats kv del"
		if e.Operation() == jetstream.KeyValuePurge {
			cmd = "nats kv purge"
		}
		o.what = fmt.Sprintf("%s (%s) at %s", kvbucket.MarkerVerb(e.Operation()), cmd, e.Created().UTC().Format(TimeLayout))
	}
	now := w.cfg.Now().UTC().Round(0)
	boundMs := max(lastMs, 0)
	o.rec.Heartbeat, o.rec.Expires = now, now
	o.rec.Bound = w.gen.msTime(boundMs)
	o.rec.Released = true
	return o
}

// writeBack makes the write-back owed, if any, and reports whether none is
// owed any more. The compare-and-swap on the marker's revision fails if
// anyone wrote the key since; then a successor holds it, which took it
// only a margin after the marker (deletedRecord), and there is nothing
// left to do.
func (w *Node) writeBack(ctx context.Context) bool {
	w.mu.Lock()
	o := w.owed
	w.mu.Unlock()
	if o == nil {
		return true
	}
	if err := w.checkBucket(ctx); err != nil {
		return errors.Is(err, ErrBucketDeleted)
	}
	key := workerKey(o.rec.Worker)
	data, err := json.Marshal(o.rec)
	if err != nil {
		w.log.Error("snowflake: encode lease", "error", err)
		return false
	}
	rev := o.rev
	for attempt := 1; ; attempt++ {
		_, err = w.kv.Update(ctx, key, data, rev)
		if attempt == 3 || !kvbucket.Conflict(err) {
			break
		}
		// The revision we found may have been a stale read, or the key
		// deleted again: only a value written since stops us.
		e, gerr := kvbucket.Latest(ctx, w.kv, key)
		if gerr != nil {
			err = gerr
			break
		}
		if e != nil && e.Operation() == jetstream.KeyValuePut {
			break
		}
		var next uint64
		if e != nil {
			next = e.Revision()
		}
		if next == rev {
			break
		}
		rev = next
	}
	switch {
	case err == nil:
		w.log.Warn("snowflake: wrote back a released lease over the deleted or purged key; a successor starts above its bound",
			"worker", o.rec.Worker, "bound", o.rec.Bound)
	case kvbucket.Conflict(err):
		w.log.Error("snowflake: could not write back the bound of a deleted or purged lease key: it was written since; "+
			"its new holder started above a floor derived from the deletion", "worker", o.rec.Worker, "bound", o.rec.Bound)
	default:
		w.log.Warn("snowflake: writing back the bound of a deleted or purged lease key failed; will retry",
			"worker", o.rec.Worker, "error", err)
		return false
	}
	w.mu.Lock()
	if w.owed == o {
		w.owed = nil
		if err == nil {
			w.writeBacks++
		}
	}
	w.mu.Unlock()
	return true
}
