package snowflake

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/dispenser-dev/dispenser/internal/kvbucket"
	"github.com/dispenser-dev/dispenser/internal/tests/wait"
	"github.com/nats-io/nats.go/jetstream"
)

// logCapture keeps what a logger wrote (and passes it to the test's
// output), so tests can check that an operator's mistake is named.
type logCapture struct {
	// mu protects buf.
	mu  sync.Mutex
	buf bytes.Buffer
}

func (c *logCapture) Write(p []byte) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.buf.Write(p)
}

// Contains reports whether any line logged so far contains s.
func (c *logCapture) Contains(s string) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return strings.Contains(c.buf.String(), s)
}

// captureLogger returns a logger that writes to the test's output and to
// the returned capture.
func captureLogger(tb testing.TB) (*slog.Logger, *logCapture) {
	tb.Helper()
	c := &logCapture{}
	h := slog.NewTextHandler(io.MultiWriter(tb.Output(), c), &slog.HandlerOptions{Level: slog.LevelDebug})
	return slog.New(h), c
}

// requireLogged fails unless the capture holds every one of want.
func requireLogged(tb testing.TB, c *logCapture, want ...string) {
	tb.Helper()
	for _, w := range want {
		if !c.Contains(w) {
			tb.Errorf("no log line contains %q", w)
		}
	}
}

// removeKey deletes or purges a worker key as an operator would and
// returns the marker's server time.
func removeKey(tb testing.TB, kv jetstream.KeyValue, id int, purge bool) time.Time {
	tb.Helper()
	ctx := context.Background()
	del := kv.Delete
	if purge {
		del = kv.Purge
	}
	if err := del(ctx, workerKey(id)); err != nil {
		tb.Fatal(err)
	}
	e, err := kvbucket.Latest(ctx, kv, workerKey(id))
	if err != nil || e == nil || e.Operation() == jetstream.KeyValuePut {
		tb.Fatalf("marker of worker key %d: got %v, %v", id, e, err)
	}
	return e.Created().UTC()
}

// waitForHeartbeat waits until w has written a heartbeat at or after at
// (its clock's time).
func waitForHeartbeat(tb testing.TB, w *Node, at time.Time) {
	tb.Helper()
	wait.For(tb, 30*time.Second, "a heartbeat at "+at.Format(TimeLayout), func() bool {
		return !w.Stats().(NodeStats).LastHeartbeat.Before(at)
	})
}

func verbOf(purge bool) string {
	if purge {
		return "purged (nats kv purge)"
	}
	return "deleted (nats kv del)"
}

