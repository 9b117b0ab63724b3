package storetest

import (
	"context"
	"errors"
	"sync"
	"testing"

	"github.com/dispenser-dev/dispenser/tagmodel"
)

// testRegions: a store records its region settings once
// (tagmodel.CheckRegions), one region included, refuses other settings,
// hides the record from every listing, and refuses per-region mode when it
// already holds tags handed out as one region.
func testRegions(t *testing.T, c Config) {
	s := newStore(t, c)
	rs, ok := s.(tagmodel.RegionStore)
	if !ok {
		t.Fatalf("%T is not a tagmodel.RegionStore", s)
	}
	if _, found, err := rs.ReadRegions(ctx(t)); err != nil || found {
		t.Fatalf("ReadRegions of a new store = found %v, %v; want nothing", found, err)
	}
	if c.NoPerRegion {
		for _, r := range []tagmodel.Regions{{Count: 3, Region: 1}, {Count: 2}} {
			if err := tagmodel.CheckRegions(ctx(t), rs, r); !errors.Is(err, tagmodel.ErrInvalidArgument) {
				t.Errorf("CheckRegions(%+v) = %v, want %v: the store refuses per-region mode", r, err, tagmodel.ErrInvalidArgument)
			}
		}
		if _, found, err := rs.ReadRegions(ctx(t)); err != nil || found {
			t.Fatalf("after refusals ReadRegions = found %v, %v; want nothing", found, err)
		}
	} else {
		testPerRegionRecord(t, s, rs)
	}
	testOneRegionRecord(t, c)
	testRegionsAfterTags(t, c)
}

// testPerRegionRecord: per-region settings are recorded once, other
// settings refused, and the record is no tag.
func testPerRegionRecord(t *testing.T, s Store, rs tagmodel.RegionStore) {
	want := tagmodel.Regions{Count: 3, Region: 1}
	// Workers of one region starting together all pass; of two regions
	// at most one does.
	var wg sync.WaitGroup
	errs := make([]error, 6)
	for i := range errs {
		r := want
		if i%2 == 1 {
			r.Region = 2
		}
		wg.Go(func() { errs[i] = tagmodel.CheckRegions(ctx(t), rs, r) })
	}
	wg.Wait()
	won := map[int]bool{}
	for i, err := range errs {
		switch {
		case err == nil:
			won[i%2] = true
		case !errors.Is(err, tagmodel.ErrRegionMismatch):
			t.Errorf("CheckRegions %d: %v, want nil or ErrRegionMismatch", i, err)
		}
	}
	if len(won) != 1 {
		t.Fatalf("regions that passed: %v, want exactly one", won)
	}
	got, found, err := rs.ReadRegions(ctx(t))
	if err != nil || !found {
		t.Fatalf("ReadRegions = found %v, %v", found, err)
	}
	if won[1] {
		want.Region = 2
	}
	if got != want {
		t.Fatalf("ReadRegions = %+v, want %+v", got, want)
	}
	for _, tc := range []struct {
		name string
		r    tagmodel.Regions
		want error
	}{
		{"same", want, nil},
		{"other region", tagmodel.Regions{Count: 3, Region: (want.Region + 1) % 3}, tagmodel.ErrRegionMismatch},
		{"other count", tagmodel.Regions{Count: 4, Region: want.Region}, tagmodel.ErrRegionMismatch},
		{"one region", tagmodel.Regions{}, tagmodel.ErrRegionMismatch},
		{"invalid", tagmodel.Regions{Count: 3, Region: 3}, tagmodel.ErrInvalidArgument},
	} {
		if err := tagmodel.CheckRegions(ctx(t), rs, tc.r); !errors.Is(err, tc.want) {
			t.Errorf("%s: CheckRegions(%+v) = %v, want %v", tc.name, tc.r, err, tc.want)
		}
	}
	if err := rs.CreateRegions(ctx(t), tagmodel.Regions{Count: 2}); !errors.Is(err, tagmodel.ErrTagExists) {
		t.Errorf("CreateRegions over a record = %v, want ErrTagExists", err)
	}
	if names, err := s.Tags(ctx(t)); err != nil || len(names) != 0 {
		t.Errorf("Tags lists %q (%v): the record is not a tag", names, err)
	}
	if cl, ok := s.(tagmodel.ChangeLister); ok {
		if changes, _, err := cl.Changes(ctx(t), 0); err != nil || len(changes) != 0 {
			t.Errorf("Changes lists %v (%v): the record is not a tag", changes, err)
		}
	}

}

