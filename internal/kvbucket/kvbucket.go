// Package kvbucket checks that a JetStream key-value bucket keeps every
// value it acknowledged until a client overwrites or deletes it.
//
// dispenser's buckets hold the only record of what was handed out: a
// tag's max_id in the segment store, a worker ID's timestamp bound in the
// snowflake lease bucket. A bucket that lets the server drop a value on its
// own (a TTL, limits that discard old messages, a retention policy other
// than limits, per-message TTLs, memory storage) would make a worker start
// over below IDs already issued. Check refuses such a bucket at start-up
// with an error that says what to change; it never only warns.
//
// What Check does not see: a mirror or sourced bucket is judged by its own
// configuration, not its origin's. Nothing here can stop an operator from
// deleting keys, purging or deleting the bucket, or changing its
// configuration later; a Guard (NewGuard) notices the purge, the re-creation
// and the change while workers run, and the packages that use a bucket deal
// with delete markers themselves.
package kvbucket

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Errors returned by Check and CheckConfig, wrapped with %w and the bucket's
// name, the offending setting and what to change; test with errors.Is.
var (
	// ErrTTL means the server expires values: the bucket has a TTL (the
	// stream's max age) or allows per-message TTLs.
	ErrTTL = errors.New("kvbucket: bucket expires values")

	// ErrLimits means the server may drop the latest value of a key on its
	// own: a message or byte limit with the discard-old policy, or a
	// retention policy other than limits. A limit with the discard-new
	// policy (the default for key-value buckets) only makes writes fail, and
	// a per-key history limit only drops older revisions; both are accepted.
	ErrLimits = errors.New("kvbucket: bucket limits drop values")

	// ErrMemoryStorage means the bucket keeps its values in memory only, so
	// a restart of the NATS server forgets them; refused unless
	// Requirements.AllowMemory is set.
	ErrMemoryStorage = errors.New("kvbucket: bucket keeps values in memory only")

	// ErrReplicas means the bucket has fewer replicas than the
	// configuration asks for (Requirements.MinReplicas). More replicas than
	// asked for are accepted.
	ErrReplicas = errors.New("kvbucket: bucket has fewer replicas than configured")

	// ErrNotReady means JetStream stayed not ready (Transient) for as long
	// as a start-up step waits for it (WaitReady, StartWait); the error
	// says what was waited for, for how long, and the last error.
	ErrNotReady = errors.New("kvbucket: JetStream not ready")
)

// Requirements are what Check asks of a bucket besides keeping its values.
// The zero value asks for file storage and any number of replicas.
type Requirements struct {
	// MinReplicas refuses a bucket with fewer replicas (ErrReplicas). Zero
	// or one accepts any bucket.
	MinReplicas int
	// AllowMemory accepts memory storage (for buckets the caller itself
	// asked to keep in memory, e.g. in tests).
	AllowMemory bool
}

// Check reads the configuration of the stream under kv and returns
// CheckConfig's verdict, or the error of reading it.
func Check(ctx context.Context, kv jetstream.KeyValue, r Requirements) error {
	info, err := StreamInfo(ctx, kv)
	if err != nil {
		return err
	}
	return CheckConfig(kv.Bucket(), info.Config, r)
}