// TestWorkerWritesBackDeletedKey is the clock-step case of issue 21 point
// 5: A's wall clock steps an hour forward, A heartbeats (its bound is now
// an hour ahead) and issues; the clock steps back and A refuses, as it
// should; an operator deletes (or purges) A's key to unstick it. A, seeing
// the marker at its next heartbeat or in Close, writes its bound back over
// the marker, so B, claiming the key, starts above everything A issued,
// instead of at the marker plus a minute (where B would issue A's IDs
// again an hour later).
func TestWorkerWritesBackDeletedKey(t *testing.T) {
	for _, purge := range []bool{false, true} {
		for _, via := range []string{"heartbeat", "close"} {
			t.Run(fmt.Sprintf("purge=%v/%s", purge, via), func(t *testing.T) {
				js := newJetStream(t)
				ctx := context.Background()
				// Markers carry the server's time: run the clocks near it.
				start := time.Now().UTC().Truncate(time.Millisecond)
				ca := newFakeClock(t, start)
				sa := fakeSettings(t, ca, "alpha")
				sa.manual = true
				var logs *logCapture
				sa.Logger, logs = captureLogger(t)
				a := startWorker(t, js, sa)
				aid := workerID(t, a)
				kv := openKV(t, js)
				fillUntil(t, kv, start, start.Add(48*time.Hour), aid)

				// The clock steps an hour forward; A heartbeats and issues.
				ahead := start.Add(time.Hour)
				ca.SetWall(ahead)
				a.heartbeat()
				if st := a.Stats().(NodeStats); st.Heartbeats != 1 || st.Bound.Before(ahead) {
					t.Fatalf("heartbeat after the step: heartbeats %d bound %v, want 1 and at least %v", st.Heartbeats, st.Bound, ahead)
				}
				aBound := a.Stats().(NodeStats).Bound
				aIDs := issue(t, a, 1000)
				// The clock steps back: A refuses.
				ca.SetWall(start.Add(time.Millisecond))
				if _, err := a.AppendIDs(nil, 1); !errors.Is(err, ErrClockBackwards) {
					t.Fatalf("after the step back: got error %v, want ErrClockBackwards", err)
				}
				requireLogged(t, logs, "clock is behind the last timestamp used")

				marker := removeKey(t, kv, aid, purge)
				// The bound written back is the last timestamp A used
				// (below the bound it held, which was its clock an hour
				// ahead plus a lease).
				wantBound := time.UnixMilli(DefaultEpoch.UnixMilli() + maxTimestamp(aIDs)).UTC()
				if wantBound.After(aBound) {
					t.Fatalf("A issued at %v, above its bound %v", wantBound, aBound)
				}
				if via == "heartbeat" {
					a.heartbeat()
					if _, err := a.AppendIDs(nil, 1); !errors.Is(err, ErrFenced) {
						t.Fatalf("after noticing the deletion: got error %v, want ErrFenced", err)
					}
					crash(t, a)
				} else {
					if err := a.Close(ctx); err != nil {
						t.Fatalf("Close: %v", err)
					}
				}
				requireLogged(t, logs, "lease key was "+verbOf(purge))
				if e, err := kv.Get(ctx, workerKey(aid)); err != nil {
					t.Errorf("written back: %v, want a released lease", err)
				} else {
					var rec leaseRecord
					if err := json.Unmarshal(e.Value(), &rec); err != nil || !rec.Released || rec.Bound.Before(wantBound) {
						t.Errorf("written back: %s (%v), want released with a bound of at least %v", e.Value(), err, wantBound)
					}
				}

				// B claims the key once it may (today: at the marker plus the
				// margin and a lease) and issues, its clock at the time A
				// issued at.
				cb := newFakeClock(t, marker.Add(DeletedKeyMargin+testLease+2*time.Millisecond))
				b := startWorker(t, js, fakeSettings(t, cb, "beta"))
				if got := workerID(t, b); got != aid {
					t.Fatalf("B took worker ID %d, want %d", got, aid)
				}
				cb.SetWall(ahead)
				waitForHeartbeat(t, b, ahead)
				bIDs, err := b.AppendIDs(nil, 1000)
				if err != nil {
					if !errors.Is(err, ErrClockBackwards) {
						t.Fatalf("B at A's time: got error %v, want nil or ErrClockBackwards", err)
					}
					cb.SetWall(wantBound.Add(time.Millisecond))
					bIDs = issue(t, b, 1000)
				}
				requireUnique(t, append(aIDs, bIDs...))
				if first, last := timestampOf(bIDs[0]), maxTimestamp(aIDs); first <= last {
					t.Errorf("B's first timestamp %d not above A's last %d", first, last)
				}
			})
		}
	}
}

