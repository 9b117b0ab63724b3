package snowflake

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"
)

// TestRegionsLeaseApart: with 2 region bits, the workers of each region
// lease from a bucket of their own; every worker ID a region holds has the
// region in its top bits, so the regions' IDs never meet although their
// buckets know nothing of each other. Each bucket holds only 256 IDs: the
// 257th worker of a region finds none. (With the claim loop over all 1024
// IDs, region 1's workers take IDs of region 0 and the test fails.)
func TestRegionsLeaseApart(t *testing.T) {
	js := newJetStream(t)
	layout := DefaultLayout
	layout.RegionBits = 2
	var all []int64
	for region := range 2 {
		bucket := fmt.Sprintf("leases_r%d", region)
		for i := range 3 {
			w := startWorker(t, js, NodeSettings{Bucket: bucket, Instance: fmt.Sprintf("r%d-%d", region, i),
				Region: region, Settings: Settings{Layout: layout, Logger: testLogger(t)}})
			id := workerID(t, w)
			if first, last := layout.RegionWorkerIDs(region); id < first || id > last {
				t.Errorf("region %d holds worker ID %d, want %d..%d", region, id, first, last)
			}
			ids := issue(t, w, 100)
			for _, x := range ids {
				if got := layout.Decode(x, DefaultEpoch).Region; got != int64(region) {
					t.Fatalf("ID %d of region %d decodes to region %d", x, region, got)
				}
			}
			all = append(all, ids...)
		}
	}
	requireUnique(t, all)
}

// TestRegionSettingsRecorded: the bucket records the region bits (in the
// layout) and the region; a worker with other region bits or of another
// region is refused at start-up.
func TestRegionSettingsRecorded(t *testing.T) {
	js := newJetStream(t)
	two := DefaultLayout
	two.RegionBits = 2
	three := DefaultLayout
	three.RegionBits = 3
	startWorker(t, js, NodeSettings{Bucket: "leases_r1", Instance: "first", Region: 1, Settings: Settings{Layout: two, Logger: testLogger(t)}})
	for _, tc := range []struct {
		name string
		s    NodeSettings
		want error
	}{
		{"other region", NodeSettings{Region: 2, Settings: Settings{Layout: two}}, ErrRegionMismatch},
		{"region 0", NodeSettings{Settings: Settings{Layout: two}}, ErrRegionMismatch},
		{"other region bits", NodeSettings{Region: 1, Settings: Settings{Layout: three}}, ErrLayoutMismatch},
		{"no region bits", NodeSettings{Region: 0}, ErrLayoutMismatch},
		{"region beyond the bits", NodeSettings{Region: 4, Settings: Settings{Layout: two}}, ErrInvalidSettings},
		{"negative region", NodeSettings{Region: -1, Settings: Settings{Layout: two}}, ErrInvalidSettings},
		{"all worker bits", NodeSettings{Settings: Settings{Layout: Layout{Name: "x", TimeBits: 41, WorkerBits: 10, SequenceBits: 12, RegionBits: 10}}}, ErrInvalidSettings},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := tc.s
			s.Bucket, s.Instance, s.Logger = "leases_r1", "second", testLogger(t)
			w, err := tryStartWorker(t, js, s)
			if !errors.Is(err, tc.want) {
				if w != nil {
					id, _ := w.WorkerID()
					t.Fatalf("started with worker ID %d, want %v", id, tc.want)
				}
				t.Fatalf("err = %v, want %v", err, tc.want)
			}
		})
	}
	// The same settings are welcome.
	startWorker(t, js, NodeSettings{Bucket: "leases_r1", Instance: "third", Region: 1, Settings: Settings{Layout: two, Logger: testLogger(t)}})
}

func TestDecodeRegion(t *testing.T) {
	l := DefaultLayout
	l.RegionBits = 3
	worker := int64(5<<7 | 42) // region 5, its 42nd worker ID
	id := l.compose(12345, worker, 7)
	p := l.Decode(id, DefaultEpoch)
	if p.Region != 5 || p.Worker != worker || p.Sequence != 7 || p.Timestamp != 12345 {
		t.Fatalf("Decode = %+v, want region 5, worker %d, sequence 7, timestamp 12345", p, worker)
	}
	b, err := p.MarshalJSON()
	if err != nil {
		t.Fatal(err)
	}
	if want := `"region":5`; !strings.Contains(string(b), want) {
		t.Errorf("JSON %s lacks %s", b, want)
	}
	if b, _ := DefaultLayout.Decode(id, DefaultEpoch).MarshalJSON(); strings.Contains(string(b), "region") {
		t.Errorf("JSON of a layout without regions names one: %s", b)
	}
}

