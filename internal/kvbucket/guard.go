package kvbucket

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// ProofKey is the key of a guarded bucket's proof record: written once,
// before anything else, into a bucket that has never held a value, it proves
// from then on that the bucket is the one the workers have been writing to.
// It holds a dot, so it is never a tag (a tag is one NATS subject token).
const ProofKey = "dispenser.bucket"

// Errors of a Guard, wrapped with %w, the bucket's name, what the operator
// did and how to recover; test with errors.Is.
var (
	// ErrRecreated means the bucket's stream is not the one the Guard
	// opened (it was deleted and created again, or restored from a
	// backup): its revisions started over, so no compare-and-swap on a
	// revision read before can be trusted, and its values may be older
	// than what was handed out.
	ErrRecreated = errors.New("kvbucket: bucket was deleted and created again")
	// ErrPurged means the bucket has held values but its proof record is
	// gone: it was purged (nats stream purge), its values expired, or the
	// record was deleted by hand. A key missing from it no longer means
	// "never written".
	ErrPurged = errors.New("kvbucket: bucket lost its values")
)

// proofRecord is the JSON value under ProofKey.
type proofRecord struct {
	Version int `json:"version"`
	// Stream is the creation time of the stream the record was first
	// written to; a record found in a stream created at another time was
	// copied or restored there.
	Stream time.Time `json:"stream_created"`
}

// Guard watches one bucket for the operator mistakes that make it forget
// what it held while workers run: a configuration that drops values (Check,
// re-read on every call, so a TTL added after start-up is seen), a purge, and
// a delete and re-create of the bucket. It is safe for concurrent use.
type Guard struct {
	kv      jetstream.KeyValue
	req     Requirements
	created time.Time // the stream's creation time when the Guard was made
	what    string    // what the bucket holds, for messages
	log     *slog.Logger

	// seen is the highest sequence of the stream known to exist: its
	// last sequence at every read of the stream, and the revision of
	// every write checked (CheckWrite).
	seen atomic.Uint64

	mu sync.Mutex // protects failing and rewound
	// rewound is the error of the first write that landed at or below a
	// sequence seen before it was sent (CheckWrite), nil until then; from
	// then on every check fails with it.
	rewound error
	// failing holds, per part checked (partStream: the stream and its
	// configuration; partProof: the proof record), the message of the
	// last failed check, "" if the last check passed: a failure is logged
	// when it first appears, not on every call.
	failing [2]string
}

// NewGuard checks the bucket under kv (CheckConfig with r), remembers its
// stream's creation time and makes sure it holds the proof record: it
// stores one in a bucket that has never held a value or that holds values
// written before proof records existed (live keys other than ProofKey), and
// refuses (ErrPurged) a bucket that has held values but holds neither, and
// a record deleted or purged by hand or copied from another stream
// (ErrRecreated). what says what the bucket holds ("segment store"),
// logger receives the failures of later checks.
func NewGuard(ctx context.Context, kv jetstream.KeyValue, r Requirements, what string, logger *slog.Logger) (*Guard, error) {
	if logger == nil {
		logger = slog.Default()
	}
	g := &Guard{kv: kv, req: r, what: what, log: logger}
	for attempt := 1; ; attempt++ {
		info, err := StreamInfo(ctx, g.kv)
		if err != nil {
			return nil, err
		}
		if err := CheckConfig(kv.Bucket(), info.Config, r); err != nil {
			return nil, err
		}
		g.created = info.Created
		g.raise(info.State.LastSeq)
		// The stream's last sequence is read before the key: a worker
		// stores the record before it writes anything else, so if the
		// bucket had held a value by now, the record would be found.
		e, err := Latest(ctx, kv, ProofKey)
		if err != nil {
			return nil, fmt.Errorf("kvbucket: bucket %q: read %s: %w", kv.Bucket(), ProofKey, err)
		}
		if e != nil {
			return g, g.checkProof(e)
		}
		if info.State.LastSeq > 0 {
			live, err := hasKeys(ctx, kv)
			if err != nil {
				return nil, err
			}
			if !live {
				return nil, g.purged(info.State.LastSeq)
			}
			// A bucket written before proof records existed.
			logger.Info("kvbucket: adding a proof record to a bucket that holds values", "bucket", kv.Bucket(), "key", ProofKey)
		}
		data, err := json.Marshal(proofRecord{Version: 1, Stream: info.Created})
		if err != nil {
			return nil, err
		}
		// Update on revision 0 fails if the key has any message, a
		// delete marker included (Create would write over one).
		_, err = kv.Update(ctx, ProofKey, data, 0)
		switch {
		case err == nil:
			return g, nil
		case attempt < 3 && Conflict(err):
			continue // another worker stored it first: check it
		}
		return nil, fmt.Errorf("kvbucket: bucket %q: store %s: %w", kv.Bucket(), ProofKey, err)
	}
}