// TestWorkerLeaseRaisedInRollingRestart is issue 21 point 6: a rolling
// restart raises --snowflake-lease to five minutes on one worker (W). W
// records the longer lease in the bucket before it claims. W is cut off,
// its key is deleted, and a worker still on the short lease (B) must not
// claim the key within W's reach: today the floor is the marker plus
// max(1 min, 2 x the leases B knows), and B would issue W's IDs again.
func TestWorkerLeaseRaisedInRollingRestart(t *testing.T) {
	js := newJetStream(t)
	ctx := context.Background()
	start := time.Now().UTC().Truncate(time.Millisecond)
	// The bucket is first used with the short lease.
	c0 := newFakeClock(t, start)
	s0 := fakeSettings(t, c0, "old")
	s0.manual = true
	old := startWorker(t, js, s0)
	oid := workerID(t, old)
	crash(t, old) // restarted with the new flag:
	const longLease = 5 * time.Minute
	cw := newFakeClock(t, start)
	sw := fakeSettings(t, cw, "long")
	sw.Lease, sw.Heartbeat, sw.manual = longLease, time.Minute, true
	w := startWorker(t, js, sw)
	wid := workerID(t, w)
	kv := openKV(t, js)
	fillUntil(t, kv, start, start.Add(48*time.Hour), oid, wid)
	// The old process's key is held by a squatter from now on.
	r, rev := readLease(t, kv, oid)
	r.Instance, r.Session, r.Released = "squatter", "squatter", false
	r.Expires, r.Bound = start.Add(48*time.Hour), start.Add(48*time.Hour)
	data, _ := json.Marshal(r)
	if _, err := kv.Update(ctx, workerKey(oid), data, rev); err != nil {
		t.Fatal(err)
	}

	// W is cut off (no heartbeats) and keeps issuing within its lease.
	wIDs := issue(t, w, 100)
	cw.Add(4 * time.Minute)
	wIDs = append(wIDs, issue(t, w, 100)...)
	marker := removeKey(t, kv, wid, false)

	// B, on the short lease, at the time today's code lets it claim.
	cb := newFakeClock(t, marker.Add(DeletedKeyMargin+testLease+2*time.Millisecond))
	b, err := tryStartWorker(t, js, fakeSettings(t, cb, "short"))
	if err == nil {
		after := cb.Now().Sub(marker)
		cb.SetWall(cw.Now()) // where W issued
		waitForHeartbeat(t, b, cw.Now())
		bIDs, _ := b.AppendIDs(nil, 100)
		requireUnique(t, append(wIDs, bIDs...))
		t.Fatalf("a short-lease worker claimed the deleted key of a five-minute holder %v after its deletion (worker ID %d)",
			after, workerID(t, b))
	}
	if !errors.Is(err, ErrNoWorkerID) || !strings.Contains(err.Error(), "1 of them deleted or purged") {
		t.Fatalf("within the holder's reach: got error %v, want ErrNoWorkerID naming the deleted key", err)
	}
	// Past twice the long lease and a short lease: claimable, above W.
	floor := marker.Add(2 * longLease).Truncate(time.Millisecond).Add(time.Millisecond)
	cb.SetWall(floor.Add(longLease + time.Millisecond))
	b = startWorker(t, js, fakeSettings(t, cb, "short"))
	if got := workerID(t, b); got != wid {
		t.Fatalf("took worker ID %d, want the deleted %d", got, wid)
	}
	bIDs := issue(t, b, 100)
	if first := timestampOf(bIDs[0]); first <= floor.UnixMilli()-DefaultEpoch.UnixMilli() {
		t.Errorf("first timestamp %d not above the floor %v", first, floor)
	}
	requireUnique(t, append(wIDs, bIDs...))
}

// TestWorkerDeletedKeyInOldBucket: in a bucket that has never recorded the
// longest lease (written by older versions), a key deleted before any
// worker of this version ran has a holder whose lease is unknown: it is
// claimable only UnknownLeaseMargin after its marker.
func TestWorkerDeletedKeyInOldBucket(t *testing.T) {
	js := newJetStream(t)
	start := time.Now().UTC().Truncate(time.Millisecond)
	kv := newBucket(t, js, DefaultBucket) // an old version's config: no max_lease_ms
	const gone = 7
	fillUntil(t, kv, start, start.Add(48*time.Hour), gone)
	// An old version's holder with a long lease, deleted.
	rec := squatter(gone, start)
	rec.LeaseMS = (20 * time.Minute).Milliseconds()
	data, _ := json.Marshal(rec)
	if _, err := kv.Create(context.Background(), workerKey(gone), data); err != nil {
		t.Fatal(err)
	}
	marker := removeKey(t, kv, gone, true)

	c := newFakeClock(t, marker.Add(2*20*time.Minute+testLease+time.Millisecond))
	if _, err := tryStartWorker(t, js, fakeSettings(t, c, "new")); !errors.Is(err, ErrNoWorkerID) {
		t.Fatalf("unknown holder lease, 40 minutes after the marker: got error %v, want ErrNoWorkerID", err)
	}
	var conf configRecord
	e, err := kv.Get(context.Background(), configKey)
	if err != nil || json.Unmarshal(e.Value(), &conf) != nil {
		t.Fatalf("config: %v", err)
	}
	if conf.MaxLeaseMS != testLease.Milliseconds() || conf.MaxLeaseSince == 0 {
		t.Errorf("config after the first claim: %+v, want the live leases' %v recorded since a revision", conf, testLease)
	}
	c.SetWall(marker.Add(UnknownLeaseMargin + time.Hour + time.Millisecond))
	w := startWorker(t, js, fakeSettings(t, c, "new"))
	if got := workerID(t, w); got != gone {
		t.Fatalf("took %d, want %d", got, gone)
	}
}

