package tagmodel

import (
	"context"
	"errors"
	"fmt"
	"math"
)

// ErrRegionMismatch means a store records other region settings than a
// worker's (Regions): a store serves one region of a set, and a worker of
// another region, or of another number of regions, would hand out IDs
// that a store of the other region hands out too.
var ErrRegionMismatch = errors.New("segment: store belongs to another region")

// Regions are the region settings of per-region stores (docs/regions.md):
// each of Count regions has a store of its own, whose sequence values v
// become IDs v×Count + Region. The IDs of different regions are distinct
// (their residues modulo Count differ), and each region's IDs of a tag
// still increase. The zero value (and Count 1) is one store for all: IDs
// are the store's values.
type Regions struct {
	// Count is the number of regions, 1..MaxRegions; 0 means 1.
	Count int `json:"regions"`
	// Region is this store's region, 0..Count-1.
	Region int `json:"region"`
}

// MaxRegions bounds Regions.Count.
const MaxRegions = 64

// Check validates r.
func (r Regions) Check() error {
	if r.Count < 0 || r.Count > MaxRegions || r.Region < 0 || r.Region >= max(r.Count, 1) {
		return fmt.Errorf("%w: region %d of %d regions: want 1..%d regions and a region below their number", ErrInvalidArgument, r.Region, r.Count, MaxRegions)
	}
	return nil
}

// Split reports whether IDs are mapped (more than one region).
func (r Regions) Split() bool { return r.Count > 1 }

// MaxValue is the largest store value whose ID fits in an int64.
func (r Regions) MaxValue() int64 {
	if !r.Split() {
		return math.MaxInt64
	}
	return (math.MaxInt64 - int64(r.Region)) / int64(r.Count)
}

// ID returns the ID of store value v: v×Count+Region with regions, v
// without.
func (r Regions) ID(v int64) int64 {
	if !r.Split() {
		return v
	}
	return v*int64(r.Count) + int64(r.Region)
}

// String renders r as "region 1 of 3" ("one region" without regions).
func (r Regions) String() string {
	if !r.Split() {
		return "one region"
	}
	return fmt.Sprintf("region %d of %d", r.Region, r.Count)
}

// A RegionStore records the region settings of its data (Regions), so that
// a worker of another region, or configured for another number of regions,
// is refused (CheckRegions).
type RegionStore interface {
	// ReadRegions returns the recorded settings; found is false if none
	// are recorded.
	ReadRegions(ctx context.Context) (r Regions, found bool, err error)
	// CreateRegions records r if nothing is recorded yet; ErrTagExists if
	// something is (another worker recorded first).
	CreateRegions(ctx context.Context, r Regions) error
	// Tags lists the store's tags.
	Tags(ctx context.Context) ([]string, error)
}

// CheckRegions makes sure store serves r, and records r in a store that
// records nothing yet, so that every worker that serves from the store
// serves it with the same settings.
//
// A store that records settings must record r (ErrRegionMismatch
// otherwise). A store that records none is recorded now: for one region
// whatever it holds (it has served as one region, if at all); for
// per-region settings only if it holds no tag yet, and refused
// (ErrRegionMismatch) if it does: its IDs were handed out unmapped, and the
// other regions' IDs could meet them.
//
// Safety argument: the record is created only if absent (CreateRegions, an
// atomic create), and nothing in dispenser changes or removes it; a worker
// passes only once it has read a record equal to its own settings (or
// created it). So any two workers that fetch from one store have read the
// same record and serve it with the same settings, whatever their prefix,
// queue group or start order, and whatever the store held when each
// started. One region is recorded too (Count 1): before it was, a worker
// without regions passed on an empty store without a trace, a per-region
// worker started later recorded its own settings, and both served the same
// store, one handing out v and the other v×R+N: the same IDs
// (worker/pgstore TestRegionSettingsOfOneStore, and the conformance suite's
// Regions test for every store).
func CheckRegions(ctx context.Context, store RegionStore, r Regions) error {
	return checkRegions(ctx, store, r, true)
}

// MatchRegions is CheckRegions without recording anything: for commands
// that only read a store (tags list), so that reading a new store with the
// wrong flags does not bind it to them.
func MatchRegions(ctx context.Context, store RegionStore, r Regions) error {
	return checkRegions(ctx, store, r, false)
}

func checkRegions(ctx context.Context, store RegionStore, r Regions, record bool) error {
	if err := r.Check(); err != nil {
		return err
	}
	for attempt := 1; ; attempt++ {
		got, found, err := store.ReadRegions(ctx)
		if err != nil {
			return fmt.Errorf("segment: read the store's regions: %w", err)
		}
		switch {
		case found && got.Count == max(r.Count, 1) && got.Region == r.Region:
			return nil
		case found:
			return fmt.Errorf("%w: the store serves %s, this worker %s: "+
				"in per-region mode each region has a store of its own (docs/regions.md)", ErrRegionMismatch, got, r)
		case !record:
			return nil
		}
		if r.Split() {
			tags, err := store.Tags(ctx)
			if err != nil {
				return fmt.Errorf("segment: read the store's regions: %w", err)
			}
			if len(tags) > 0 {
				return fmt.Errorf("%w: the store holds %d tags (%q first) handed out as one region; "+
					"%s needs a store of its own, created for it (docs/regions.md)", ErrRegionMismatch, len(tags), tags[0], r)
			}
		}
		err = store.CreateRegions(ctx, Regions{Count: max(r.Count, 1), Region: r.Region})
		if err == nil {
			return nil
		}
		if !errors.Is(err, ErrTagExists) || attempt == 3 {
			return fmt.Errorf("segment: record the store's regions: %w", err)
		}
	}
}
