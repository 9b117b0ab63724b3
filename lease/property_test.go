package lease_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/dispenser-dev/dispenser/internal/kvbucket"
	"github.com/dispenser-dev/dispenser/lease"
)

// Environment variables of TestNoTwoHolders.
const (
	// envSeed replays a run: the first schedule uses this seed.
	envSeed = "DISPENSER_LEASE_SEED"
	// envLong=1 runs many more and longer schedules.
	envLong = "DISPENSER_LEASE_LONG"
)

// testRecord is the smallest lease record: the fields every user's record
// has.
type testRecord struct {
	Session  string    `json:"session"`
	LeaseMS  int64     `json:"lease_ms"`
	Expires  time.Time `json:"expires"`
	Released bool      `json:"released"`
}

// holder is one process taking the lease under the package's rules: it
// claims only by Settings.Claim with the terms it read, renews and
// releases by Settings.Write, and counts itself the holder while its
// Fence is valid.
type holder struct {
	name  string
	clock *clock
	s     lease.Settings
	fence lease.Fence
	rev   uint64 // of its last landed write; 0: holds nothing
	// suspended: the machine was suspended since its last landed write.
	// Its wall clock stepping back as well is outside the argument
	// (both clocks wrong at once).
	suspended bool
}

func (h *holder) record(released bool) func(time.Time) ([]byte, error) {
	return func(now time.Time) ([]byte, error) {
		r := testRecord{Session: h.name, LeaseMS: h.s.Lease.Milliseconds(), Expires: now.Add(h.s.Lease), Released: released}
		if released {
			r.Expires = now
		}
		return json.Marshal(r)
	}
}

// TestNoTwoHolders runs random schedules of claims, renewals, releases,
// partitions (renewals skipped), suspensions (the monotonic clock stands
// still while time passes), time passing, and deletions and purges of the
// key by an operator, against a real key with a few holders whose wall
// clocks disagree by less than a lease. After every step it checks that no
// two holders count the lease valid at the same instant.
//
// DISPENSER_LEASE_SEED=N replays schedule N first; DISPENSER_LEASE_LONG=1
// runs 30 schedules of 600 steps instead of 6 of 300.
func TestNoTwoHolders(t *testing.T) {
	schedules, steps := 6, 300
	if os.Getenv(envLong) == "1" {
		schedules, steps = 30, 600
	}
	seed := uint64(time.Now().UnixNano())
	if s := os.Getenv(envSeed); s != "" {
		var err error
		if seed, err = strconv.ParseUint(s, 10, 64); err != nil {
			t.Fatalf("%s=%q: %v", envSeed, s, err)
		}
	}
	t.Logf("seed %d (replay with %s=%d)", seed, envSeed, seed)
	js := newJetStream(t)
	for i := range uint64(schedules) {
		s := seed + i
		if !t.Run(fmt.Sprintf("seed=%d", s), func(t *testing.T) { runSchedule(t, js, s, steps) }) {
			t.Logf("replay: %s=%d go test -run 'TestNoTwoHolders/seed=%d$' ./lease", envSeed, s, s)
			return
		}
	}
}