// TestWorkerSuspendedFencedByBound is issue 21 point 10 for snowflake: a
// host suspended for several leases resumes with its monotonic clock where
// it stopped (the lease still looks valid) and its wall clock far ahead.
// The bound written at the last heartbeat fences it; a successor that
// took the worker ID meanwhile issues at those timestamps.
func TestWorkerSuspendedFencedByBound(t *testing.T) {
	js := newJetStream(t)
	ca := newFakeClock(t, t0)
	sa := fakeSettings(t, ca, "alpha")
	sa.manual = true
	a := startWorker(t, js, sa)
	aid := workerID(t, a)
	kv := openKV(t, js)
	fillOthers(t, kv, t0, aid)
	all := issue(t, a, 100)

	// Suspended for ten leases: only the wall clock moves.
	resumed := t0.Add(10 * testLease)
	ca.SetWall(resumed)
	// Meanwhile B, on a correct clock, took the expired worker ID.
	cb := newFakeClock(t, resumed)
	b := startWorker(t, js, fakeSettings(t, cb, "beta"))
	if got := workerID(t, b); got != aid {
		t.Fatalf("B took %d, want %d", got, aid)
	}
	all = append(all, issue(t, b, 100)...)

	ids, err := a.AppendIDs(nil, 100)
	all = append(all, ids...)
	if !errors.Is(err, ErrFenced) {
		t.Errorf("resumed worker: got error %v, want ErrFenced (bound reached)", err)
	}
	requireUnique(t, all)
}

// TestWorkerFencedByMonotonicClock isolates the monotonic lease check: a
// worker whose heartbeats stopped a lease ago refuses although its wall
// clock (stepped back, or slewed) is still within its bound.
func TestWorkerFencedByMonotonicClock(t *testing.T) {
	js := newJetStream(t)
	c := newFakeClock(t, t0)
	s := fakeSettings(t, c, "alpha")
	s.manual = true
	a := startWorker(t, js, s)
	issue(t, a, 10)
	bound := a.Stats().(NodeStats).Bound
	c.Add(testLease) // a lease passes without a heartbeat...
	c.SetWall(t0)    // ...while the wall clock stands still
	if !c.Now().Before(bound) {
		t.Fatalf("wall clock %v not within the bound %v: the test needs it within", c.Now(), bound)
	}
	if _, err := a.AppendIDs(nil, 1); !errors.Is(err, ErrFenced) {
		t.Fatalf("a lease after the last heartbeat: got error %v, want ErrFenced", err)
	}
	a.heartbeat()
	issue(t, a, 10)
}

// TestWorkerBucketPurgedWhileRunning: an operator purges the whole lease
// bucket (nats stream purge), or the epoch key and then the worker's own
// key, under a running worker. The holder writes its last timestamp back
// and then refuses to claim (the epoch is gone, so keys that look never
// used may not be), with an error and a log line saying what happened; a
// new worker refuses to start; once the epoch is restored, the holder
// continues above everything it issued.
func TestWorkerBucketPurgedWhileRunning(t *testing.T) {
	tests := []struct {
		name    string
		damage  func(t *testing.T, js jetstream.JetStream, kv jetstream.KeyValue, id int)
		wantLog []string
	}{
		{
			name: "whole bucket purged",
			damage: func(t *testing.T, js jetstream.JetStream, _ jetstream.KeyValue, _ int) {
				stream, err := js.Stream(context.Background(), "KV_"+DefaultBucket)
				if err != nil {
					t.Fatal(err)
				}
				if err := stream.Purge(context.Background()); err != nil {
					t.Fatal(err)
				}
			},
			wantLog: []string{"removed without a marker (the bucket's stream was purged", "no key \\\"config\\\" while workers run"},
		},
		{
			name: "epoch deleted, then the worker's key purged",
			damage: func(t *testing.T, _ jetstream.JetStream, kv jetstream.KeyValue, id int) {
				if err := kv.Delete(context.Background(), configKey); err != nil {
					t.Fatal(err)
				}
				removeKey(t, kv, id, true)
			},
			wantLog: []string{"lease key was purged (nats kv purge)", "key \\\"config\\\" of bucket \\\"dispenser_workers\\\" was deleted"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			js := newJetStream(t)
			ctx := context.Background()
			c := newFakeClock(t, t0)
			s := fakeSettings(t, c, "alpha")
			var logs *logCapture
			s.Logger, logs = captureLogger(t)
			a := startWorker(t, js, s)
			aid := workerID(t, a)
			all := issue(t, a, 1000)
			last := time.UnixMilli(DefaultEpoch.UnixMilli() + maxTimestamp(all)).UTC()
			kv := openKV(t, js)

			tt.damage(t, js, kv, aid)
			var refusal error
			wait.For(t, 30*time.Second, "the worker to refuse for the lost epoch", func() bool {
				_, refusal = a.AppendIDs(nil, 1)
				return errors.Is(refusal, ErrEpochLost)
			})
			if !Unavailable(refusal) {
				t.Errorf("refusal %v is not unavailable (503)", refusal)
			}
			requireLogged(t, logs, tt.wantLog...)
			if rec, _ := readLease(t, kv, aid); !rec.Released || rec.Bound.Before(last) {
				t.Errorf("written back: released %v bound %v, want true and at least %v", rec.Released, rec.Bound, last)
			}
			if _, err := tryStartWorker(t, js, fakeSettings(t, c, "beta")); !errors.Is(err, ErrEpochLost) {
				t.Fatalf("new worker on the damaged bucket: got error %v, want ErrEpochLost", err)
			}

			data, _ := json.Marshal(configRecord{Version: recordVersion, Epoch: DefaultEpoch})
			if _, err := kv.Put(ctx, configKey, data); err != nil {
				t.Fatal(err)
			}
			wait.For(t, 30*time.Second, "the worker to issue again", func() bool {
				ids, err := a.AppendIDs(nil, 100)
				all = append(all, ids...)
				return err == nil
			})
			b := startWorker(t, js, fakeSettings(t, c, "beta"))
			all = append(all, issue(t, b, 1000)...)
			requireUnique(t, all)
			if st := a.Stats().(NodeStats); st.WriteBacks != 1 {
				t.Errorf("stats: write-backs %d, want 1", st.WriteBacks)
			}
		})
	}
}

