// Package check holds the checkers every test suite runs over the IDs its
// clients received (dispenser, chaos, regions): every ID once, each
// worker's IDs increasing, and, for ordered tags, linearizable increase.
// A suite records its requests as Observations (or converts its own
// records), runs the checker, and reports what it finds in its own words:
// the checkers return what they found, so that a suite can name its
// clients, workers and faults. Each checker's self-test is in this
// package and shows that it fires on a crafted violation and passes a
// valid history.
package check

import (
	"cmp"
	"slices"
	"sort"
	"time"
)

// Observation is one request as its client saw it. Start is taken before
// the request is sent and End after its reply arrived, so the real
// interval lies within [Start, End]: "A ended before B started" judged
// from these times holds for the real events too.
type Observation struct {
	Start, End time.Time
	IDs        []int64 // the IDs it got, in any order
	Client     string  // who asked, for messages
	Worker     string  // who answered, for messages
	Err        error   // a failed request; the checkers skip it
}

// Min returns the smallest of o's IDs; o has at least one.
func (o Observation) Min() int64 { return slices.Min(o.IDs) }

// Max returns the largest of o's IDs; o has at least one.
func (o Observation) Max() int64 { return slices.Max(o.IDs) }

// answered reports whether o counts: no error and at least one ID.
func (o Observation) answered() bool { return o.Err == nil && len(o.IDs) > 0 }

// Examples is how many examples Linearizable returns at most.
const Examples = 5

// Violation is a request Late that started after Early ended and got an
// ID not above every ID of Early (Late.Min() <= Early.Max()). Early is the
// request with the largest ID among all that ended before Late started.
type Violation struct {
	Late, Early Observation
}

// Linearizable returns the number of requests B that got an ID not above
// every ID of a request A that ended before B started (A.End before
// B.Start), and the first few of them (Examples) in the order of obs:
// zero means the observations increase linearizably, as an ordered tag
// promises. Concurrent requests may interleave. Failed requests and
// requests without IDs are skipped.
//
// The algorithm: sort by end time, keep the running maximum, and compare
// each request's smallest ID with the maximum of those that ended before
// it started.
func Linearizable(obs []Observation) (violations int, examples []Violation) {
	return LinearizableFrom(obs, time.Time{})
}

// LinearizableFrom is Linearizable for the requests that started at or
// after from, each against every request that ended before it started
// (those that started before from included).
func LinearizableFrom(obs []Observation, from time.Time) (violations int, examples []Violation) {
	var byEnd []Observation
	for _, o := range obs {
		if o.answered() {
			byEnd = append(byEnd, o)
		}
	}
	slices.SortStableFunc(byEnd, func(a, b Observation) int { return a.End.Compare(b.End) })
	prefixMax := make([]int, len(byEnd)) // index into byEnd of the largest ID in byEnd[:i+1]
	maxOf := make([]int64, len(byEnd))
	for i, o := range byEnd {
		prefixMax[i], maxOf[i] = i, o.Max()
		if i > 0 && maxOf[prefixMax[i-1]] >= maxOf[i] {
			prefixMax[i] = prefixMax[i-1]
		}
	}
	for _, b := range obs {
		if !b.answered() || b.Start.Before(from) {
			continue
		}
		// The requests that ended before b started: byEnd[:k].
		k := sort.Search(len(byEnd), func(i int) bool { return !byEnd[i].End.Before(b.Start) })
		if k == 0 {
			continue
		}
		if a := prefixMax[k-1]; maxOf[a] >= b.Min() {
			violations++
			if len(examples) < Examples {
				examples = append(examples, Violation{Late: b, Early: byEnd[a]})
			}
		}
	}
	return violations, examples
}

// Duplicate is an ID handed out more than once, with every request that
// got it, in the order of the observations.
type Duplicate struct {
	ID int64
	By []Observation
}

// Uniqueness is what Unique found.
type Uniqueness struct {
	IDs        int         // every ID received, duplicates counted each time
	Distinct   int         // different IDs
	Duplicates []Duplicate // the IDs received more than once, by ID
}

// Unique checks that every ID was received once, across all observations
// (failed ones skipped), and returns every ID received more than once.
func Unique(obs []Observation) Uniqueness {
	type at struct {
		id  int64
		obs int
	}
	var all []at
	for i, o := range obs {
		if o.Err != nil {
			continue
		}
		for _, id := range o.IDs {
			all = append(all, at{id, i})
		}
	}
	slices.SortStableFunc(all, func(a, b at) int { return cmp.Compare(a.id, b.id) })
	u := Uniqueness{IDs: len(all)}
	for i := 0; i < len(all); {
		j := i + 1
		for j < len(all) && all[j].id == all[i].id {
			j++
		}
		u.Distinct++
		if j-i > 1 {
			d := Duplicate{ID: all[i].id}
			for _, a := range all[i:j] {
				d.By = append(d.By, obs[a.obs])
			}
			u.Duplicates = append(u.Duplicates, d)
		}
		i = j
	}
	return u
}

// Increasing checks that each worker's IDs, in the order one sequential
// client received them, strictly increase: a worker issues in increasing
// order and the client waited for each reply. Use one per client. The
// zero value is ready to use; it is not safe for concurrent use.
type Increasing struct {
	last map[any]int64
}

// Next records that the client received id from worker (any comparable
// key: a worker's name, or a worker and its snowflake worker bits). It
// returns the worker's previous ID and false if id is not above it.
func (c *Increasing) Next(worker any, id int64) (prev int64, ok bool) {
	if c.last == nil {
		c.last = map[any]int64{}
	}
	prev, seen := c.last[worker]
	c.last[worker] = id
	if seen && id <= prev {
		return prev, false
	}
	return prev, true
}