// Created returns the creation time of the bucket's stream when the Guard
// was made.
func (g *Guard) Created() time.Time { return g.created }

// Check re-reads the bucket's stream (one request) and returns nil if it is
// still the stream the Guard was made on and its configuration still keeps
// every value (CheckConfig); otherwise ErrRecreated, or CheckConfig's
// error. A failure is logged when it first appears.
func (g *Guard) Check(ctx context.Context) error {
	info, err := StreamInfo(ctx, g.kv)
	if err != nil {
		return err // unreachable, not wrong: not logged here
	}
	return g.verdict(partStream, g.checkInfo(info))
}

// CheckHeld is Check, and also checks that the proof record is in place
// (one more request): call it before taking a missing key for one that was
// never written.
func (g *Guard) CheckHeld(ctx context.Context) error {
	info, err := StreamInfo(ctx, g.kv)
	if err != nil {
		return err
	}
	if err := g.verdict(partStream, g.checkInfo(info)); err != nil {
		return err
	}
	e, err := Latest(ctx, g.kv, ProofKey)
	if err != nil {
		return fmt.Errorf("kvbucket: bucket %q: read %s: %w", g.kv.Bucket(), ProofKey, err)
	}
	if e == nil {
		return g.verdict(partProof, g.purged(info.State.LastSeq))
	}
	return g.verdict(partProof, g.checkProof(e))
}

// Seen returns the highest sequence of the stream known to exist: take it
// before sending a write, for CheckWrite.
func (g *Guard) Seen() uint64 { return g.seen.Load() }

// CheckWrite is Check after a write that was sent when Seen returned base
// and landed at revision rev. A stream's sequences only grow, so a write
// that lands at or below a sequence the stream held before it was sent
// went to a stream that went back: its server's store restored from an
// older backup (a volume or VM snapshot), or nats stream restore of a
// backup in a format that keeps the stream's creation time (nats-server
// 2.15.2 keeps it for its first snapshot format, not for the backups it
// takes itself). Such a stream passes Check (its creation time and proof record are
// the backup's), but its values may be older than what was handed out and
// a compare-and-swap on a key read from it succeeds. From the first such
// write on, the Guard fails every check with ErrRecreated.
//
// Why base and not Seen at the check: another write of this process may
// land after this one was sent and be seen first; only what was seen
// before the write was sent lies below it.
//
// It sees only a rewind below what this process saw: a worker started
// after the restore, or one that saw none of the sequences lost, cannot
// tell (docs/reliability.md).
func (g *Guard) CheckWrite(ctx context.Context, base, rev uint64) error {
	if rev <= base {
		err := fmt.Errorf("%w: a write to bucket %q (%s) landed at revision %d, but the stream held sequence %d before it "+
			"was sent: the stream went back, restored from a backup (of its server's disk, or nats stream restore of a backup "+
			"that keeps the creation time), and may hold values older than what was handed out. This worker stops using it: "+
			"stop every worker, put the bucket's values back above every ID handed out, then restart them",
			ErrRecreated, g.kv.Bucket(), g.what, rev, base)
		g.mu.Lock()
		if g.rewound == nil {
			g.rewound = err
		}
		g.mu.Unlock()
		return g.verdict(partStream, err)
	}
	g.raise(rev)
	return g.Check(ctx)
}

// raise raises seen to seq.
func (g *Guard) raise(seq uint64) {
	for {
		cur := g.seen.Load()
		if cur >= seq || g.seen.CompareAndSwap(cur, seq) {
			return
		}
	}
}

func (g *Guard) checkInfo(info *jetstream.StreamInfo) error {
	g.mu.Lock()
	rewound := g.rewound
	g.mu.Unlock()
	if rewound != nil {
		return rewound
	}
	if !info.Created.Equal(g.created) {
		return fmt.Errorf("%w: the stream of bucket %q (%s) was created at %s, but the one this worker opened at %s: "+
			"someone deleted the bucket (nats kv del / nats stream rm) and it was created again; its revisions started over "+
			"and what it held is gone. This worker stops using it: stop every worker, restore the bucket's values "+
			"above every ID handed out, then restart them",
			ErrRecreated, g.kv.Bucket(), g.what, info.Created.UTC().Format(time.RFC3339Nano), g.created.UTC().Format(time.RFC3339Nano))
	}
	// A member of a group without a leader may answer with a last
	// sequence behind the leader's: raise only, never compare.
	g.raise(info.State.LastSeq)
	return CheckConfig(g.kv.Bucket(), info.Config, g.req)
}

