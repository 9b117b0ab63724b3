package snowflake

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/dispenser-dev/dispenser/internal/kvbucket"
	"github.com/dispenser-dev/dispenser/lease"
	"github.com/nats-io/nats.go/jetstream"
)

// Keys in the lease bucket.
const (
	// configKey holds the bucket's epoch (configRecord).
	configKey = "config"
	// workerKeyPrefix + the worker ID in four digits holds its lease
	// (leaseRecord), e.g. "worker.0042".
	workerKeyPrefix = "worker."

	recordVersion = 1
)

// leaseRecord is the JSON value under a worker ID's key. Times are UTC.
//
//	{"version":1,"worker":42,"instance":"api-7f-x3k9qa","session":"...",
//	 "epoch":"2026-01-01T00:00:00Z","lease_ms":10000,
//	 "heartbeat":"2026-03-01T12:00:00.123Z","expires":"2026-03-01T12:00:10.123Z",
//	 "bound":"2026-03-01T12:00:10.123Z","released":false}
type leaseRecord struct {
	Version int `json:"version"`
	// Worker is the worker ID, the same as in the key.
	Worker int `json:"worker"`
	// Instance names the holder (NodeSettings.Instance).
	Instance string `json:"instance"`
	// Session is random per Node value: it tells a restarted instance
	// from its previous run and from a namesake.
	Session string `json:"session"`
	// Epoch is the holder's epoch.
	Epoch time.Time `json:"epoch"`
	// LeaseMS is the holder's lease in milliseconds.
	LeaseMS int64 `json:"lease_ms"`
	// Heartbeat is the holder's wall clock when it wrote the value.
	Heartbeat time.Time `json:"heartbeat"`
	// Expires is Heartbeat plus the lease: after it, by the claimant's
	// clock, the lease is dead.
	Expires time.Time `json:"expires"`
	// Bound is the highest ID timestamp the holder may use (before its next
	// heartbeat), at millisecond precision; on release, the highest it did
	// use. A successor starts above it.
	Bound time.Time `json:"bound"`
	// Released marks a gracefully released lease: a successor may take it
	// at once.
	Released bool `json:"released"`
}

// configRecord is the JSON value under configKey:
//
//	{"version":1,"epoch":"2026-01-01T00:00:00Z",
//	 "layout":{"name":"js","time_bits":41,"worker_bits":5,"sequence_bits":7},
//	 "max_lease_ms":10000,"max_lease_since":0}
type configRecord struct {
	Version int       `json:"version"`
	Epoch   time.Time `json:"epoch"`
	// Layout is the bit layout of every worker of the bucket, stored with
	// the epoch by the worker that first wrote the record. Nil (a bucket
	// written by a version without layouts) means DefaultLayout.
	Layout *layoutRecord `json:"layout,omitempty"`
	// MaxLeaseMS is the longest lease any worker of this version has
	// claimed with in this bucket: a worker raises it, by compare-and-swap,
	// before it claims with a longer lease, and nothing lowers it. A
	// deleted key's margin covers it, because the deleted value was the
	// only record of its holder's lease. Zero: not recorded yet (a bucket
	// written by older versions, or an epoch restored by hand).
	MaxLeaseMS int64 `json:"max_lease_ms,omitempty"`
	// MaxLeaseSince is the revision up to which MaxLeaseMS may miss
	// holders: when a worker first records MaxLeaseMS in a bucket that
	// has held values, it covers every lease value it read then, but not
	// the leases of keys already deleted; their markers have revisions at
	// or below MaxLeaseSince, and their holders' leases count as unknown
	// (UnknownLeaseMargin).
	MaxLeaseSince uint64 `json:"max_lease_since,omitempty"`
	// Region is the region of every worker of the bucket, recorded with
	// the layout when it has region bits; absent: region 0.
	Region int `json:"region,omitempty"`
	// Floor is the highest bound of the predecessor bucket
	// (NodeSettings.Predecessor) when this one was created: a never used
	// worker ID of this bucket starts above it. Absent: none.
	Floor time.Time `json:"floor,omitzero"`
}

func (c *configRecord) maxLease() time.Duration {
	return time.Duration(c.MaxLeaseMS) * time.Millisecond
}

