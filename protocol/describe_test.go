package protocol_test

import (
	"errors"
	"fmt"
	"testing"

	"github.com/dispenser-dev/dispenser/protocol"
)

func TestDescribe(t *testing.T) {
	invalidTag := errors.New("segment: invalid tag")
	for _, tc := range []struct {
		name string
		err  error
		want string
	}{
		{"package names of a chain", fmt.Errorf("kv: create tag: %w \"a.b\": want 1-128 characters", invalidTag),
			`create tag: invalid tag "a.b": want 1-128 characters`},
		{"a part said twice", fmt.Errorf("dispenser: %w", fmt.Errorf("dispenser: MaxBatch 0: want 1..1000000")),
			"MaxBatch 0: want 1..1000000"},
		{"a repeated phrase", fmt.Errorf("invalid settings: %w", errors.New("invalid settings: layout \"x\"")), `invalid settings: layout "x"`},
		{"a client's description", fmt.Errorf("%w: \"abc\" is not a non-negative decimal int64", protocol.ErrBadID),
			`bad snowflake ID: "abc" is not a non-negative decimal int64`},
		{"quoted values stay", fmt.Errorf("%w \"kv: x\": want", invalidTag), `invalid tag "kv: x": want`},
		{"a word that is only a package name", errors.New("segment"), "segment"},
		{"plain text", errors.New("tags create: --step is required"), "tags create: --step is required"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := protocol.Describe(tc.err); got != tc.want {
				t.Errorf("Describe(%q) = %q, want %q", tc.err, got, tc.want)
			}
		})
	}
}
