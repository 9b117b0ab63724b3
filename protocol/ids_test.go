package protocol

import (
	"errors"
	"slices"
	"strings"
	"testing"
)

func TestParseIDs(t *testing.T) {
	tests := []struct {
		name   string
		body   string
		n      int
		format Format
		lowest int64
		want   []Run
		ok     bool
	}{
		{"one ID", "7", 1, FormatList, MinSegmentID, []Run{{First: 7, Last: 7}}, true},
		{"list", "1\n2\n5", 3, FormatList, MinSegmentID, []Run{{First: 1, Last: 1}, {First: 2, Last: 2}, {First: 5, Last: 5}}, true},
		{"ranges", "1-3\n10-10", 4, FormatRange, MinSegmentID, []Run{{First: 1, Last: 3}, {First: 10, Last: 10}}, true},
		{"largest ID", "9223372036854775807", 1, FormatList, MinSegmentID, []Run{{First: 1<<63 - 1, Last: 1<<63 - 1}}, true},
		{"snowflake zero", "0", 1, FormatList, MinSnowflakeID, []Run{{First: 0, Last: 0}}, true},
		{"segment zero", "0", 1, FormatList, MinSegmentID, nil, false},
		{"empty", "", 1, FormatList, MinSegmentID, nil, false},
		{"too few", "1\n2", 3, FormatList, MinSegmentID, nil, false},
		{"too many", "1\n2\n3", 2, FormatList, MinSegmentID, nil, false},
		{"range too long", "1-1000000", 3, FormatRange, MinSegmentID, nil, false},
		{"repeated", "5\n5", 2, FormatList, MinSegmentID, nil, false},
		{"decreasing", "6\n5", 2, FormatList, MinSegmentID, nil, false},
		{"overlapping ranges", "1-3\n3-4", 5, FormatRange, MinSegmentID, nil, false},
		{"last below first", "5-4", 1, FormatRange, MinSegmentID, nil, false},
		{"list where ranges were asked for", "1\n2", 2, FormatRange, MinSegmentID, nil, false},
		{"range where a list was asked for", "1-2", 2, FormatList, MinSegmentID, nil, false},
		{"sign", "+1", 1, FormatList, MinSegmentID, nil, false},
		{"negative", "-1", 1, FormatList, MinSnowflakeID, nil, false},
		{"leading zero", "01", 1, FormatList, MinSegmentID, nil, false},
		{"white space", "1 ", 1, FormatList, MinSegmentID, nil, false},
		{"trailing newline", "1\n", 1, FormatList, MinSegmentID, nil, false},
		{"above 2^63-1", "9223372036854775808", 1, FormatList, MinSegmentID, nil, false},
		{"twenty digits", "10000000000000000000", 1, FormatList, MinSegmentID, nil, false},
		{"longer than n IDs can be", strings.Repeat("1", 41), 1, FormatRange, MinSegmentID, nil, false},
		{"no count", "1", 0, FormatList, MinSegmentID, nil, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := ParseIDs([]byte(tt.body), tt.n, tt.format, tt.lowest)
			if tt.ok != (err == nil) || !slices.Equal(got, tt.want) {
				t.Fatalf("ParseIDs(%q, %d, %v) = %v, %v; want %v (ok %v)", tt.body, tt.n, tt.format, got, err, tt.want, tt.ok)
			}
			if err != nil && !errors.Is(err, ErrBadIDs) {
				t.Fatalf("error %v does not wrap ErrBadIDs", err)
			}
		})
	}
}

// FuzzParseIDs: whatever the body, ParseIDs either fails or returns
// exactly n IDs in strictly increasing runs that AppendRuns writes back
// as the same body.
func FuzzParseIDs(f *testing.F) {
	for _, s := range []string{"1", "1\n2", "1-3\n5-5", "9223372036854775807", "0", "-1", "1-0"} {
		f.Add([]byte(s), 3, true)
		f.Add([]byte(s), 1, false)
	}
	f.Fuzz(func(t *testing.T, body []byte, n int, ranges bool) {
		if n < 1 || n > 1000 {
			return
		}
		format := FormatList
		if ranges {
			format = FormatRange
		}
		runs, err := ParseIDs(body, n, format, MinSegmentID)
		if err != nil {
			return
		}
		var total int64
		for i, r := range runs {
			if r.First < MinSegmentID || r.Last < r.First || i > 0 && r.First <= runs[i-1].Last {
				t.Fatalf("ParseIDs(%q) = %v: not strictly increasing runs of valid IDs", body, runs)
			}
			total += r.Len()
		}
		if total != int64(n) {
			t.Fatalf("ParseIDs(%q, %d) = %v: %d IDs", body, n, runs, total)
		}
		if format == FormatList {
			if got := AppendRuns(nil, format, runs); string(got) != string(body) {
				t.Fatalf("AppendRuns(ParseIDs(%q)) = %q", body, got)
			}
		}
	})
}

