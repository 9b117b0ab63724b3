package tagmodel

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/dispenser-dev/dispenser/protocol"
)

// Errors returned by the allocator and by stores. Stores wrap them with %w so
// that callers can test with errors.Is.
var (
	// ErrUnknownTag means the tag does not exist in the store.
	ErrUnknownTag = errors.New("segment: unknown tag")
	// ErrTagExists means a tag could not be created because it already exists.
	ErrTagExists = errors.New("segment: tag already exists")
	// ErrTagDeleted means a tag could not be created because the store
	// remembers that it existed and was deleted: created again from its
	// start, it would hand out IDs it handed out before. Nothing changes.
	ErrTagDeleted = errors.New("segment: tag was deleted")
	// ErrInvalidTag means a tag name is not a valid single NATS subject token
	// of 1 to 128 characters from [A-Za-z0-9_-].
	ErrInvalidTag = errors.New("segment: invalid tag")
	// ErrInvalidStep means a step is not in 1..MaxStepLimit.
	ErrInvalidStep = errors.New("segment: invalid step")
	// ErrInvalidArgument means a start, description or give-back range is
	// out of bounds (Tag.Check, Update.Check, CheckGiveBack).
	ErrInvalidArgument = errors.New("segment: invalid argument")
	// ErrExhausted means a fetch would push a tag's max_id past 2^63-1: the
	// tag has run out of IDs.
	ErrExhausted = errors.New("segment: tag exhausted")
	// ErrPeriodExpired means a period of a tag with a reset period ended
	// longer ago than the tag keeps its periods' rows (a clock far behind):
	// its sequence is not started again, which would repeat its numbers.
	ErrPeriodExpired = errors.New("segment: period expired")
)

// MaxStepLimit is the largest step a tag may have: leaf_alloc.step is a
// Postgres int.
const MaxStepLimit = 1<<31 - 1

// MaxDescription is the most characters (not bytes) a tag's description may
// have: leaf_alloc.description is a Postgres varchar(256).
const MaxDescription = 256

// Tag is one row of the store: a business key and its sequence state.
type Tag struct {
	Name        string
	MaxID       int64 // the next segment starts here
	Step        int64 // configured step; the dynamic step never goes below it
	Description string
	// Ordered marks a tag created or updated with --ordered: its IDs are
	// linearizably increasing across all workers (once a client has
	// received IDs of the tag, every request sent after that, by any
	// client to any worker, gets larger ones), not only within each
	// worker as for a plain tag. Stores keep it with the tag; a tag stored
	// without it (a Leaf row, a value written before ordered tags) is not
	// ordered.
	Ordered bool
	// Reset is the tag's reset period (ResetNone: none), TimeZone the IANA
	// time zone its periods are counted in ("": UTC), Format its number
	// format template ("": none; see ParseFormat), RetentionDays how many
	// days a period's row is kept after the period ended (0:
	// DefaultRetentionDays). Tag.Periodic reads them, checked together. A tag with
	// a reset period hands out no IDs from its own row: each period is a
	// row of its own (PeriodName), created from the tag's max_id and step
	// on the period's first fetch; the tag's max_id stays the start of
	// every period. Stores keep them with the tag; a tag stored without
	// them (a Leaf row, a value written before periodic tags) has none.
	Reset         Reset
	TimeZone      string
	Format        string
	RetentionDays int
	UpdateTime    time.Time
}

// Update is a change of a tag's settings for Admin.UpdateTag: each
// non-nil field is set, each nil one left as it is. MaxID cannot be
// changed this way.
type Update struct {
	Step        *int64  // new configured step, in 1..MaxStepLimit
	Description *string // new description (Update.Check)
	Ordered     *bool   // make the tag ordered or plain (see Tag.Ordered)
	// Reset sets a reset period on a tag without one (a tag's reset
	// period, once set, cannot change: ErrInvalidArgument); TimeZone,
	// Format and RetentionDays as Tag's. The tag as updated must pass
	// Tag.Check, or nothing changes (ErrInvalidArgument).
	Reset         *Reset
	TimeZone      *string
	Format        *string
	RetentionDays *int
}

// Allocation is a segment fetched from the store: the IDs Start..End-1 now
// belong to the caller and to nobody else.
type Allocation struct {
	Start int64
	End   int64 // exclusive; equals the tag's max_id after the fetch
	// TagStep is the tag's configured step as stored at the time of the fetch.
	TagStep int64
}

