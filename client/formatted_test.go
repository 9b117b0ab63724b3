package client_test

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/dispenser-dev/dispenser/client"
	"github.com/dispenser-dev/dispenser/testenv"
)

// TestFormattedReplies: formatted numbers are untrusted input like IDs: a
// reply with another number of lines, an empty line, a space, a control
// character, an overlong line or a number twice is ErrBadReply; a good one
// is returned as sent.
func TestFormattedReplies(t *testing.T) {
	tests := []struct {
		name  string
		n     int
		reply string
		want  []string
		err   error
	}{
		{"good", 2, "ORD-20261124-000001\nORD-20261124-000002", []string{"ORD-20261124-000001", "ORD-20261124-000002"}, nil},
		{"too few", 3, "A1\nA2", nil, client.ErrBadReply},
		{"too many", 1, "A1\nA2", nil, client.ErrBadReply},
		{"empty line", 2, "A1\n", nil, client.ErrBadReply},
		{"space", 1, "A 1", nil, client.ErrBadReply},
		{"control character", 1, "A\x001", nil, client.ErrBadReply},
		{"overlong", 1, strings.Repeat("9", 129), nil, client.ErrBadReply},
		{"not ASCII", 1, "Ä1", nil, client.ErrBadReply},
		{"repeated", 3, "A1\nA2\nA1", nil, client.ErrBadReply},
		{"repeated next", 2, "A1\nA1", nil, client.ErrBadReply},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ns := testenv.NATS(t)
			nc := testenv.Connect(t, ns)
			rogue(t, nc, "fmt", tt.reply)
			c, err := client.New(testenv.Connect(t, ns), client.WithPrefix("fmt"), client.WithoutRetries())
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
			defer cancel()
			got, err := c.Formatted(ctx, "orders", tt.n)
			if !errors.Is(err, tt.err) || (tt.err == nil && !slices.Equal(got, tt.want)) {
				t.Fatalf("Formatted = %q, %v; want %q, %v", got, err, tt.want, tt.err)
			}
		})
	}
}