// CheckConfig checks the configuration cfg of the stream behind bucket and
// returns nil, or an error wrapping ErrTTL, ErrLimits, ErrMemoryStorage or
// ErrReplicas (the first that applies) that says what to change.
func CheckConfig(bucket string, cfg jetstream.StreamConfig, r Requirements) error {
	stream := cfg.Name
	if stream == "" {
		stream = "KV_" + bucket
	}
	switch {
	case cfg.MaxAge > 0:
		return fmt.Errorf("%w: bucket %q has a TTL (max age) of %v, after which the server drops values; "+
			"remove it (nats stream edit %s --max-age 0) or use a bucket created without --ttl",
			ErrTTL, bucket, cfg.MaxAge, stream)
	case cfg.AllowMsgTTL:
		return fmt.Errorf("%w: bucket %q allows per-message TTLs (limit markers), with which values and delete markers expire; "+
			"use a bucket created without --marker-ttl", ErrTTL, bucket)
	case cfg.Retention != jetstream.LimitsPolicy:
		return fmt.Errorf("%w: bucket %q has retention policy %v, which removes values; "+
			"use a key-value bucket with the limits policy", ErrLimits, bucket, cfg.Retention)
	case cfg.Discard == jetstream.DiscardOld && (cfg.MaxMsgs > 0 || cfg.MaxBytes > 0):
		return fmt.Errorf("%w: bucket %q discards old values once it holds %s; "+
			"remove the limit (nats stream edit %s --max-msgs -1 --max-bytes -1) or set --discard new",
			ErrLimits, bucket, limits(cfg), stream)
	case cfg.Storage == jetstream.MemoryStorage && !r.AllowMemory:
		return fmt.Errorf("%w: bucket %q is kept in memory, so a restart of the NATS server forgets it; "+
			"use a bucket with file storage", ErrMemoryStorage, bucket)
	case cfg.Replicas < r.MinReplicas:
		return fmt.Errorf("%w: bucket %q has %d replicas, configured %d; "+
			"raise them (nats stream edit %s --replicas %d) or configure %d",
			ErrReplicas, bucket, max(cfg.Replicas, 1), r.MinReplicas, stream, r.MinReplicas, max(cfg.Replicas, 1))
	}
	return nil
}

// limits describes the message and byte limits of cfg.
func limits(cfg jetstream.StreamConfig) string {
	switch {
	case cfg.MaxMsgs > 0 && cfg.MaxBytes > 0:
		return fmt.Sprintf("%d messages or %d bytes", cfg.MaxMsgs, cfg.MaxBytes)
	case cfg.MaxMsgs > 0:
		return fmt.Sprintf("%d messages", cfg.MaxMsgs)
	default:
		return fmt.Sprintf("%d bytes", cfg.MaxBytes)
	}
}

// Placement places a new bucket in cluster (JetStream placement), or
// leaves it to JetStream if cluster is empty.
func Placement(cluster string) *jetstream.Placement {
	if cluster == "" {
		return nil
	}
	return &jetstream.Placement{Cluster: cluster}
}

// Open opens the bucket cfg.Bucket, creating it with cfg if it does not
// exist, and refuses it (Check) unless it keeps every value; the
// requirements are cfg's replicas, and memory storage only if cfg asks for
// it. An existing bucket is used as it is if it passes: CreateKeyValue never
// changes a bucket of another configuration, and the checks, not the
// server's objections to cfg, judge it.
//
// A JetStream that is not ready yet (Transient: a meta leader being
// elected, a peer offline so that a replicated bucket cannot be placed) is
// waited for, logged to logger (nil: slog.Default), for at most StartWait
// (WaitReady); other errors, Check's among them, are returned at once.
func Open(ctx context.Context, js jetstream.JetStream, cfg jetstream.KeyValueConfig, logger *slog.Logger) (jetstream.KeyValue, error) {
	var kv jetstream.KeyValue
	err := WaitReady(ctx, js.Conn(), logger, fmt.Sprintf("bucket %q: open", cfg.Bucket), func() (err error) {
		kv, err = open(ctx, js, cfg)
		return err
	})
	return kv, err
}

// open is one attempt of Open.
func open(ctx context.Context, js jetstream.JetStream, cfg jetstream.KeyValueConfig) (jetstream.KeyValue, error) {
	kv, err := js.KeyValue(ctx, cfg.Bucket)
	if errors.Is(err, jetstream.ErrBucketNotFound) {
		kv, err = js.CreateKeyValue(ctx, cfg)
		if errors.Is(err, jetstream.ErrBucketExists) {
			kv, err = js.KeyValue(ctx, cfg.Bucket)
		}
	}
	if err != nil {
		return nil, fmt.Errorf("kvbucket: open bucket %q: %w", cfg.Bucket, err)
	}
	if err := Check(ctx, kv, requirements(cfg)); err != nil {
		return nil, err
	}
	return kv, nil
}