// checkProof checks the proof record e.
func (g *Guard) checkProof(e jetstream.KeyValueEntry) error {
	if e.Operation() != jetstream.KeyValuePut {
		verb := MarkerVerb(e.Operation())
		return fmt.Errorf("%w: the proof record %q of bucket %q (%s) was %s by hand at %s, so a missing key can no longer "+
			"be told from a purged one; if the bucket still holds every value, put the record back: "+
			"nats kv put %s %s '{\"version\":1,\"stream_created\":\"%s\"}'",
			ErrPurged, ProofKey, g.kv.Bucket(), g.what, verb, e.Created().UTC().Format(time.RFC3339Nano),
			g.kv.Bucket(), ProofKey, g.created.UTC().Format(time.RFC3339Nano))
	}
	var p proofRecord
	if err := json.Unmarshal(e.Value(), &p); err != nil {
		return fmt.Errorf("%w: bucket %q: unreadable proof record %q: %v", ErrPurged, g.kv.Bucket(), e.Value(), err)
	}
	if !p.Stream.Equal(g.created) {
		return fmt.Errorf("%w: bucket %q (%s): its proof record was written in a stream created at %s, but the stream "+
			"was created at %s: the bucket was restored from a backup or copied, and may hold values older than what was "+
			"handed out; if you know its values are current, put the record back: "+
			"nats kv put %s %s '{\"version\":1,\"stream_created\":\"%s\"}'",
			ErrRecreated, g.kv.Bucket(), g.what, p.Stream.UTC().Format(time.RFC3339Nano), g.created.UTC().Format(time.RFC3339Nano),
			g.kv.Bucket(), ProofKey, g.created.UTC().Format(time.RFC3339Nano))
	}
	return nil
}

func (g *Guard) purged(lastSeq uint64) error {
	return fmt.Errorf("%w: bucket %q (%s) has held %d messages but has no proof record %q: it was purged "+
		"(nats stream purge KV_%s) or its values expired, and every key may be gone; nothing missing from it is "+
		"created again. Put back the values it held, above every ID handed out, then the record: "+
		"nats kv put %s %s '{\"version\":1,\"stream_created\":\"%s\"}'",
		ErrPurged, g.kv.Bucket(), g.what, lastSeq, ProofKey, g.kv.Bucket(),
		g.kv.Bucket(), ProofKey, g.created.UTC().Format(time.RFC3339Nano))
}

// Parts of a bucket that a Guard checks, for verdict.
const (
	partStream = iota // the stream and its configuration (Check)
	partProof         // the proof record (CheckHeld)
)

// verdict logs err when it is a new failure of part, and a recovery once
// the failure is gone, and returns err.
func (g *Guard) verdict(part int, err error) error {
	msg := ""
	if err != nil {
		msg = err.Error()
	}
	g.mu.Lock()
	changed := msg != g.failing[part]
	g.failing[part] = msg
	g.mu.Unlock()
	switch {
	case changed && err != nil:
		g.log.Error("kvbucket: refusing to use a bucket that lost or may lose its values", "bucket", g.kv.Bucket(), "holds", g.what, "err", err)
	case changed:
		g.log.Info("kvbucket: bucket passes its checks again", "bucket", g.kv.Bucket(), "holds", g.what)
	}
	return err
}

// hasKeys reports whether kv holds a live key.
func hasKeys(ctx context.Context, kv jetstream.KeyValue) (bool, error) {
	w, err := kv.WatchAll(ctx, jetstream.IgnoreDeletes(), jetstream.MetaOnly())
	if err != nil {
		return false, fmt.Errorf("kvbucket: bucket %q: list keys: %w", kv.Bucket(), err)
	}
	defer w.Stop()
	select {
	case e, ok := <-w.Updates():
		if !ok {
			return false, fmt.Errorf("kvbucket: bucket %q: list keys: watcher stopped", kv.Bucket())
		}
		return e != nil, nil
	case <-ctx.Done():
		return false, fmt.Errorf("kvbucket: bucket %q: list keys: %w", kv.Bucket(), ctx.Err())
	}
}