func workerKey(id int) string { return fmt.Sprintf("%s%04d", workerKeyPrefix, id) }

// parseWorkerKey returns the worker ID of a worker key; keys of IDs above
// maxID (beyond the layout's worker bits) are not worker keys.
func parseWorkerKey(key string, maxID int) (int, bool) {
	s, ok := strings.CutPrefix(key, workerKeyPrefix)
	if !ok {
		return 0, false
	}
	id, err := strconv.Atoi(s)
	if err != nil || id < 0 || id > maxID {
		return 0, false
	}
	return id, true
}

// lease returns the recorded lease duration.
func (r *leaseRecord) lease() time.Duration { return time.Duration(r.LeaseMS) * time.Millisecond }

// terms are what the record says to a claimant: the holder may use
// timestamps up to its bound, so that is how long it may act.
func (r *leaseRecord) terms() lease.Terms {
	return lease.Terms{Lease: r.lease(), Expires: r.Expires, Until: r.Bound, Released: r.Released}
}

// claimableAt returns when, by a claimant's clock, the lease may be taken
// over: at once if released; else once it has expired and the clock is
// past the recorded bound plus the lease (lease.Terms.ClaimableAt).
func (r *leaseRecord) claimableAt() time.Time { return r.terms().ClaimableAt() }

// openBucket opens the lease bucket, or creates it if missing, and refuses
// one that can drop values (kvbucket.Check): a TTL, limits that discard old
// values, another retention policy, memory storage, fewer replicas than
// configured.
func openBucket(ctx context.Context, js jetstream.JetStream, s *NodeSettings) (jetstream.KeyValue, error) {
	kv, err := kvbucket.Open(ctx, js, jetstream.KeyValueConfig{
		Bucket:      s.Bucket,
		Description: "dispenser snowflake worker ID leases",
		History:     1,
		Replicas:    s.Replicas,
		Storage:     jetstream.FileStorage,
		Placement:   kvbucket.Placement(s.Cluster),
	}, s.Logger)
	if err != nil {
		return nil, fmt.Errorf("snowflake: lease bucket %q: %w", s.Bucket, err)
	}
	return kv, nil
}