func runSchedule(t *testing.T, js jetstream.JetStream, seed uint64, steps int) {
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(seed, seed^0x5eed))
	kv := newBucket(t, js, fmt.Sprintf("prop_%d", seed%1_000_000_007))
	const l = time.Second
	const key = "k"
	// deletedAt holds the true time of each operator's marker, by its
	// revision: the server's own timestamps are real time, not the test's.
	deletedAt := map[uint64]time.Time{}
	var hs []*holder
	for i := range 3 {
		// Wall clocks within ±l/2 of the true time: any two disagree by
		// less than a lease.
		skew := time.Duration(rng.Int64N(int64(l))) - l/2
		c := &clock{wall: t0.Add(skew), mono: time.Duration(i) * time.Hour}
		hs = append(hs, &holder{name: fmt.Sprintf("h%d", i), clock: c, s: settings(t, c, l)})
	}
	var trueTime time.Duration
	pass := func(d time.Duration, suspended *holder) {
		trueTime += d
		for _, h := range hs {
			if h == suspended {
				h.clock.Suspend(d)
			} else {
				h.clock.Add(d)
			}
		}
	}
	for step := range steps {
		h := hs[rng.IntN(len(hs))]
		var what string
		switch op := rng.IntN(10); {
		case op < 3:
			what = "claim by " + h.name
			e, err := kvbucket.Latest(ctx, kv, key)
			if err != nil {
				t.Fatal(err)
			}
			var prev lease.Terms
			var rev uint64
			if e != nil {
				rev = e.Revision()
				if e.Operation() != jetstream.KeyValuePut {
					at, ok := deletedAt[rev]
					if !ok {
						t.Fatalf("marker at revision %d not made by the test", rev)
					}
					prev = lease.Deleted(at, lease.DeletedMargin(l), l)
				} else {
					var r testRecord
					if err := json.Unmarshal(e.Value(), &r); err != nil {
						t.Fatal(err)
					}
					prev = lease.Terms{Lease: time.Duration(r.LeaseMS) * time.Millisecond, Expires: r.Expires, Released: r.Released}
				}
			}
			g, err := h.s.Claim(ctx, kv, key, rev, prev, h.record(false))
			switch {
			case err == nil:
				h.fence.Extend(g, l)
				h.rev, h.suspended = g.Rev, false
				what += " (won)"
			case errors.Is(err, lease.ErrNotClaimable) || kvbucket.Conflict(err):
			default:
				t.Fatal(err)
			}
		case op < 5:
			if h.rev == 0 {
				continue
			}
			what = "renewal by " + h.name
			g, err := h.s.Write(ctx, kv, key, h.rev, h.record(false))
			switch {
			case err == nil:
				h.fence.Extend(g, l)
				h.rev, h.suspended = g.Rev, false
			case kvbucket.Conflict(err):
				h.fence.Revoke()
				h.rev = 0
			default:
				t.Fatal(err)
			}
		case op < 6:
			if h.rev == 0 {
				continue
			}
			what = "release by " + h.name
			h.fence.Revoke() // stop before the record says so
			if _, err := h.s.Write(ctx, kv, key, h.rev, h.record(true)); err != nil && !kvbucket.Conflict(err) {
				t.Fatal(err)
			}
			h.rev = 0
		case op < 7:
			d := time.Duration(rng.Int64N(int64(3 * l)))
			what = fmt.Sprintf("%s suspended for %v", h.name, d)
			pass(d, h)
			h.suspended = true
		case op < 8:
			purge := rng.IntN(2) == 0
			var err error
			if purge {
				what, err = "key purged", kv.Purge(ctx, key)
			} else {
				what, err = "key deleted", kv.Delete(ctx, key)
			}
			if err != nil {
				t.Fatal(err)
			}
			e, err := kvbucket.Latest(ctx, kv, key)
			if err != nil || e == nil {
				t.Fatalf("marker: %v, %v", e, err)
			}
			deletedAt[e.Revision()] = t0.Add(trueTime)
		default:
			d := time.Duration(rng.Int64N(int64(l / 2)))
			if rng.IntN(6) == 0 {
				d += lease.DeletedMargin(l) // let deleted keys become claimable
			}
			what = fmt.Sprintf("%v passed", d)
			pass(d, nil)
		}
		var valid []string
		for _, o := range hs {
			if o.fence.Valid(o.clock.Clock()) {
				valid = append(valid, o.name)
			}
		}
		if len(valid) > 1 {
			t.Fatalf("step %d (%s), true time t0+%v: %v all count the lease valid", step, what, trueTime, valid)
		}
		// A wall clock may step back at any moment, by more than a
		// lease: the monotonic clock must still end the lease.
		o := hs[rng.IntN(len(hs))]
		back := time.Duration(rng.Int64N(int64(3 * l)))
		o.clock.Suspend(-back)
		if !o.suspended && o.fence.Valid(o.clock.Clock()) && len(valid) == 1 && valid[0] != o.name {
			t.Fatalf("step %d (%s), true time t0+%v: %s counts the lease valid with its wall clock stepped back by %v while %s holds it",
				step, what, trueTime, o.name, back, valid[0])
		}
		o.clock.Suspend(back)
	}
}