// OpenGuarded is Open followed by NewGuard on the bucket, with the same
// requirements; what and logger are NewGuard's. NewGuard, too, waits out
// a JetStream that is not ready yet (WaitReady): run again, it finds the
// proof record an attempt that got no reply may have stored, as a second
// worker starting at the same time would.
func OpenGuarded(ctx context.Context, js jetstream.JetStream, cfg jetstream.KeyValueConfig, what string, logger *slog.Logger) (jetstream.KeyValue, *Guard, error) {
	kv, err := Open(ctx, js, cfg, logger)
	if err != nil {
		return nil, nil, err
	}
	var g *Guard
	err = WaitReady(ctx, js.Conn(), logger, fmt.Sprintf("bucket %q: check", cfg.Bucket), func() (err error) {
		g, err = NewGuard(ctx, kv, requirements(cfg), what, logger)
		return err
	})
	if err != nil {
		return nil, nil, err
	}
	return kv, g, nil
}

// requirements are what Open asks of a bucket opened with cfg.
func requirements(cfg jetstream.KeyValueConfig) Requirements {
	return Requirements{MinReplicas: cfg.Replicas, AllowMemory: cfg.Storage == jetstream.MemoryStorage}
}

// Latest returns the latest message under key, a delete or purge marker
// included (KeyValue.Get hides them), or nil if the key has none.
//
// A value is read with KeyValue.Get first (a direct get, which any replica
// answers, without JetStream's meta group); a replica that is behind may
// return an older value, so callers decide only by compare-and-swap on its
// revision, as they must anyway. Only when Get finds no value (a new key,
// or a delete or purge marker, which Get hides) is the key's history read,
// through an ephemeral consumer; creating one needs the meta leader and
// fails while a partition leaves the cluster without one, which is why it
// is not the first choice. A history read that gets no reply (a new
// replicated bucket, an election) is tried again, latestAttempts times in
// all.
func Latest(ctx context.Context, kv jetstream.KeyValue, key string) (jetstream.KeyValueEntry, error) {
	if e, err := kv.Get(ctx, key); err == nil && e.Operation() == jetstream.KeyValuePut {
		return e, nil
	}
	for attempt := 1; ; attempt++ {
		es, err := kv.History(ctx, key)
		switch {
		case errors.Is(err, jetstream.ErrKeyNotFound):
			return nil, nil
		case err == nil:
			return es[len(es)-1], nil
		case !NoReply(err) || ctx.Err() != nil || attempt == latestAttempts:
			return nil, err
		}
	}
}

// latestAttempts bounds Latest's reads.
const latestAttempts = 3

// MarkerVerb names what made a key's delete or purge marker, for messages
// that tell an operator what was done: "purged" or "deleted".
func MarkerVerb(op jetstream.KeyValueOp) string {
	if op == jetstream.KeyValuePurge {
		return "purged"
	}
	return "deleted"
}

// Conflict reports whether err is a lost compare-and-swap: the key's
// revision was not the one expected (an Update or Create that found another
// revision: 10071, or 10164 from a replicated bucket).
func Conflict(err error) bool {
	var apiErr *jetstream.APIError
	return errors.Is(err, jetstream.ErrKeyRevisionMismatch) || errors.Is(err, jetstream.ErrKeyExists) ||
		errors.As(err, &apiErr) && (apiErr.ErrorCode == jetstream.JSErrCodeStreamWrongLastSequence ||
			apiErr.ErrorCode == jetstream.JSErrCodeStreamWrongLastSequenceConstant)
}

// NoReply reports whether err says a request got no reply (a timeout, no
// responders): it may have landed or not. While JetStream elects a new
// stream leader, requests sent to the old one get no reply at all.
func NoReply(err error) bool {
	return errors.Is(err, context.DeadlineExceeded) || errors.Is(err, nats.ErrTimeout) ||
		errors.Is(err, nats.ErrNoResponders) || errors.Is(err, jetstream.ErrNoStreamResponse)
}

