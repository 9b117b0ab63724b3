package tagmodel

import (
	"errors"
	"math"
	"strings"
	"testing"
)

// checkSentinel fails the test unless err wraps want and none of the other
// sentinels of the checks; a nil want asks for a nil err.
func checkSentinel(t *testing.T, err, want error) {
	t.Helper()
	if want == nil {
		if err != nil {
			t.Fatalf("got error %v, want none", err)
		}
		return
	}
	if !errors.Is(err, want) {
		t.Fatalf("got error %v, want %v", err, want)
	}
	for _, other := range []error{ErrInvalidTag, ErrInvalidStep, ErrInvalidArgument} {
		if other != want && errors.Is(err, other) {
			t.Errorf("error %v also wraps %v", err, other)
		}
	}
}

func ptr[T any](v T) *T { return &v }

func TestCheckTagFields(t *testing.T) {
	tests := []struct {
		name        string
		tag         string
		step        *int64
		description *string
		want        error
	}{
		{name: "name only", tag: "orders"},
		{name: "smallest step, empty description", tag: "orders", step: ptr[int64](1), description: ptr("")},
		{name: "largest step", tag: "orders", step: ptr[int64](MaxStepLimit)},
		{name: "longest description in characters", tag: "orders", description: ptr(strings.Repeat("é", MaxDescription))},
		{name: "any text", tag: "orders", description: ptr("中文 ✓ \"quotes\" \\ <html> &\ttab\nnewline")},
		{name: "longest name, all characters", tag: strings.Repeat("aZ09_-", 21) + "xy"},
		{name: "empty name", tag: "", step: ptr[int64](10), want: ErrInvalidTag},
		{name: "name too long", tag: strings.Repeat("x", 129), want: ErrInvalidTag},
		{name: "dot in name", tag: "orders.eu", want: ErrInvalidTag},
		{name: "invalid name before invalid step", tag: "a b", step: ptr[int64](0), want: ErrInvalidTag},
		{name: "zero step", tag: "orders", step: ptr[int64](0), want: ErrInvalidStep},
		{name: "negative step", tag: "orders", step: ptr[int64](-1), want: ErrInvalidStep},
		{name: "step too large", tag: "orders", step: ptr[int64](MaxStepLimit + 1), want: ErrInvalidStep},
		{name: "step far too large", tag: "orders", step: ptr[int64](math.MaxInt64), want: ErrInvalidStep},
		{name: "invalid step before invalid description", tag: "orders", step: ptr[int64](0), description: ptr("\xff"), want: ErrInvalidStep},
		{name: "description too long", tag: "orders", description: ptr(strings.Repeat("d", MaxDescription+1)), want: ErrInvalidArgument},
		{name: "description too long in characters", tag: "orders", description: ptr(strings.Repeat("ß", MaxDescription+1)), want: ErrInvalidArgument},
		{name: "description not UTF-8", tag: "orders", description: ptr("\xff"), want: ErrInvalidArgument},
		{name: "description with a cut character", tag: "orders", description: ptr("ok\xc3"), want: ErrInvalidArgument},
		{name: "description with NUL", tag: "orders", description: ptr("a\x00b"), want: ErrInvalidArgument},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			checkSentinel(t, Update{Step: tt.step, Description: tt.description}.Check(tt.tag), tt.want)
			if tt.step != nil && tt.description != nil {
				_, err := Tag{Name: tt.tag, Step: *tt.step, Description: *tt.description, MaxID: 1}.Check()
				checkSentinel(t, err, tt.want)
			}
		})
	}
}

func TestCheckStart(t *testing.T) {
	tests := []struct {
		name  string
		start int64
		want  error
	}{
		{name: "one", start: 1},
		{name: "largest", start: math.MaxInt64},
		{name: "zero", start: 0, want: ErrInvalidArgument},
		{name: "negative", start: -100, want: ErrInvalidArgument},
		{name: "smallest", start: math.MinInt64, want: ErrInvalidArgument},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := Tag{Name: "t", Step: 1, MaxID: tt.start}.Check()
			checkSentinel(t, err, tt.want)
		})
	}
}

func TestCheckGiveBack(t *testing.T) {
	tests := []struct {
		name               string
		end, firstUnissued int64
		want               error
	}{
		{name: "part of the segment", end: 101, firstUnissued: 50},
		{name: "nothing", end: 101, firstUnissued: 101},
		{name: "everything down to the first ID", end: 101, firstUnissued: 1},
		{name: "at the largest end", end: math.MaxInt64, firstUnissued: math.MaxInt64},
		{name: "past end", end: 101, firstUnissued: 102, want: ErrInvalidArgument},
		{name: "zero", end: 101, firstUnissued: 0, want: ErrInvalidArgument},
		{name: "negative", end: 101, firstUnissued: -5, want: ErrInvalidArgument},
		{name: "end below one", end: 0, firstUnissued: 0, want: ErrInvalidArgument},
		{name: "end below first unissued", end: 1, firstUnissued: 2, want: ErrInvalidArgument},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			checkSentinel(t, CheckGiveBack(tt.end, tt.firstUnissued), tt.want)
		})
	}
}

// TestOrderedFormat: an ordered tag has no formatted numbers (a worker
// answers Id-Format: formatted for it with 400), so a format and the
// order are refused together when written, by tags create and by a tags
// update that sets either; a tag stored with both by an older version
// still takes other changes, and may drop its order.
func TestOrderedFormat(t *testing.T) {
	plain := Tag{Name: "o", Step: 1, MaxID: 1}
	ordered := Tag{Name: "o", Step: 1, MaxID: 1, Ordered: true}
	formatted := Tag{Name: "o", Step: 1, MaxID: 1, Format: "ORD-{seq}"}
	both := Tag{Name: "o", Step: 1, MaxID: 1, Ordered: true, Format: "ORD-{seq}"}
	tests := []struct {
		name string
		tag  Tag
		u    *Update // nil: create tag
		want error
	}{
		{name: "create ordered", tag: ordered},
		{name: "create formatted", tag: formatted},
		{name: "create ordered with a format", tag: both, want: ErrInvalidArgument},
		{name: "format an ordered tag", tag: ordered, u: &Update{Format: ptr("ORD-{seq}")}, want: ErrInvalidArgument},
		{name: "order a formatted tag", tag: formatted, u: &Update{Ordered: ptr(true)}, want: ErrInvalidArgument},
		{name: "order and format a plain tag", tag: plain, u: &Update{Ordered: ptr(true), Format: ptr("ORD-{seq}")}, want: ErrInvalidArgument},
		{name: "step of a tag stored with both", tag: both, u: &Update{Step: ptr[int64](5)}},
		{name: "a tag stored with both drops its order", tag: both, u: &Update{Ordered: ptr(false)}},
		{name: "width of a tag stored with both", tag: both, u: &Update{Format: ptr("ORD-{seq:6}")}, want: ErrInvalidArgument},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var err error
			if tt.u == nil {
				_, err = tt.tag.Check()
			} else {
				_, err = ApplyUpdate(tt.tag, *tt.u)
			}
			checkSentinel(t, err, tt.want)
		})
	}
}
