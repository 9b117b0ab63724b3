package segment

import "errors"

// Errors of the allocator engine; the tag model's errors (unknown tag,
// invalid settings, exhausted, ...) are package tagmodel's, and stores wrap
// those. Callers test with errors.Is.
var (
	// ErrInvalidCount means a request asked for fewer than one ID.
	ErrInvalidCount = errors.New("segment: invalid count")
	// ErrUnavailable means no segment could be had within the wait: the store
	// is slow or down and both buffers are empty.
	ErrUnavailable = errors.New("segment: no segment available")
	// ErrClosed means the allocator is shutting down.
	ErrClosed = errors.New("segment: allocator closed")
	// ErrOrdered means the tag is ordered: only its owner serves it, with
	// TakeOwned (see package ownership).
	ErrOrdered = errors.New("segment: ordered tag")
)
