package htmlpage

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"sort"
	"strconv"
	"sync"
	"time"
)

// SnapshotEvery is how often a monitoring view (the status page, Leaf's
// /cache and /db) is computed at most: every viewer in between gets the
// same snapshot, so that a client looping a view costs the worker one
// computation a second, whatever it asks.
const SnapshotEvery = time.Second

// Snapshot caches a view's value for SnapshotEvery. The zero value is not
// usable: set Compute.
type Snapshot[T any] struct {
	// Compute computes the value; an error is returned and not cached.
	Compute func(context.Context) (T, error)
	// OnCompute, if not nil, is called before each computation (tests
	// count them).
	OnCompute func()

	// mu protects at and val; it is held while computing, so that viewers
	// arriving meanwhile wait for that one computation and share it.
	mu  sync.Mutex
	at  time.Time // when val was computed; zero: never
	val T
}

// Get returns the value computed less than SnapshotEvery ago, or computes
// it now.
func (s *Snapshot[T]) Get(ctx context.Context) (T, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.at.IsZero() && time.Since(s.at) < SnapshotEvery {
		return s.val, nil
	}
	if s.OnCompute != nil {
		s.OnCompute()
	}
	v, err := s.Compute(ctx)
	if err != nil {
		var zero T
		return zero, err
	}
	s.val, s.at = v, time.Now()
	return v, nil
}

// MaxLimit is the most rows one page of a view may ask for.
const MaxLimit = 10_000

// ErrBadPage means a view's paging parameters are malformed (400).
var ErrBadPage = errors.New("bad paging parameters")

// Page is a page of a view sorted by name: the rows after the name After
// (from the first if empty), at most Limit of them.
type Page struct {
	After string
	Limit int
}

// ParsePage reads ?after=NAME&limit=N from q; limit defaults to
// defaultLimit and may be 1..MaxLimit.
func ParsePage(q url.Values, defaultLimit int) (Page, error) {
	p := Page{Limit: defaultLimit}
	if v, ok := q["after"]; ok {
		if len(v) != 1 {
			return Page{}, fmt.Errorf("%w: after given %d times", ErrBadPage, len(v))
		}
		p.After = v[0]
	}
	if v, ok := q["limit"]; ok {
		n, err := strconv.Atoi(v[0])
		if len(v) != 1 || err != nil || n < 1 || n > MaxLimit {
			return Page{}, fmt.Errorf("%w: limit %q: want one number 1..%d", ErrBadPage, v[0], MaxLimit)
		}
		p.Limit = n
	}
	return p, nil
}

// Cut returns the rows of items (sorted by name) on page p, and the name
// to give as after for the next page ("" if none).
func (p Page) Cut(n int, name func(i int) string) (from, to int, next string) {
	from = sort.Search(n, func(i int) bool { return name(i) > p.After })
	to = min(n, from+p.Limit)
	if to < n {
		next = name(to - 1)
	}
	return from, to, next
}
