package snowflake

import (
	"errors"
	"fmt"
	"strings"
	"testing"
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
