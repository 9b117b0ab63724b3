package protocol

import (
	"bytes"
	"errors"
	"fmt"
	"math"
	"strconv"
)

// Run is a contiguous run of IDs, First through Last inclusive.
type Run struct {
	First, Last int64
}

// Len returns the number of IDs in r.
func (r Run) Len() int64 { return r.Last - r.First + 1 }

// The most bytes a reply takes per ID: a list line is at most 19 digits and
// a newline, a range line (a run of one ID) twice that and a dash.
// A formatted number takes at most MaxFormattedBytes and a newline.
const (
	ListBytesPerID      = 20
	RangeBytesPerID     = 40
	MaxFormattedBytes   = 128
	FormattedBytesPerID = MaxFormattedBytes + 1
)

// BytesPerID returns ListBytesPerID, RangeBytesPerID or
// FormattedBytesPerID.
func (f Format) BytesPerID() int {
	switch f {
	case FormatRange:
		return RangeBytesPerID
	case FormatFormatted:
		return FormattedBytesPerID
	}
	return ListBytesPerID
}

// AppendList appends the IDs of runs in decimal, one per line.
func AppendList(dst []byte, runs []Run) []byte {
	sep := false
	for _, r := range runs {
		if r.First > r.Last {
			continue
		}
		// Stop at Last before incrementing: Last may be 2^63-1.
		for id := r.First; ; id++ {
			if sep {
				dst = append(dst, '\n')
			}
			sep = true
			dst = strconv.AppendInt(dst, id, 10)
			if id == r.Last {
				break
			}
		}
	}
	return dst
}

// AppendIDs appends ids in decimal, one per line.
func AppendIDs(dst []byte, ids []int64) []byte {
	for i, id := range ids {
		if i > 0 {
			dst = append(dst, '\n')
		}
		dst = strconv.AppendInt(dst, id, 10)
	}
	return dst
}

// AppendRanges appends one "first-last" line per run.
func AppendRanges(dst []byte, runs []Run) []byte {
	for i, r := range runs {
		if i > 0 {
			dst = append(dst, '\n')
		}
		dst = strconv.AppendInt(dst, r.First, 10)
		dst = append(dst, '-')
		dst = strconv.AppendInt(dst, r.Last, 10)
	}
	return dst
}

// AppendRuns appends runs in format f.
func AppendRuns(dst []byte, f Format, runs []Run) []byte {
	if f == FormatRange {
		return AppendRanges(dst, runs)
	}
	return AppendList(dst, runs)
}

// Runs groups ids into runs of consecutive values, appending them to dst.
func Runs(dst []Run, ids []int64) []Run {
	for _, id := range ids {
		if n := len(dst); n > 0 && dst[n-1].Last+1 == id {
			dst[n-1].Last = id
			continue
		}
		dst = append(dst, Run{First: id, Last: id})
	}
	return dst
}

// The smallest IDs of the protocol: segment IDs start at 1, snowflake IDs
// at 0.
const (
	MinSegmentID   = 1
	MinSnowflakeID = 0
)

// ParseIDs reads the body of a reply to a request for n IDs in format f and
// checks it, as anything subscribed to the service's subjects may have sent
// it: exactly n IDs, each in lowest..2^63-1, in runs that strictly increase
// (no run overlaps or repeats another), the lines in format f (ranges:
// "first-last" with first <= last; otherwise one ID per line), in decimal
// without signs, leading zeros or white space, separated by single
// newlines. The body's length is checked before anything is parsed, and no
// arithmetic passes 2^63-1. Errors wrap ErrBadIDs.
func ParseIDs(body []byte, n int, f Format, lowest int64) ([]Run, error) {
	return AppendParsedIDs(nil, body, n, f, lowest)
}

// AppendParsedIDs is ParseIDs appending the runs to dst (nil if the body
// is refused), so that a caller with room for them allocates nothing.
func AppendParsedIDs(dst []Run, body []byte, n int, f Format, lowest int64) ([]Run, error) {
	runs, err := parseIDs(dst, body, n, f, lowest)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrBadIDs, err)
	}
	return runs, nil
}

func parseIDs(dst []Run, body []byte, n int, f Format, lowest int64) ([]Run, error) {
	if n < 1 {
		return nil, fmt.Errorf("count %d: want at least 1", n)
	}
	if len(body) == 0 {
		return nil, errors.New("empty body")
	}
	if limit := int64(f.BytesPerID()) * int64(n); int64(len(body)) > limit {
		return nil, fmt.Errorf("body of %d bytes: %d IDs take at most %d", len(body), n, limit)
	}
	runs, base := dst, len(dst)
	left := int64(n) // IDs still to come
	for no := 1; ; no++ {
		line, rest, more := bytes.Cut(body, []byte{'\n'})
		var r Run
		var err error
		if f == FormatRange {
			first, last, ok := bytes.Cut(line, []byte{'-'})
			if !ok {
				err = errors.New("want first-last")
			} else if r.First, err = parseID(first, lowest); err == nil {
				if r.Last, err = parseID(last, lowest); err == nil && r.Last < r.First {
					err = errors.New("last below first")
				}
			}
		} else {
			r.First, err = parseID(line, lowest)
			r.Last = r.First
		}
		switch {
		case err != nil:
		case len(runs) > base && r.First <= runs[len(runs)-1].Last:
			err = fmt.Errorf("does not start above the line before (%d)", runs[len(runs)-1].Last)
		case r.Last-r.First >= left: // no overflow: 0 <= first <= last
			// Refused at the first run too many, so that left and the
			// run sizes below stay within 0..n.
			err = fmt.Errorf("more IDs than the %d asked for", n)
		}
		if err != nil {
			return nil, fmt.Errorf("line %d %q: %w", no, truncate(string(line), 48), err)
		}
		runs = append(runs, r)
		left -= r.Last - r.First + 1
		if !more {
			break
		}
		body = rest
	}
	if left != 0 {
		return nil, fmt.Errorf("%d IDs, want %d", int64(n)-left, n)
	}
	return runs, nil
}

// parseID parses an ID of a reply: 1 to 19 decimal digits without a sign
// or leading zeros, in lowest..2^63-1.
func parseID(s []byte, lowest int64) (int64, error) {
	ok := len(s) > 0 && len(s) <= 19 && (s[0] != '0' || len(s) == 1)
	var v uint64 // 19 digits fit
	for i := 0; ok && i < len(s); i++ {
		ok = '0' <= s[i] && s[i] <= '9'
		v = v*10 + uint64(s[i]-'0')
	}
	if !ok || v > math.MaxInt64 || int64(v) < lowest {
		return 0, fmt.Errorf("want decimal IDs in %d..%d", lowest, int64(math.MaxInt64))
	}
	return int64(v), nil
}