// TestRegionBitsTurnedOnLater: a deployment that leased from DefaultBucket
// turns region bits on; region 0's new bucket holds worker IDs that
// DefaultBucket's workers held. Its creator records DefaultBucket's
// highest bound (NodeSettings.Predecessor), and worker ID 0 of the new
// bucket starts above it, although the new host's clock is behind the
// last ID worker ID 0 issued without regions. (Without the floor, the
// new worker claimed worker ID 0 and issued "duplicate ID … (worker 0,
// timestamp …, sequence 0)".) A predecessor whose lease is still held is
// refused.
func TestRegionBitsTurnedOnLater(t *testing.T) {
	noShuffle := func(int, func(i, j int)) {}
	layout := DefaultLayout
	layout.RegionBits = 1
	start := time.Now()
	t.Run("floor", func(t *testing.T) {
		js := newJetStream(t)
		ahead := newFakeClock(t, start.Add(time.Second)) // the old host's clock
		old := fakeSettings(t, ahead, "old")
		old.shuffle = noShuffle
		w, err := Start(context.Background(), js, old)
		if err != nil {
			t.Fatal(err)
		}
		before := issue(t, w, 100)
		if err := w.Close(context.Background()); err != nil {
			t.Fatal(err)
		}
		behind := newFakeClock(t, start) // the new host's clock
		s := fakeSettings(t, behind, "new")
		s.shuffle, s.Bucket, s.Predecessor, s.Layout = noShuffle, DefaultBucket+"_r0", DefaultBucket, layout
		nw := startWorker(t, js, s)
		if id := workerID(t, nw); id != 0 {
			t.Fatalf("worker ID %d, want 0 (the one the old worker held)", id)
		}
		if ids, err := nw.AppendIDs(nil, 100); !errors.Is(err, ErrClockBackwards) {
			t.Fatalf("AppendIDs with the clock behind the old bound = %d IDs, %v; want %v", len(ids), err, ErrClockBackwards)
		}
		behind.Add(2 * time.Second)
		// The jump outlasts the lease: the worker fences itself until its
		// next heartbeat renews it.
		var after []int64
		for deadline := time.Now().Add(10 * time.Second); ; {
			if after, err = nw.AppendIDs(nil, 100); err == nil {
				break
			}
			if !errors.Is(err, ErrUnavailable) || time.Now().After(deadline) {
				t.Fatalf("AppendIDs with the clock past the old bound: %v", err)
			}
			time.Sleep(5 * time.Millisecond)
		}
		requireUnique(t, append(slices.Clone(before), after...))
		if got, want := slices.Min(after), slices.Max(before); got <= want {
			t.Errorf("new bucket's lowest ID %d, want above the old bucket's highest %d", got, want)
		}
	})
	t.Run("predecessor held", func(t *testing.T) {
		js := newJetStream(t)
		startWorker(t, js, NodeSettings{Instance: "old", Settings: Settings{Logger: testLogger(t)}})
		_, err := tryStartWorker(t, js, NodeSettings{Instance: "new", Bucket: DefaultBucket + "_r0", Predecessor: DefaultBucket,
			Settings: Settings{Layout: layout, Logger: testLogger(t)}})
		if !errors.Is(err, ErrPredecessorInUse) {
			t.Fatalf("err = %v, want %v", err, ErrPredecessorInUse)
		}
	})
}

// TestRegionBitsDifferBetweenRegions: region 0 leases with 1 region bit
// (worker IDs 0..511); region 1's first worker, with 2 region bits
// (256..511), is refused when it would create its bucket, for the two
// buckets know nothing of each other. (Without NodeSettings.Siblings it
// started, on worker IDs region 0 may hold.) With 1 bit, it starts.
func TestRegionBitsDifferBetweenRegions(t *testing.T) {
	js := newJetStream(t)
	layout := func(bits int) Layout { l := DefaultLayout; l.RegionBits = bits; return l }
	start := func(region, bits int) (*Node, error) {
		return tryStartWorker(t, js, NodeSettings{Instance: fmt.Sprintf("r%d", region), Bucket: fmt.Sprintf("leases_r%d", region),
			Siblings: "leases_r", Region: region, Settings: Settings{Layout: layout(bits), Logger: testLogger(t)}})
	}
	if _, err := start(0, 1); err != nil {
		t.Fatalf("region 0: %v", err)
	}
	if w, err := start(1, 2); !errors.Is(err, ErrLayoutMismatch) {
		if w != nil {
			id, _ := w.WorkerID()
			t.Fatalf("region 1 with 2 region bits started on worker ID %d, want %v", id, ErrLayoutMismatch)
		}
		t.Fatalf("region 1 with 2 region bits: %v, want %v", err, ErrLayoutMismatch)
	}
	if _, err := start(1, 1); err != nil {
		t.Fatalf("region 1 with 1 region bit: %v", err)
	}
}

// TestRegionBitsTurnedOff: once a region's bucket exists, a worker
// without region bits on the bucket without them is refused: the
// region's workers may hold its worker IDs now, or have issued above its
// bounds. (Without NodeSettings.RegionBuckets it started.)
func TestRegionBitsTurnedOff(t *testing.T) {
	js := newJetStream(t)
	layout := DefaultLayout
	layout.RegionBits = 1
	startWorker(t, js, NodeSettings{Instance: "r0", Bucket: "leases_r0", Settings: Settings{Layout: layout, Logger: testLogger(t)}})
	w, err := tryStartWorker(t, js, NodeSettings{Instance: "plain", Bucket: "leases", RegionBuckets: "leases_r", Settings: Settings{Logger: testLogger(t)}})
	if !errors.Is(err, ErrRegionBuckets) {
		if w != nil {
			id, _ := w.WorkerID()
			t.Fatalf("a worker without region bits started on worker ID %d, want %v", id, ErrRegionBuckets)
		}
		t.Fatalf("a worker without region bits: %v, want %v", err, ErrRegionBuckets)
	}
}