// testOneRegionRecord: one region is recorded as well.
func testOneRegionRecord(t *testing.T, c Config) {
	// One region is recorded too, on an empty store: a worker of
	// per-region mode started later on it would hand out v×R+N beside the
	// first one's v (TestRegionSettingsOfOneStore in worker/pgstore). A
	// read (MatchRegions) records nothing.
	oneStore := newStore(t, c)
	one := oneStore.(tagmodel.RegionStore)
	if err := tagmodel.MatchRegions(ctx(t), one, tagmodel.Regions{Count: 2, Region: 1}); err != nil {
		t.Fatalf("MatchRegions on a new store = %v", err)
	}
	if _, found, _ := one.ReadRegions(ctx(t)); found {
		t.Fatal("MatchRegions recorded settings")
	}
	if err := tagmodel.CheckRegions(ctx(t), one, tagmodel.Regions{}); err != nil {
		t.Fatalf("CheckRegions(one region) = %v", err)
	}
	if got, found, err := one.ReadRegions(ctx(t)); err != nil || !found || got != (tagmodel.Regions{Count: 1}) {
		t.Fatalf("after CheckRegions(one region): ReadRegions = %+v, found %v, %v; want one region recorded", got, found, err)
	}
	for _, tc := range []struct {
		name string
		r    tagmodel.Regions
		want error
	}{
		{"one region again", tagmodel.Regions{}, nil},
		{"Count 1", tagmodel.Regions{Count: 1}, nil},
		{"per-region after one region", tagmodel.Regions{Count: 2, Region: 1}, tagmodel.ErrRegionMismatch},
		{"per-region region 0 after one region", tagmodel.Regions{Count: 2}, tagmodel.ErrRegionMismatch},
	} {
		for name, check := range map[string]func(context.Context, tagmodel.RegionStore, tagmodel.Regions) error{
			"CheckRegions": tagmodel.CheckRegions, "MatchRegions": tagmodel.MatchRegions} {
			if err := check(ctx(t), one, tc.r); !errors.Is(err, tc.want) {
				t.Errorf("%s: %s(%+v) = %v, want %v", tc.name, name, tc.r, err, tc.want)
			}
		}
	}
	if names, err := oneStore.Tags(ctx(t)); err != nil || len(names) != 0 {
		t.Errorf("Tags lists %q (%v): the one-region record is not a tag", names, err)
	}

}

// testRegionsAfterTags: per-region settings are refused on a store that
// handed out IDs as one region, which stays as it was.
func testRegionsAfterTags(t *testing.T, c Config) {
	// A store that handed out IDs as one region is refused, and stays so.
	old := newStore(t, c)
	createTag(t, old, "orders", 10, 1)
	before := snapshot(t, old)
	if err := tagmodel.CheckRegions(ctx(t), old.(tagmodel.RegionStore), tagmodel.Regions{Count: 2}); !errors.Is(err, tagmodel.ErrRegionMismatch) {
		t.Fatalf("CheckRegions on a store with tags = %v, want ErrRegionMismatch", err)
	}
	if _, found, _ := old.(tagmodel.RegionStore).ReadRegions(ctx(t)); found {
		t.Error("refused, but recorded")
	}
	checkUnchanged(t, old, before, "a refused CheckRegions")
}