// WriteAttempt bounds one write request of a fetch (a compare-and-swap of
// a tag's max_id or witness mark): a request that got no reply within it
// is given up and the write tried again on a fresh read, until the
// fetch's context ends. So a fetch completes within WriteAttempt of a
// leader election's end, not at its timeout.
const WriteAttempt = 500 * time.Millisecond

// StreamInfo reads the information of the stream under kv (one request):
// its configuration, state and creation time. The error is the server's
// (test errors.Is(err, jetstream.ErrStreamNotFound) and ErrBucketNotFound
// for a deleted bucket), wrapped with the bucket's name.
func StreamInfo(ctx context.Context, kv jetstream.KeyValue) (*jetstream.StreamInfo, error) {
	st, err := kv.Status(ctx)
	if err != nil {
		return nil, fmt.Errorf("kvbucket: bucket %q: read stream: %w", kv.Bucket(), err)
	}
	bs, ok := st.(*jetstream.KeyValueBucketStatus)
	if !ok || bs.StreamInfo() == nil {
		return nil, fmt.Errorf("kvbucket: bucket %q: status of type %T carries no stream information", kv.Bucket(), st)
	}
	return bs.StreamInfo(), nil
}

// StreamCreated returns the creation time of the stream under kv: a bucket
// deleted and created again has a stream created later, and its revisions
// started over.
func StreamCreated(ctx context.Context, kv jetstream.KeyValue) (time.Time, error) {
	info, err := StreamInfo(ctx, kv)
	if err != nil {
		return time.Time{}, err
	}
	return info.Created, nil
}

// Last is the latest message under a key as the stream leader holds it.
type Last struct {
	Value    []byte
	Revision uint64
	Op       jetstream.KeyValueOp
}

// LeaderLast reads the latest message under key of bucket from the
// bucket's stream leader, or nil if the key has none. KeyValue.Get may be
// answered by any replica (a direct get), also one that is behind or
// catching up after a partition, and so say "not found" for a key that
// exists: only the leader's answer decides that a key is missing.
func LeaderLast(ctx context.Context, js jetstream.JetStream, bucket, key string) (*Last, error) {
	o := js.Options()
	prefix := jetstream.DefaultAPIPrefix
	switch {
	case o.APIPrefix != "":
		prefix = strings.TrimSuffix(o.APIPrefix, ".") + "."
	case o.Domain != "":
		prefix = "$JS." + o.Domain + ".API."
	}
	req, err := json.Marshal(map[string]string{"last_by_subj": "$KV." + bucket + "." + key})
	if err != nil {
		return nil, err
	}
	msg, err := js.Conn().RequestWithContext(ctx, prefix+"STREAM.MSG.GET.KV_"+bucket, req)
	if err != nil {
		return nil, fmt.Errorf("reading %q of bucket %q from its leader: %w", key, bucket, err)
	}
	var resp struct {
		Error *jetstream.APIError `json:"error"`
		Msg   *struct {
			Seq  uint64 `json:"seq"`
			Hdrs []byte `json:"hdrs"`
			Data []byte `json:"data"`
		} `json:"message"`
	}
	if err := json.Unmarshal(msg.Data, &resp); err != nil {
		return nil, fmt.Errorf("reading %q of bucket %q from its leader: %w", key, bucket, err)
	}
	if resp.Error != nil {
		if resp.Error.ErrorCode == jetstream.JSErrCodeMessageNotFound {
			return nil, nil
		}
		return nil, fmt.Errorf("reading %q of bucket %q from its leader: %w", key, bucket, resp.Error)
	}
	if resp.Msg == nil {
		return nil, fmt.Errorf("reading %q of bucket %q from its leader: an empty answer", key, bucket)
	}
	l := &Last{Value: resp.Msg.Data, Revision: resp.Msg.Seq, Op: jetstream.KeyValuePut}
	switch {
	case bytes.Contains(resp.Msg.Hdrs, []byte("KV-Operation: DEL")):
		l.Op = jetstream.KeyValueDelete
	case bytes.Contains(resp.Msg.Hdrs, []byte("KV-Operation: PURGE")):
		l.Op = jetstream.KeyValuePurge
	}
	return l, nil
}