// checkEpoch stores the epoch and the layout in a bucket that has never
// held a value, and otherwise compares them with the stored ones:
// ErrEpochMismatch if the epoch differs, ErrLayoutMismatch if the layout
// does (a record without one means DefaultLayout), ErrEpochLost if the key
// is deleted, purged, or missing from a bucket that has held values.
//
// In a bucket that has never held a value, the stored record also holds
// lease as the longest lease used (configRecord.MaxLeaseMS): no key can
// have been deleted before. If floor is not nil, it is called then, and
// its time recorded as the bucket's floor (configRecord.Floor).
func checkEpoch(ctx context.Context, kv jetstream.KeyValue, epoch time.Time, layout Layout, region int, lease time.Duration,
	floor func(context.Context) (time.Time, error)) error {
	rec := configRecord{Version: recordVersion, Epoch: epoch, Layout: newLayoutRecord(layout), MaxLeaseMS: lease.Milliseconds(), Region: region}
	restore := restoreCommand(kv.Bucket(), epoch, layout, region)
	behind := 0 // reads of the key that missed what the leader holds
	for attempt := 1; ; attempt++ {
		// The stream's last sequence is read before the key: a worker
		// stores the epoch before it writes anything else, so if the
		// bucket had held any value by now, the key would be found.
		info, err := kvbucket.StreamInfo(ctx, kv)
		if err != nil {
			return fmt.Errorf("snowflake: read epoch: %w", err)
		}
		lastSeq := info.State.LastSeq
		e, err := kvbucket.Latest(ctx, kv, configKey)
		if err != nil {
			return fmt.Errorf("snowflake: read epoch: %w", err)
		}
		switch {
		case e == nil && lastSeq == 0:
			if floor != nil {
				if rec.Floor, err = floor(ctx); err != nil {
					return err
				}
			}
			data, err := json.Marshal(rec)
			if err != nil {
				return err
			}
			// Update on revision 0 fails if the key has any message, a
			// delete marker included (Create would write over one).
			_, err = kv.Update(ctx, configKey, data, 0)
			if err == nil {
				return nil
			}
			if attempt < 3 && kvbucket.Conflict(err) {
				continue // another worker stored it first: compare
			}
			return fmt.Errorf("snowflake: store epoch: %w", err)
		case e == nil && behind < configPasses:
			// A key's direct get and history may be answered by a replica
			// of an R3 bucket that has not applied the epoch the first
			// worker just stored (as readBucket's snapshots may): the
			// stream's leader said it holds messages, so read again before
			// calling the epoch lost. A real loss stays missing.
			behind++
			if err := sleepCtx(ctx, time.Duration(behind)*10*time.Millisecond); err != nil {
				return fmt.Errorf("snowflake: read epoch: %w", err)
			}
			attempt--
			continue
		case e == nil:
			return fmt.Errorf("%w: bucket %q has no key %q although it has held %d messages: "+
				"the key or the whole bucket was purged, and lease bounds may have gone with it; "+
				"stop every worker of this bucket, wait a lease after the last one stopped, then restore the epoch "+
				"they used (for %s: %s)", ErrEpochLost, kv.Bucket(), configKey, lastSeq,
				epoch.Format(time.RFC3339Nano), restore)
		case e.Operation() != jetstream.KeyValuePut:
			return fmt.Errorf("%w: key %q of bucket %q was %s at %s; "+
				"restore the epoch the bucket's workers used (for %s: %s)", ErrEpochLost, configKey, kv.Bucket(),
				kvbucket.MarkerVerb(e.Operation()), e.Created().UTC().Format(TimeLayout), epoch.Format(time.RFC3339Nano), restore)
		}
		var c configRecord
		if err := json.Unmarshal(e.Value(), &c); err != nil {
			return fmt.Errorf("%w: bucket %q key %q: %v", ErrEpochMismatch, kv.Bucket(), configKey, err)
		}
		if !c.Epoch.Equal(epoch) {
			return fmt.Errorf("%w: bucket %q has %s, configured %s", ErrEpochMismatch, kv.Bucket(),
				c.Epoch.Format(time.RFC3339Nano), epoch.Format(time.RFC3339Nano))
		}
		return checkLayout(kv.Bucket(), &c, layout, region)
	}
}

// checkLayout compares the configured layout and region with those
// recorded in the bucket's config record c: ErrLayoutMismatch if the
// layouts differ (region bits included), ErrRegionMismatch if the regions
// do.
func checkLayout(bucket string, c *configRecord, layout Layout, region int) error {
	if got := c.Layout.layout(); !got.Same(layout) {
		return fmt.Errorf("%w: bucket %q was created for snowflake layout %s, configured %s; "+
			"a layout is chosen when its bucket is created and cannot be changed in place: "+
			"configure the bucket's layout, or give the new layout a new bucket (and a new epoch)",
			ErrLayoutMismatch, bucket, got, layout.orDefault())
	}
	if c.Region != region {
		return fmt.Errorf("%w: bucket %q holds the worker IDs of region %d, this worker is of region %d; "+
			"each region leases from a bucket of its own: check --region and --snowflake-bucket",
			ErrRegionMismatch, bucket, c.Region, region)
	}
	return nil
}

// restoreCommand is the command that puts the epoch (and the layout and
// region) back into bucket.
func restoreCommand(bucket string, epoch time.Time, layout Layout, region int) string {
	data, _ := json.Marshal(configRecord{Version: recordVersion, Epoch: epoch, Layout: newLayoutRecord(layout), Region: region})
	return fmt.Sprintf("nats kv put %s %s '%s'", bucket, configKey, data)
}

// DeletedKeyMargin is the least time added to the time a worker key was
// deleted or purged (its marker's server timestamp) to get the floor of
// its next holder; see deletedRecord and lease.DeletedMargin.
const DeletedKeyMargin = lease.DeletedKeyMargin

// UnknownLeaseMargin replaces the margin of a deleted key whose holder's
// lease may not be recorded: a key deleted before any worker of this
// version recorded the longest lease in the bucket (configRecord). It is
// far longer than any sensible lease; such keys are claimed last anyway.
const UnknownLeaseMargin = 24 * time.Hour

