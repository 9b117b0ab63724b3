package snowflake

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/dispenser-dev/dispenser/internal/kvbucket"
	"github.com/dispenser-dev/dispenser/testenv"
)

// TestWorkerRefusesHostileBucket: a lease bucket that can forget values, or
// that has lost its epoch, is refused at start-up with an error saying what
// to change; a bucket that only limits writes is accepted.
func TestWorkerRefusesHostileBucket(t *testing.T) {
	js := newJetStream(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	editStream := func(t *testing.T, bucket string, change func(*jetstream.StreamConfig)) {
		t.Helper()
		s, err := js.Stream(ctx, "KV_"+bucket)
		if err != nil {
			t.Fatal(err)
		}
		cfg := s.CachedInfo().Config
		change(&cfg)
		if _, err := js.UpdateStream(ctx, cfg); err != nil {
			t.Fatalf("edit stream: %v", err)
		}
	}
	purgeStream := func(t *testing.T, bucket string, opts ...jetstream.StreamPurgeOpt) {
		t.Helper()
		s, err := js.Stream(ctx, "KV_"+bucket)
		if err != nil {
			t.Fatal(err)
		}
		if err := s.Purge(ctx, opts...); err != nil {
			t.Fatalf("purge stream: %v", err)
		}
	}
	tests := []struct {
		name string
		// create makes the bucket as an operator would; nil lets the
		// worker create it.
		create *jetstream.KeyValueConfig
		// used runs a worker on the bucket first and closes it.
		used bool
		// damage then changes the bucket.
		damage   func(t *testing.T, bucket string, kv jetstream.KeyValue)
		replicas int
		wantErr  error
		wantMsg  string
	}{
		{name: "new bucket"},
		{name: "operator's empty bucket", create: &jetstream.KeyValueConfig{}},
		{name: "operator's bucket with history and a byte limit", create: &jetstream.KeyValueConfig{History: 5, MaxBytes: 1 << 20}, used: true},
		{name: "message limit discarding new writes", used: true, damage: func(t *testing.T, b string, _ jetstream.KeyValue) {
			editStream(t, b, func(c *jetstream.StreamConfig) { c.MaxMsgs = 5000 })
		}},
		{name: "TTL", create: &jetstream.KeyValueConfig{TTL: time.Hour}, wantErr: ErrBucketTTL, wantMsg: "--max-age 0"},
		{name: "TTL added while used", used: true, damage: func(t *testing.T, b string, _ jetstream.KeyValue) {
			editStream(t, b, func(c *jetstream.StreamConfig) { c.MaxAge, c.Duplicates = time.Hour, time.Minute })
		}, wantErr: ErrBucketTTL},
		{name: "limit markers", create: &jetstream.KeyValueConfig{LimitMarkerTTL: time.Minute}, wantErr: ErrBucketTTL},
		{name: "message limit discarding old values", used: true, damage: func(t *testing.T, b string, _ jetstream.KeyValue) {
			editStream(t, b, func(c *jetstream.StreamConfig) { c.MaxMsgs, c.Discard = 5000, jetstream.DiscardOld })
		}, wantErr: ErrBucketLimits, wantMsg: "5000 messages"},
		{name: "memory storage", create: &jetstream.KeyValueConfig{Storage: jetstream.MemoryStorage}, wantErr: ErrBucketMemory},
		{name: "fewer replicas than configured", used: true, replicas: 3, wantErr: ErrBucketReplicas, wantMsg: "--replicas 3"},
		{name: "epoch deleted", used: true, damage: func(t *testing.T, _ string, kv jetstream.KeyValue) {
			if err := kv.Delete(ctx, configKey); err != nil {
				t.Fatal(err)
			}
		}, wantErr: ErrEpochLost, wantMsg: "was deleted at"},
		{name: "epoch purged", used: true, damage: func(t *testing.T, _ string, kv jetstream.KeyValue) {
			if err := kv.Purge(ctx, configKey); err != nil {
				t.Fatal(err)
			}
		}, wantErr: ErrEpochLost, wantMsg: "was purged at"},
		{name: "epoch removed without a marker", used: true, damage: func(t *testing.T, b string, _ jetstream.KeyValue) {
			purgeStream(t, b, jetstream.WithPurgeSubject("$KV."+b+"."+configKey))
		}, wantErr: ErrEpochLost, wantMsg: "nats kv put"},
		{name: "whole bucket purged", used: true, damage: func(t *testing.T, b string, _ jetstream.KeyValue) {
			purgeStream(t, b)
		}, wantErr: ErrEpochLost, wantMsg: "has held"},
		{name: "epoch deleted before any worker ran", create: &jetstream.KeyValueConfig{}, damage: func(t *testing.T, _ string, kv jetstream.KeyValue) {
			if err := kv.Delete(ctx, configKey); err != nil {
				t.Fatal(err)
			}
		}, wantErr: ErrEpochLost},
	}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := newFakeClock(t, t0)
			s := fakeSettings(t, c, "alpha")
			s.Bucket = fmt.Sprintf("leases_%d", i)
			if tt.create != nil {
				cfg := *tt.create
				cfg.Bucket = s.Bucket
				if _, err := js.CreateKeyValue(ctx, cfg); err != nil {
					t.Fatal(err)
				}
			}
			if tt.used {
				w := startWorker(t, js, s)
				issue(t, w, 100)
				if err := w.Close(ctx); err != nil {
					t.Fatal(err)
				}
			}
			if tt.damage != nil {
				kv, err := js.KeyValue(ctx, s.Bucket)
				if err != nil {
					t.Fatal(err)
				}
				tt.damage(t, s.Bucket, kv)
			}
			s.Instance, s.Replicas = "beta", tt.replicas
			w, err := tryStartWorker(t, js, s)
			if !errors.Is(err, tt.wantErr) || (err == nil) != (tt.wantErr == nil) {
				t.Fatalf("Start: got error %v, want %v", err, tt.wantErr)
			}
			if err != nil {
				if Unavailable(err) {
					t.Errorf("error %v is unavailable (503); a bad bucket is a configuration error", err)
				}
				if !strings.Contains(err.Error(), s.Bucket) || !strings.Contains(err.Error(), tt.wantMsg) {
					t.Errorf("error %q does not name the bucket %q and %q", err, s.Bucket, tt.wantMsg)
				}
				return
			}
			issue(t, w, 10)
		})
	}
}

