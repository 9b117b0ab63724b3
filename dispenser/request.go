package dispenser

import (
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/dispenser-dev/dispenser/segment"
)

// Errors of request parsing; all of them are answered with code 400.
var (
	// ErrBadCount means the body is not a decimal count in 1..MaxBatch.
	ErrBadCount = errors.New("dispenser: bad count")
	// ErrBadHeader means a header the service reads has a value it does not
	// understand.
	ErrBadHeader = errors.New("dispenser: bad header")
	// ErrBadSubject means the subject does not name a valid tag.
	ErrBadSubject = errors.New("dispenser: bad subject")
)

// Errors of reply subjects. A request whose reply subject is refused gets
// no answer at all (there is nowhere safe to send one) and takes no ID; it
// is counted (dispenser_requests_refused_total) and logged at a bounded
// rate.
var (
	// ErrNoReply means a request has no reply subject: nobody could receive
	// its IDs.
	ErrNoReply = errors.New("dispenser: request without a reply subject")
	// ErrBadReply means a request's reply subject is one the service never
	// publishes to (CheckReply).
	ErrBadReply = errors.New("dispenser: refused reply subject")
)

// MaxReplyLen is the longest reply subject the service answers to, in
// bytes. Inboxes of NATS clients are about 50 bytes.
const MaxReplyLen = 512

// CheckReply decides whether the service may publish a reply to subject
// reply, a value every requester chooses freely. A worker's connection may
// hold rights its requesters lack (in zero-setup mode it holds all of
// them), so a reply subject is input, and these are refused:
//
//   - an empty one (ErrNoReply);
//   - one longer than MaxReplyLen, with an empty token, a wildcard token
//     ("*" or ">"), or a byte that is white space or a control character;
//   - one whose first token starts with "$": every system namespace of
//     NATS ($JS JetStream, $KV key-value, $O object store, $SYS system
//     account, $SRV micro services, $G, $GR, $MQTT, $NRG and any added
//     later);
//   - one equal to or below one of own, the service's own subject
//     prefixes (its prefix, where requests and forwarded requests arrive).
//
// Every other subject is allowed: _INBOX.> (the default inbox prefix of
// every NATS client), custom inbox prefixes, and _R_.> (replies to
// requests that came through an account's service import).
func CheckReply(reply string, own ...string) error {
	if reply == "" {
		return ErrNoReply
	}
	if len(reply) > MaxReplyLen {
		return fmt.Errorf("%w: %d bytes, longer than %d", ErrBadReply, len(reply), MaxReplyLen)
	}
	if reply[0] == '$' {
		return fmt.Errorf("%w %q: a system namespace ($...)", ErrBadReply, truncate(reply, 64))
	}
	tokenStart := 0
	for i := 0; i <= len(reply); i++ {
		if i < len(reply) {
			c := reply[i]
			if c <= ' ' || c == 0x7f {
				return fmt.Errorf("%w %q: white space or a control character", ErrBadReply, truncate(reply, 64))
			}
			if c != '.' {
				continue
			}
		}
		switch tok := reply[tokenStart:i]; tok {
		case "":
			return fmt.Errorf("%w %q: an empty token", ErrBadReply, truncate(reply, 64))
		case "*", ">":
			return fmt.Errorf("%w %q: a wildcard", ErrBadReply, truncate(reply, 64))
		}
		tokenStart = i + 1
	}
	for _, p := range own {
		if p != "" && (reply == p || strings.HasPrefix(reply, p) && reply[len(p)] == '.') {
			return fmt.Errorf("%w %q: the service's own subjects (%s.>)", ErrBadReply, truncate(reply, 64), p)
		}
	}
	return nil
}

// FormatHeader is the request header that selects the reply format.
const FormatHeader = "Id-Format"

// Format is the reply format of a request.
type Format uint8

const (
	// FormatList replies with the IDs in decimal, one per line.
	FormatList Format = iota
	// FormatRange replies with one "first-last" line per contiguous run.
	FormatRange
)

func (f Format) String() string {
	if f == FormatRange {
		return "range"
	}
	return "list"
}

// maxBodyDigits bounds a count's digits before it is parsed, so that no
// body can overflow the parser or make it work long.
const maxBodyDigits = 9

// ParseCount parses a request body: empty means 1, otherwise a decimal
// number in 1..max, optionally surrounded by ASCII white space (so that
// `echo 10 | nats req ...` works).
func ParseCount(body []byte, max int) (int, error) {
	s := strings.Trim(string(body), " \t\r\n")
	if s == "" {
		return 1, nil
	}
	if len(s) > maxBodyDigits {
		if len(s) > 32 {
			return 0, fmt.Errorf("%w: body of %d bytes is not a count in 1..%d", ErrBadCount, len(body), max)
		}
		return 0, fmt.Errorf("%w %q: want a decimal count in 1..%d", ErrBadCount, s, max)
	}
	n := 0
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c < '0' || c > '9' {
			return 0, fmt.Errorf("%w %q: want a decimal count in 1..%d", ErrBadCount, s, max)
		}
		n = n*10 + int(c-'0')
	}
	if n < 1 || n > max {
		return 0, fmt.Errorf("%w %d: want 1..%d", ErrBadCount, n, max)
	}
	return n, nil
}

// ParseFormat reads the Id-Format header values: none, "list" or "range"
// (case-insensitive).
func ParseFormat(values []string) (Format, error) {
	switch len(values) {
	case 0:
		return FormatList, nil
	case 1:
	default:
		return 0, fmt.Errorf("%w: %s given %d times", ErrBadHeader, FormatHeader, len(values))
	}
	switch v := strings.TrimSpace(values[0]); {
	case v == "" || strings.EqualFold(v, "list"):
		return FormatList, nil
	case strings.EqualFold(v, "range"):
		return FormatRange, nil
	default:
		return 0, fmt.Errorf("%w: %s %q: want list or range", ErrBadHeader, FormatHeader, truncate(v, 64))
	}
}

// ParseTag returns the tag of a segment subject: its token after prefix.
func ParseTag(subject, prefix string) (string, error) {
	tag, ok := strings.CutPrefix(subject, prefix)
	if !ok || !segment.ValidTag(tag) {
		return "", fmt.Errorf("%w %q: want %s<tag>, tag 1-128 characters of [A-Za-z0-9_-]", ErrBadSubject, truncate(subject, 200), prefix)
	}
	return tag, nil
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}

// AppendList appends the IDs of runs in decimal, one per line.
func AppendList(dst []byte, runs []segment.Run) []byte {
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
func AppendRanges(dst []byte, runs []segment.Run) []byte {
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

// Runs groups ids into runs of consecutive values, appending them to dst.
func Runs(dst []segment.Run, ids []int64) []segment.Run {
	for _, id := range ids {
		if n := len(dst); n > 0 && dst[n-1].Last+1 == id {
			dst[n-1].Last = id
			continue
		}
		dst = append(dst, segment.Run{First: id, Last: id})
	}
	return dst
}
