package check_test

import (
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/dispenser-dev/dispenser/internal/tests/check"
)

var t0 = time.Now()

// at returns the instant ms milliseconds after t0.
func at(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }

// obs returns a request that started at ms start, ended at ms end and got ids.
func obs(start, end int, ids ...int64) check.Observation {
	return check.Observation{Start: at(start), End: at(end), IDs: ids}
}

// TestCheckLinearizable checks the checker of linearizable increase both
// ways: a reply not above one answered before the request was sent is
// caught; concurrent requests may interleave. (It replaces the copies in
// dispenser/ordered_test.go and internal/tests/chaos, which tested their
// own copies of the checker.)
func TestCheckLinearizable(t *testing.T) {
	tests := []struct {
		name string
		obs  []check.Observation
		want int
	}{
		{"increasing", []check.Observation{obs(0, 1, 1, 2), obs(2, 3, 3)}, 0},
		{"concurrent may interleave", []check.Observation{obs(0, 5, 5), obs(1, 4, 4)}, 0},
		{"smaller after an answer", []check.Observation{obs(0, 1, 5), obs(2, 3, 4)}, 1},
		{"equal after an answer", []check.Observation{obs(0, 1, 3, 4), obs(2, 3, 4, 5)}, 1},
		{"IDs in any order", []check.Observation{obs(0, 1, 4, 3), obs(2, 3, 5, 4)}, 1},
		{"later but not after", []check.Observation{obs(0, 3, 5), obs(2, 4, 4)}, 0},
		{"sent the instant the other was answered", []check.Observation{obs(0, 2, 5), obs(2, 3, 4)}, 0},
		{"below an earlier answer, not the latest", []check.Observation{
			obs(0, 1, 9), obs(2, 3, 10), obs(1, 4, 2), obs(5, 6, 8)}, 1},
		{"two counters interleaved", []check.Observation{
			obs(0, 1, 1e6), obs(2, 3, 1), obs(4, 5, 1e6+1), obs(6, 7, 2)}, 2},
		{"failed requests and empty replies skipped", []check.Observation{
			obs(0, 1, 5), {Start: at(2), End: at(3), IDs: []int64{1}, Err: errors.New("503")}, obs(4, 5), obs(6, 7, 6)}, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, examples := check.Linearizable(tt.obs)
			if got != tt.want {
				t.Fatalf("violations = %d, want %d (%v)", got, tt.want, examples)
			}
			if len(examples) != min(got, check.Examples) {
				t.Fatalf("%d examples of %d violations, want %d", len(examples), got, min(got, check.Examples))
			}
		})
	}

	t.Run("example names both requests", func(t *testing.T) {
		early, late := obs(0, 1, 7, 9), obs(2, 3, 8)
		early.Worker, late.Worker = "a", "b"
		_, examples := check.Linearizable([]check.Observation{obs(0, 1, 3), early, late})
		if len(examples) != 1 || examples[0].Late.Worker != "b" || examples[0].Early.Worker != "a" ||
			examples[0].Late.Min() != 8 || examples[0].Early.Max() != 9 {
			t.Fatalf("examples = %+v, want b's 8 after a's 9", examples)
		}
	})
	t.Run("at most Examples examples", func(t *testing.T) {
		history := []check.Observation{obs(0, 1, 100)}
		for i := range 7 {
			history = append(history, obs(2+2*i, 3+2*i, int64(i)))
		}
		got, examples := check.Linearizable(history)
		if got != 7 || len(examples) != check.Examples {
			t.Fatalf("violations = %d with %d examples, want 7 with %d", got, len(examples), check.Examples)
		}
	})
	t.Run("from", func(t *testing.T) {
		// Out of order before from, in order from it on, but the first
		// request from it on is judged against those before it too.
		history := []check.Observation{obs(0, 1, 5), obs(2, 3, 4), obs(10, 11, 6), obs(12, 13, 7)}
		if got, _ := check.LinearizableFrom(history, at(10)); got != 0 {
			t.Errorf("from 10 ms: violations = %d, want 0", got)
		}
		if got, _ := check.LinearizableFrom(history, at(2)); got != 1 {
			t.Errorf("from 2 ms: violations = %d, want 1", got)
		}
		history = append(history, obs(14, 15, 5))
		if got, _ := check.LinearizableFrom(history, at(10)); got != 1 {
			t.Errorf("from 10 ms, a request below one answered before from: violations = %d, want 1", got)
		}
	})
}