// fillUntil writes, for every worker ID but the given ones, a live lease
// of testLease that is not claimable before until.
func fillUntil(tb testing.TB, kv jetstream.KeyValue, now, until time.Time, except ...int) {
	tb.Helper()
	ctx := context.Background()
	for id := range MaxWorkerID + 1 {
		if contains(except, id) {
			continue
		}
		r := squatter(id, now)
		r.LeaseMS, r.Expires, r.Bound = testLease.Milliseconds(), until, until
		data, err := json.Marshal(r)
		if err != nil {
			tb.Fatal(err)
		}
		if _, err := kv.Create(ctx, workerKey(id), data); err != nil {
			tb.Fatalf("fill worker ID %d: %v", id, err)
		}
	}
}

// TestWorkerDeletedKey: a worker key deleted or purged while its holder
// is cut off is not claimed until a margin after the marker, and then with
// a floor above everything the holder issued.
func TestWorkerDeletedKey(t *testing.T) {
	for _, purge := range []bool{false, true} {
		t.Run(fmt.Sprintf("purge=%v", purge), func(t *testing.T) {
			js := newJetStream(t)
			ctx := context.Background()
			// Markers carry the server's time: run the fake clock near it.
			start := time.Now().UTC().Truncate(time.Millisecond)
			c := newFakeClock(t, start)
			a := startWorker(t, js, fakeSettings(t, c, "alpha"))
			aid := workerID(t, a)
			kv := openKV(t, js)
			fillUntil(t, kv, start, start.Add(24*time.Hour), aid)
			aIDs := issue(t, a, 3*4096) // borrows two milliseconds ahead
			// The holder is cut off for good before the deletion, so it
			// cannot write its bound back (TestWorkerWritesBackDeletedKey
			// covers a holder that notices).
			crash(t, a)

			del := kv.Delete
			if purge {
				del = kv.Purge
			}
			if err := del(ctx, workerKey(aid)); err != nil {
				t.Fatal(err)
			}
			e, err := kvbucket.Latest(ctx, kv, workerKey(aid))
			if err != nil || e == nil || e.Operation() == jetstream.KeyValuePut {
				t.Fatalf("marker: got %v, %v", e, err)
			}
			floor := e.Created().UTC().Add(DeletedKeyMargin).Truncate(time.Millisecond).Add(time.Millisecond)
			claimable := floor.Add(testLease)

			for _, tt := range []struct {
				name    string
				now     time.Time
				wantErr error
			}{
				{name: "at once", now: start, wantErr: ErrNoWorkerID},
				{name: "at the floor", now: floor, wantErr: ErrNoWorkerID},
				{name: "a lease after the floor", now: claimable, wantErr: ErrNoWorkerID},
				{name: "past a lease after the floor", now: claimable.Add(time.Millisecond)},
			} {
				c.SetWall(tt.now)
				b, err := tryStartWorker(t, js, fakeSettings(t, c, "beta"))
				if !errors.Is(err, tt.wantErr) || (err == nil) != (tt.wantErr == nil) {
					t.Fatalf("%s: got error %v, want %v", tt.name, err, tt.wantErr)
				}
				if err != nil {
					if !strings.Contains(err.Error(), "1 of them deleted or purged") {
						t.Errorf("%s: error %q does not mention the deleted key", tt.name, err)
					}
					continue
				}
				if got := workerID(t, b); got != aid {
					t.Fatalf("%s: took worker ID %d, want the deleted %d", tt.name, got, aid)
				}
				bIDs := issue(t, b, 1000)
				if first := timestampOf(bIDs[0]); first <= floor.UnixMilli()-DefaultEpoch.UnixMilli() || first <= maxTimestamp(aIDs) {
					t.Errorf("%s: successor's first timestamp %d not above the floor %v and the holder's last %d",
						tt.name, first, floor, maxTimestamp(aIDs))
				}
				requireUnique(t, append(aIDs, bIDs...))
			}
		})
	}
}