// deletedMargin returns the margin of a deleted key: lease.DeletedMargin of
// the longest lease known (the claimant's, every one recorded in the
// bucket's values, and the bucket's recorded maximum); UnknownLeaseMargin
// if the holder's lease may be unrecorded.
func deletedMargin(longest time.Duration, unknown bool) time.Duration {
	m := lease.DeletedMargin(longest)
	if unknown {
		m = max(m, UnknownLeaseMargin)
	}
	return m
}

// deletedRecord stands in for the lost value of worker key id, deleted or
// purged at the server time at, that its holder has not written back (see
// Node.writeBack). Its last holder wrote its bound before then, at most
// its lease ahead of its clock, and stops issuing at its next heartbeat
// (the key changed) or a lease after its last one. So the floor is at plus
// margin (deletedMargin): one lease for the bound, one for the holder's
// clock running ahead of the server's. Like an expired lease, the key is
// claimable once the claimant's clock is a lease past that floor.
func deletedRecord(id int, at time.Time, margin, lease time.Duration, epoch time.Time) leaseRecord {
	floor := at.UTC().Add(margin).Truncate(time.Millisecond).Add(time.Millisecond)
	return leaseRecord{
		Version: recordVersion, Worker: id, Epoch: epoch, LeaseMS: lease.Milliseconds(),
		Heartbeat: at.UTC(), Expires: floor, Bound: floor,
	}
}

// slot is one worker key as read.
type slot struct {
	rev uint64
	rec leaseRecord
	bad bool // value is not a lease record: leave alone
	// deleted is set for a delete or purge marker, written at the
	// server time at; rec is then filled in by deletedRecord.
	deleted bool
	at      time.Time
}

// configSlot is the config key as read.
type configSlot struct {
	found bool // the key has a message
	rev   uint64
	op    jetstream.KeyValueOp
	at    time.Time // server time of the message
	value []byte
}

// view is one consistent read of the bucket.
type view struct {
	slots map[int]slot
	conf  configSlot
	// maxRev is the highest revision read: every message up to it that
	// is still the latest of its key was read.
	maxRev uint64
}

// snapshot reads all keys, delete and purge markers included, through one
// watcher: it delivers the latest message of every key as of one point in
// the stream, so a marker read comes with the config value of that point,
// which holds every raise of the longest lease made before the deleted
// holder claimed. Worker keys without any message are absent.
func snapshot(ctx context.Context, kv jetstream.KeyValue, maxID int) (view, error) {
	wt, err := kv.WatchAll(ctx)
	if err != nil {
		return view{}, fmt.Errorf("snowflake: read leases: %w", err)
	}
	defer wt.Stop()
	v := view{slots: make(map[int]slot)}
	for {
		select {
		case e, ok := <-wt.Updates():
			if !ok {
				return view{}, errors.New("snowflake: read leases: watcher closed")
			}
			if e == nil {
				return v, nil
			}
			v.maxRev = max(v.maxRev, e.Revision())
			if e.Key() == configKey {
				v.conf = configSlot{found: true, rev: e.Revision(), op: e.Operation(), at: e.Created(), value: e.Value()}
				continue
			}
			id, ok := parseWorkerKey(e.Key(), maxID)
			if !ok {
				continue
			}
			s := slot{rev: e.Revision()}
			if e.Operation() != jetstream.KeyValuePut {
				s.deleted, s.at = true, e.Created()
			} else if err := json.Unmarshal(e.Value(), &s.rec); err != nil || s.rec.Version != recordVersion || s.rec.Worker != id {
				s.bad = true
			}
			v.slots[id] = s
		case <-ctx.Done():
			return view{}, fmt.Errorf("snowflake: read leases: %w", ctx.Err())
		}
	}
}

// configPasses bounds how often readBucket reads the bucket again after
// losing a race to raise the recorded longest lease.
const configPasses = 16