// TestCheckUnique checks the duplicate check both ways, across
// observations and within one.
func TestCheckUnique(t *testing.T) {
	a, b, c := obs(0, 1, 1, 2, 3), obs(0, 1, 4, 5), obs(2, 3, 3, 6)
	a.Worker, b.Worker, c.Worker = "a", "b", "c"
	tests := []struct {
		name     string
		obs      []check.Observation
		distinct int
		want     map[int64][]string // duplicate ID -> the workers that handed it out
	}{
		{"unique", []check.Observation{a, b}, 5, nil},
		{"across requests", []check.Observation{a, b, c}, 6, map[int64][]string{3: {"a", "c"}}},
		{"within one request", []check.Observation{obs(0, 1, 7, 7)}, 1, map[int64][]string{7: {"", ""}}},
		{"three times", []check.Observation{a, c, a}, 4, map[int64][]string{1: {"a", "a"}, 2: {"a", "a"}, 3: {"a", "c", "a"}}},
		{"failed request skipped", []check.Observation{a, {IDs: []int64{1}, Err: errors.New("timeout")}}, 3, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			u := check.Unique(tt.obs)
			ids := 0
			for _, o := range tt.obs {
				if o.Err == nil {
					ids += len(o.IDs)
				}
			}
			if u.IDs != ids || u.Distinct != tt.distinct {
				t.Errorf("IDs, Distinct = %d, %d, want %d, %d", u.IDs, u.Distinct, ids, tt.distinct)
			}
			got := map[int64][]string{}
			for _, d := range u.Duplicates {
				for _, o := range d.By {
					got[d.ID] = append(got[d.ID], o.Worker)
				}
			}
			if len(got) != len(tt.want) {
				t.Fatalf("duplicates = %v, want %v", got, tt.want)
			}
			for id, want := range tt.want {
				if !slices.Equal(got[id], want) {
					t.Errorf("ID %d handed out by %v, want %v", id, got[id], want)
				}
			}
			if !slices.IsSortedFunc(u.Duplicates, func(x, y check.Duplicate) int { return int(x.ID - y.ID) }) {
				t.Errorf("duplicates not by ID: %v", u.Duplicates)
			}
		})
	}
}

// TestCheckIncreasing checks the per-worker increase check both ways: a
// worker going down or repeating an ID is caught, two workers interleaving
// are not.
func TestCheckIncreasing(t *testing.T) {
	type step struct {
		worker   string
		id       int64
		wantPrev int64 // when not ok
		ok       bool
	}
	tests := []struct {
		name  string
		steps []step
	}{
		{"increasing", []step{{"a", 1, 0, true}, {"a", 2, 0, true}, {"a", 10, 0, true}}},
		{"two workers interleaved", []step{{"a", 100, 0, true}, {"b", 1, 0, true}, {"a", 101, 0, true}, {"b", 2, 0, true}}},
		{"down", []step{{"a", 5, 0, true}, {"b", 1, 0, true}, {"a", 4, 5, false}, {"a", 6, 0, true}}},
		{"repeated", []step{{"a", 5, 0, true}, {"a", 5, 5, false}}},
		{"first ID may be anything", []step{{"a", -3, 0, true}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var c check.Increasing
			for i, s := range tt.steps {
				prev, ok := c.Next(s.worker, s.id)
				if ok != s.ok || (!ok && prev != s.wantPrev) {
					t.Fatalf("step %d, %s issued %d: Next = %d, %v, want %d, %v", i, s.worker, s.id, prev, ok, s.wantPrev, s.ok)
				}
			}
		})
	}
}