// Store is the durable home of the tags' sequences. Implementations must be
// safe for concurrent use by many allocators in many processes: two Fetch
// calls, wherever they run, never return overlapping allocations.
type Store interface {
	// Fetch atomically advances the tag's max_id by step and returns the
	// segment [old max_id, new max_id). A step <= 0 means the tag's own
	// configured step. An unknown tag yields ErrUnknownTag.
	//
	// tag may also be a period name (PeriodName: tag=KEY) of a tag with a
	// reset period: Fetch then advances that period's row, and creates it
	// if missing, from the tag's max_id and step, in one atomic operation
	// (two fetches of a new period, wherever they run, never overlap).
	// Errors: ErrUnknownTag (no such tag), ErrInvalidArgument (the tag has
	// no reset period, or KEY is not one of its periods), ErrPeriodExpired
	// (the period's row is missing and the period ended more than the
	// tag's retention ago, by the store's clock; a period's row is never
	// created again once pruned).
	Fetch(ctx context.Context, tag string, step int64) (Allocation, error)
	// Tags lists the names of all tags.
	Tags(ctx context.Context) ([]string, error)
	// Tag looks up one tag; an unknown tag yields ErrUnknownTag.
	Tag(ctx context.Context, name string) (Tag, error)
	// GiveBack sets the tag's max_id to firstUnissued, but only if max_id is
	// still end (nobody fetched after us). It reports whether it did.
	GiveBack(ctx context.Context, tag string, end, firstUnissued int64) (bool, error)
}

// Admin is implemented by stores that can create and change tags. Invalid
// fields (Tag.Check, Update.Check) yield ErrInvalidTag, ErrInvalidStep
// or ErrInvalidArgument and change nothing.
type Admin interface {
	// CreateTag adds the tag t: t.Name with step t.Step, first ID t.MaxID
	// (>= 1), t.Description and t.Ordered; the store sets the update time
	// (t.UpdateTime is ignored). An existing tag yields ErrTagExists and
	// changes nothing.
	CreateTag(ctx context.Context, t Tag) error
	// UpdateTag sets the fields of u that are not nil on the tag name and
	// leaves the others, and max_id, as they are. An unknown tag yields
	// ErrUnknownTag.
	UpdateTag(ctx context.Context, name string, u Update) error
}

// ValidTag reports whether name is a valid tag: 1 to 128 characters from
// [A-Za-z0-9_-], so that it is always a single NATS subject token. It is
// the wire protocol's rule (protocol.ValidTag).
func ValidTag(name string) bool { return protocol.ValidTag(name) }

// CheckTag returns nil for a valid tag and an error wrapping ErrInvalidTag
// otherwise.
func CheckTag(name string) error {
	if !ValidTag(name) {
		return fmt.Errorf("%w %q: want %s", ErrInvalidTag, name, protocol.TagRule)
	}
	return nil
}

// CheckGiveBack returns nil if firstUnissued, the first ID a give-back of
// the segment ending at end returns to the store, is in 1..end, and an error
// wrapping ErrInvalidArgument otherwise.
func CheckGiveBack(end, firstUnissued int64) error {
	if firstUnissued < 1 || firstUnissued > end {
		return fmt.Errorf("%w: first unissued ID %d not in 1..%d", ErrInvalidArgument, firstUnissued, end)
	}
	return nil
}

// PeriodPruner is implemented by stores that keep periods' rows (every
// Admin store): PrunePeriods deletes the rows of periods that ended more
// than their tag's retention ago, by the store's clock, so that they are
// never created again (Fetch then answers ErrPeriodExpired), and returns
// how many it deleted. The Allocator calls it at every refresh.
type PeriodPruner interface {
	PrunePeriods(ctx context.Context) (int, error)
}

// ChangeLister is implemented by stores that can tell what changed since an
// earlier call, so that an Allocator's refresh costs what changed rather than
// the number of tags.
type ChangeLister interface {
	// Changes returns the tags created or changed since cursor (and, where
	// the store can tell, deleted), possibly with some listed again, and
	// the cursor to pass next time. Cursor 0 lists nothing and returns the
	// store's current cursor.
	Changes(ctx context.Context, cursor int64) (changes []Change, next int64, err error)
}

// Change is one entry of ChangeLister.Changes.
type Change struct {
	Tag     Tag  // Name always; the other fields unless Deleted
	Deleted bool // the tag was deleted
}