// readBucket reads the bucket (snapshot) and makes sure its config record
// covers our lease before we claim: the epoch must be there and ours
// (ErrEpochLost, ErrEpochMismatch: a running worker that finds the config
// gone, say because the whole bucket was purged, must not claim keys that
// look never used), and MaxLeaseMS at least our lease, raised by
// compare-and-swap if not. It returns the view with the config as stored.
func (w *Node) readBucket(ctx context.Context) (view, configRecord, error) {
	for pass := 1; ; pass++ {
		v, err := snapshot(ctx, w.kv, w.gen.layout.MaxWorkerID())
		if err != nil {
			return view{}, configRecord{}, err
		}
		c := v.conf
		if !c.found || c.op != jetstream.KeyValuePut {
			// The snapshot's consumer may sit on a replica that has not
			// applied the latest writes yet (in an R3 bucket, the epoch the
			// first worker just stored): the epoch is lost only if the
			// snapshot saw the last message the stream's leader reports.
			info, err := kvbucket.StreamInfo(ctx, w.kv)
			if err != nil {
				return view{}, configRecord{}, fmt.Errorf("snowflake: read epoch: %w", err)
			}
			if info.State.LastSeq > v.maxRev && pass < configPasses {
				continue
			}
		}
		switch {
		case !c.found:
			return view{}, configRecord{}, fmt.Errorf("%w: bucket %q has no key %q while workers run: "+
				"the key or the whole bucket was purged (nats kv purge / nats stream purge), and lease bounds may have gone with it; "+
				"refusing to claim a worker ID; stop every worker of this bucket, wait a lease after the last one stopped, "+
				"then restore the epoch (%s)", ErrEpochLost, w.cfg.Bucket, configKey, restoreCommand(w.cfg.Bucket, w.cfg.Epoch, w.gen.layout, w.cfg.Region))
		case c.op != jetstream.KeyValuePut:
			return view{}, configRecord{}, fmt.Errorf("%w: key %q of bucket %q was %s at %s while workers run; "+
				"refusing to claim a worker ID; restore the epoch (%s)", ErrEpochLost, configKey, w.cfg.Bucket,
				kvbucket.MarkerVerb(c.op), c.at.UTC().Format(TimeLayout), restoreCommand(w.cfg.Bucket, w.cfg.Epoch, w.gen.layout, w.cfg.Region))
		}
		var rec configRecord
		if err := json.Unmarshal(c.value, &rec); err != nil {
			return view{}, configRecord{}, fmt.Errorf("%w: bucket %q key %q: %v", ErrEpochMismatch, w.cfg.Bucket, configKey, err)
		}
		if !rec.Epoch.Equal(w.cfg.Epoch) {
			return view{}, configRecord{}, fmt.Errorf("%w: bucket %q has %s, configured %s", ErrEpochMismatch, w.cfg.Bucket,
				rec.Epoch.Format(time.RFC3339Nano), w.cfg.Epoch.Format(time.RFC3339Nano))
		}
		if err := checkLayout(w.cfg.Bucket, &rec, w.gen.layout, w.cfg.Region); err != nil {
			return view{}, configRecord{}, err
		}
		if rec.maxLease() >= w.cfg.Lease {
			return v, rec, nil
		}
		raised := rec
		raised.MaxLeaseMS = w.cfg.Lease.Milliseconds()
		if rec.MaxLeaseMS == 0 {
			// First record in a bucket that has held values: cover every
			// lease value read; keys deleted before now stay unknown.
			for _, s := range v.slots {
				if !s.bad && !s.deleted {
					raised.MaxLeaseMS = max(raised.MaxLeaseMS, s.rec.LeaseMS)
				}
			}
			raised.MaxLeaseSince = v.maxRev
		}
		data, err := json.Marshal(raised)
		if err != nil {
			return view{}, configRecord{}, err
		}
		rev, err := w.kv.Update(ctx, configKey, data, c.rev)
		if err == nil {
			w.log.Info("snowflake: recorded the longest lease used in the bucket", "max_lease", raised.maxLease(),
				"previous", rec.maxLease())
			v.conf.rev, v.conf.value = rev, data
			return v, raised, nil
		}
		if pass < configPasses && kvbucket.Conflict(err) {
			continue // another worker wrote it first: read again
		}
		return view{}, configRecord{}, fmt.Errorf("snowflake: record the longest lease: %w", err)
	}
}

// sleepCtx waits d, or until ctx ends (its error).
func sleepCtx(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
