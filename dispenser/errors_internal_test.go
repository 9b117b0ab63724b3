package dispenser

import (
	"fmt"
	"log/slog"
	"testing"

	"github.com/dispenser-dev/dispenser/internal/kvbucket"
	"github.com/dispenser-dev/dispenser/protocol"
	"github.com/dispenser-dev/dispenser/segment"
	"github.com/dispenser-dev/dispenser/tagmodel"
)

// TestClassifyTable: the rows of errorCodes, wrapped as callers wrap them,
// give the codes and descriptions they gave as a switch; the order of the
// rows decides for an error that is two sentinels.
func TestClassifyTable(t *testing.T) {
	plain := &Service{cfg: Config{Logger: slog.New(slog.DiscardHandler)}}
	ordered := &Service{cfg: Config{Logger: slog.New(slog.DiscardHandler), Owners: fixedOwners{}}}
	tests := []struct {
		name     string
		s        *Service
		err      error
		code     string
		wantDesc string
	}{
		{"bad count", plain, fmt.Errorf("%w 0: want 1..10", protocol.ErrBadCount), "400", "bad count 0: want 1..10"},
		{"unknown tag", plain, fmt.Errorf("kv: %w", tagmodel.ErrUnknownTag), "404", protocol.Describe(tagmodel.ErrUnknownTag)},
		{"exhausted", plain, tagmodel.ErrExhausted, "410", protocol.Describe(tagmodel.ErrExhausted)},
		{"not owner", ordered, fmt.Errorf("%w: %q", ErrNotOwner, "seq"), "421", `this worker does not own the tag; ask <prefix>.segment.<tag>: "seq"`},
		{"ordered, served here", ordered, fmt.Errorf("take: %w", segment.ErrOrdered), "503", "ordered tag's owner is changing; try again"},
		{"ordered, not served here", plain, fmt.Errorf("take: %w", segment.ErrOrdered), "503", "take: " + protocol.Describe(segment.ErrOrdered) + ": this worker serves no ordered tags"},
		{"store unavailable, details hidden", plain, fmt.Errorf("%w: dial tcp 10.0.0.1:5432: refused", segment.ErrUnavailable), "503",
			protocol.Describe(segment.ErrUnavailable) + " (store slow or unreachable); try again"},
		{"purged", plain, kvbucket.ErrPurged, "503", "the store's bucket was purged or recreated: an operator must restore it"},
		{"bad count before unavailable", plain, fmt.Errorf("%w: %w", protocol.ErrBadCount, segment.ErrUnavailable), "400", "bad count: " + protocol.Describe(segment.ErrUnavailable)},
		{"unexpected", plain, fmt.Errorf("boom"), "500", "internal error"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			code, desc := tt.s.Classify(tt.err)
			if code != tt.code || desc != tt.wantDesc {
				t.Fatalf("Classify(%v) = %s %q, want %s %q", tt.err, code, desc, tt.code, tt.wantDesc)
			}
		})
	}
}