func TestForwardRoundTrip(t *testing.T) {
	tests := []struct {
		name string
		f    Forward
		line string
	}{
		{"list", Forward{Reply: "_INBOX.a", N: 1, Format: FormatList}, "_INBOX.a 1 list 0\n"},
		{"range with worker", Forward{Reply: "_INBOX.b.c", N: 1000, Format: FormatRange, Worker: true}, "_INBOX.b.c 1000 range 1\n"},
		{"direct", Forward{Reply: "_INBOX.d", N: 2, Format: FormatList, Direct: true}, "_INBOX.d 2 list 2\n"},
		{"direct with worker", Forward{Reply: "_INBOX.d", N: 2, Format: FormatList, Worker: true, Direct: true}, "_INBOX.d 2 list 3\n"},
		{"token", Forward{Reply: "_INBOX.e", N: 1, Format: FormatList, Token: "tok-0_A"}, "_INBOX.e 1 list 0:tok-0_A\n"},
		{"token with flags", Forward{Reply: "_INBOX.e", N: 3, Format: FormatRange, Worker: true, Direct: true, Token: "x"}, "_INBOX.e 3 range 3:x\n"},
		{"body token", Forward{Reply: "_INBOX.f", N: 1, Format: FormatList, Direct: true, Token: "b", BodyToken: true}, "_INBOX.f 1 list 6:b\n"},
		{"body token with all flags", Forward{Reply: "_INBOX.f", N: 2, Format: FormatRange, Worker: true, Direct: true, Token: "b", BodyToken: true}, "_INBOX.f 2 range 7:b\n"},
	}
	// A body token without a token is nothing to echo: written and read
	// as no body token.
	if got := string(AppendForward(nil, Forward{Reply: "_INBOX.g", N: 1, BodyToken: true})); got != "_INBOX.g 1 list 0\n" {
		t.Errorf("body token without a token: %q", got)
	}
	if got, err := ParseForward("_INBOX.g 1 list 4"); err != nil || got.BodyToken {
		t.Errorf("flag 4 without a token: %+v, %v; want no body token", got, err)
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := string(AppendForward(nil, tt.f)); got != tt.line {
				t.Fatalf("AppendForward = %q, want %q", got, tt.line)
			}
			got, err := ParseForward(strings.TrimSuffix(tt.line, "\n"))
			if err != nil || got != tt.f {
				t.Fatalf("ParseForward(%q) = %+v, %v; want %+v", tt.line, got, err, tt.f)
			}
		})
	}
}

func TestParseForwardRefuses(t *testing.T) {
	tests := []struct {
		name      string
		line      string
		err       error
		withReply bool // the requester can be told
	}{
		{"three fields", "_INBOX.a 1 list", ErrBadCount, false},
		{"five fields", "_INBOX.a 1 list 0 x", ErrBadCount, false},
		{"empty field", "_INBOX.a  list 0", ErrBadCount, false},
		{"count not a number", "_INBOX.a x list 0", ErrBadCount, true},
		{"unknown format", "_INBOX.a 1 json 0", ErrBadHeader, true},
		{"empty token", "_INBOX.a 1 list 0:", ErrBadHeader, true},
		{"token with a dot", "_INBOX.a 1 list 0:a.b", ErrBadHeader, true},
		{"token too long", "_INBOX.a 1 list 0:" + strings.Repeat("a", MaxTokenLen+1), ErrBadHeader, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := ParseForward(tt.line)
			if !errors.Is(err, tt.err) || (got.Reply != "") != tt.withReply {
				t.Fatalf("ParseForward(%q) = %+v, %v; want %v, reply set %v", tt.line, got, err, tt.err, tt.withReply)
			}
		})
	}
}
