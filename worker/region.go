package worker

import (
	"fmt"

	"github.com/dispenser-dev/dispenser/dispenser"
)

// Region places a worker in one region of a NATS supercluster: the type
// is dispenser.Region, the one region type.
type Region = dispenser.Region

// CheckRegion validates r (New does): Region.Check's error as an
// ErrConfig.
func CheckRegion(r Region) error {
	if err := r.Check(); err != nil {
		return fmt.Errorf("%w: %w", ErrConfig, err)
	}
	return nil
}