// TestWorkerBucketRecreated is issue 21 point 14 for the lease bucket: the
// bucket is deleted, or deleted and created again, under a running worker.
// In the new bucket revisions restart, so a record at the worker's last
// revision can belong to someone else: the worker must not write over it,
// and stops issuing for good, saying what the operator did.
func TestWorkerBucketRecreated(t *testing.T) {
	for _, recreate := range []bool{false, true} {
		t.Run(fmt.Sprintf("recreate=%v", recreate), func(t *testing.T) {
			js := newJetStream(t)
			ctx := context.Background()
			c := newFakeClock(t, t0)
			s := fakeSettings(t, c, "alpha")
			s.manual = true
			var logs *logCapture
			s.Logger, logs = captureLogger(t)
			// Not startWorker: its Cleanup wants Close to succeed.
			a, err := Start(ctx, js, s)
			if err != nil {
				t.Fatal(err)
			}
			aid := workerID(t, a)
			issue(t, a, 10)
			a.mu.Lock()
			rev := a.rev
			a.mu.Unlock()

			if err := js.DeleteKeyValue(ctx, DefaultBucket); err != nil {
				t.Fatal(err)
			}
			var kv jetstream.KeyValue
			var other leaseRecord
			if recreate {
				kv = newBucket(t, js, DefaultBucket)
				// Fill the new bucket up to the revision before ours, then
				// put someone else's lease under our key at our revision.
				for i := 0; ; i++ {
					st, err := kv.Status(ctx)
					if err != nil {
						t.Fatal(err)
					}
					if st.(*jetstream.KeyValueBucketStatus).StreamInfo().State.LastSeq >= rev-1 {
						break
					}
					if _, err := kv.Put(ctx, "filler", []byte(fmt.Sprint(i))); err != nil {
						t.Fatal(err)
					}
				}
				other = squatter(aid, t0)
				data, _ := json.Marshal(other)
				got, err := kv.Put(ctx, workerKey(aid), data)
				if err != nil || got != rev {
					t.Fatalf("other lease at revision %d, %v; want %d", got, err, rev)
				}
			}
			a.heartbeat()
			_, err = a.AppendIDs(nil, 1)
			if !errors.Is(err, ErrBucketDeleted) || !Unavailable(err) {
				t.Errorf("after the bucket was replaced: got error %v, want ErrBucketDeleted (unavailable)", err)
			}
			if recreate {
				requireLogged(t, logs, "was deleted and created again")
				if st := a.Stats().(NodeStats); st.Stopped == "" || st.Held {
					t.Errorf("stats: stopped %q held %v, want a reason and false", st.Stopped, st.Held)
				}
				if rec, got := readLease(t, kv, aid); got != rev || rec.Session != other.Session {
					t.Errorf("the new bucket's lease was overwritten: revision %d session %q, want %d %q", got, rec.Session, rev, other.Session)
				}
			} else {
				requireLogged(t, logs, "no longer exists")
			}
			if err := a.Close(ctx); !errors.Is(err, ErrBucketDeleted) {
				t.Errorf("Close: got error %v, want ErrBucketDeleted", err)
			}
		})
	}
}
