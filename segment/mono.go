package segment

import "time"

// monoStart is the origin of monoNow.
var monoStart = time.Now()

// monoNow returns the time elapsed since the package was loaded, on the
// monotonic clock: an int64 to keep in a per-tag field (a time.Time takes
// 24 bytes), comparable across goroutines whatever the wall clock does.
func monoNow() int64 { return int64(time.Since(monoStart)) }