// TestWorkerCreateDoesNotWriteOverMarker: a claimant whose snapshot saw no
// message under a key must not take it once a delete marker is there.
func TestWorkerCreateDoesNotWriteOverMarker(t *testing.T) {
	js := newJetStream(t)
	ctx := context.Background()
	start := time.Now().UTC().Truncate(time.Millisecond)
	c := newFakeClock(t, start)
	s := fakeSettings(t, c, "alpha")
	s.manual = true
	a := startWorker(t, js, s)
	aid := workerID(t, a)
	kv := openKV(t, js)
	free := (aid + 1) % (MaxWorkerID + 1)
	// As if the key had held a lease and been deleted after a snapshot
	// that found it empty.
	if _, err := kv.Create(ctx, workerKey(free), []byte("{}")); err != nil {
		t.Fatal(err)
	}
	if err := kv.Delete(ctx, workerKey(free)); err != nil {
		t.Fatal(err)
	}
	_, err := a.try(ctx, candidate{id: free})
	if !errors.Is(err, jetstream.ErrKeyRevisionMismatch) && !errors.Is(err, jetstream.ErrKeyExists) {
		t.Fatalf("claiming a key with a delete marker as never used: got error %v, want a lost race", err)
	}
}

// TestWorkerIncreasesAcrossWorkerIDs: a worker that loses its worker ID and
// claims a lower one keeps issuing above its last ID.
func TestWorkerIncreasesAcrossWorkerIDs(t *testing.T) {
	js := newJetStream(t)
	ctx := context.Background()
	c := newFakeClock(t, t0)
	s := fakeSettings(t, c, "alpha")
	s.manual = true // heartbeats by hand
	// A bucket whose only free worker ID is high.
	const high, low = 1000, 3
	kv := newBucket(t, js, DefaultBucket)
	fillOthers(t, kv, c.Now(), high)
	a := startWorker(t, js, s)
	if got := workerID(t, a); got != high {
		t.Fatalf("alpha took %d, want %d", got, high)
	}
	ids := issue(t, a, 3*4096) // borrows two milliseconds ahead of the clock

	// Worker ID low is released by its squatter; high is taken over.
	release(t, kv, low)
	r, rev := readLease(t, kv, high)
	r.Instance, r.Session = "usurper", "usurper"
	data, _ := json.Marshal(r)
	if _, err := kv.Update(ctx, workerKey(high), data, rev); err != nil {
		t.Fatal(err)
	}
	a.heartbeat() // finds the key taken
	if _, ok := a.WorkerID(); ok {
		t.Fatal("alpha still holds a worker ID after losing it")
	}
	a.reclaim()
	if got := workerID(t, a); got != low {
		t.Fatalf("alpha re-claimed %d, want %d", got, low)
	}
	more := issue(t, a, 10)
	if more[0] <= ids[len(ids)-1] {
		p, q := Decode(ids[len(ids)-1], time.Time{}), Decode(more[0], time.Time{})
		t.Fatalf("first ID under worker ID %d is %d (timestamp %d), below the last under %d, %d (timestamp %d)",
			low, more[0], q.Timestamp, high, ids[len(ids)-1], p.Timestamp)
	}
	requireIncreasing(t, append(ids, more...))
}

// TestWorkerInvalidCount: a batch above MaxCount is the caller's mistake
// (400), not "unavailable" (503), and issues nothing.
func TestWorkerInvalidCount(t *testing.T) {
	js := newJetStream(t)
	w := startWorker(t, js, fakeSettings(t, newFakeClock(t, t0), "alpha"))
	for _, n := range []int{0, -1, MaxCount + 1, 1 << 40} {
		dst := []int64{42}
		got, err := w.AppendIDs(dst, n)
		if !errors.Is(err, ErrInvalidCount) || Unavailable(err) || w.Unavailable(err) {
			t.Errorf("AppendIDs(_, %d): got error %v, want ErrInvalidCount, not unavailable", n, err)
		}
		if len(got) != 1 {
			t.Errorf("AppendIDs(_, %d): appended %d IDs on error", n, len(got)-1)
		}
	}
	if st := w.Stats().(NodeStats); st.Issued != 0 || st.Fenced {
		t.Errorf("stats after invalid counts: issued %d fenced %v, want 0 false", st.Issued, st.Fenced)
	}
	issue(t, w, MaxCount)
}

// newBucket creates a lease bucket holding the default epoch, as a worker
// would.
func newBucket(tb testing.TB, js jetstream.JetStream, name string) jetstream.KeyValue {
	tb.Helper()
	ctx := context.Background()
	kv := testenv.CreateKeyValue(tb, js, jetstream.KeyValueConfig{Bucket: name, History: 1, Storage: jetstream.FileStorage})
	data, _ := json.Marshal(configRecord{Version: recordVersion, Epoch: DefaultEpoch})
	if _, err := kv.Create(ctx, configKey, data); err != nil {
		tb.Fatalf("store epoch: %v", err)
	}
	return kv
}
