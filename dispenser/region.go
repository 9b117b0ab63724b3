package dispenser

import (
	"fmt"
	"strconv"

	"github.com/dispenser-dev/dispenser/tagmodel"
)

// Region places a worker in one region of a NATS supercluster
// (docs/regions.md): the one region type of the worker (worker.Region is
// this type), its service's peer check (Config.Region) and the flags. The
// zero value is a deployment without regions, as before regions existed.
// What the segment store knows of regions, the mapping of its values to
// IDs, is tagmodel.Regions (Segments): persisted with the store, it has no
// snowflake bits.
type Region struct {
	// N is this worker's region, 0-based (--region).
	N int
	// Bits are carved out of the snowflake worker ID for the region
	// (--region-bits): region N holds worker IDs N×2^(10-Bits) up to the
	// next region's, leased from a bucket of its own, placed in its own
	// cluster. 0: one lease bucket for all.
	Bits int
	// Count is the number of regions with segment stores of their own
	// (--regions): region N of Count hands out the values v of its own
	// store as IDs v×Count+N. 0 or 1: one store for all regions (shared
	// mode).
	Count int
}

// On reports whether the worker is region-aware.
func (r Region) On() bool { return r.Bits > 0 || r.Count > 1 }

// PerRegionStores reports whether each region has its own segment store.
func (r Region) PerRegionStores() bool { return r.Count > 1 }

// PerRegionLeases reports whether each region has its own snowflake lease
// bucket.
func (r Region) PerRegionLeases() bool { return r.Bits > 0 }

// Segments are the allocator's region settings.
func (r Region) Segments() tagmodel.Regions {
	if !r.PerRegionStores() {
		return tagmodel.Regions{}
	}
	return tagmodel.Regions{Count: r.Count, Region: r.N}
}

// Name returns bucket with the region's suffix ("_r1") if bucket is
// empty or def (the default name) and local says the bucket is the
// region's own: stream names are global in a supercluster, so each region
// needs its own names. A name the operator chose is kept.
func (r Region) Name(bucket, def string, local bool) string {
	if bucket == "" {
		bucket = def
	}
	if !local || bucket != def {
		return bucket
	}
	return def + "_r" + strconv.Itoa(r.N)
}

// Check validates r (worker.New does, and wraps the error with
// worker.ErrConfig: worker.CheckRegion).
func (r Region) Check() error {
	switch {
	case r.Bits < 0 || r.Bits > 9:
		return fmt.Errorf("--region-bits %d: want 0..9 (at least one of the 10 snowflake worker bits stays the region's own)", r.Bits)
	case r.Count < 0 || r.Count > tagmodel.MaxRegions:
		return fmt.Errorf("--regions %d: want 1..%d", r.Count, tagmodel.MaxRegions)
	case r.N < 0:
		return fmt.Errorf("--region %d: want 0 or more", r.N)
	case r.N > 0 && !r.On():
		return fmt.Errorf("--region %d needs --region-bits (snowflake worker IDs per region) or --regions (a segment store per region)", r.N)
	case r.Bits > 0 && r.N >= 1<<r.Bits:
		return fmt.Errorf("--region %d does not fit in --region-bits %d (regions 0..%d)", r.N, r.Bits, 1<<r.Bits-1)
	case r.Count > 1 && r.N >= r.Count:
		return fmt.Errorf("--region %d: want below --regions %d", r.N, r.Count)
	}
	return nil
}

// String renders r for logs: "" without regions.
func (r Region) String() string {
	if !r.On() {
		return ""
	}
	return fmt.Sprintf("region %d (%s)", r.N, r.Settings())
}

// Settings renders the settings every region shares, for the peer check
// (RegionSettingsMetadata): "" without regions.
func (r Region) Settings() string {
	if !r.On() {
		return ""
	}
	return fmt.Sprintf("%d region bits, %d regions", r.Bits, max(r.Count, 1))
}
