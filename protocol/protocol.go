package protocol

import (
	"errors"
	"fmt"
	"strings"
)

// Errors of reading requests: a request that fails with one of them is
// answered with CodeBadRequest and changes nothing.
var (
	// ErrBadCount means the body is not a decimal count in 1..max.
	ErrBadCount = errors.New("protocol: bad count")
	// ErrBadHeader means a header the service reads has a value it does not
	// understand.
	ErrBadHeader = errors.New("protocol: bad header")
	// ErrBadToken is the ErrBadHeader of an unreadable TokenHeader (same
	// text): the replies to its request carry no token.
	ErrBadToken = fmt.Errorf("%w", ErrBadHeader)
	// ErrBadSubject means the subject does not name a valid tag.
	ErrBadSubject = errors.New("protocol: bad subject")
	// ErrBadID is a body of a decode request that is no snowflake ID.
	ErrBadID = errors.New("protocol: bad snowflake ID")
	// ErrNoReply means a request has no reply subject: nobody could receive
	// its IDs.
	ErrNoReply = errors.New("protocol: request without a reply subject")
	// ErrBadReply means a request's reply subject is one a worker never
	// publishes to (CheckReply).
	ErrBadReply = errors.New("protocol: refused reply subject")
	// ErrBadDirect means a reply's DirectHeader is not the direct subject
	// of the tag asked for (CheckDirect).
	ErrBadDirect = errors.New("protocol: bad direct subject")
	// ErrBadIDs means a reply's body is not exactly the IDs asked for, well
	// formed (ParseIDs).
	ErrBadIDs = errors.New("protocol: bad IDs")
)

// Defaults of the service, defined here once (the lowest package that
// needs them) for the worker, the service, the client and Leaf's HTTP API.
const (
	// DefaultPrefix is the first token of the service's subjects unless
	// configured otherwise.
	DefaultPrefix = "id"
	// DefaultQueueGroup is the service's queue group unless configured
	// otherwise.
	DefaultQueueGroup = "dispenser"
	// DefaultMaxBatch is the most IDs one request may ask for unless
	// configured otherwise.
	DefaultMaxBatch = 10_000
)

// SegmentSubject is the subject of requests for IDs of tag.
func SegmentSubject(prefix, tag string) string { return prefix + ".segment." + tag }

// DirectSubject is where the owner of an ordered tag, named owner (a token
// of its own, DirectHeader), takes the tag's requests directly:
// <prefix>.direct.<tag>.<owner>. The tag is a token of its own, so that
// permissions per tag (<prefix>.direct.<tag>.*) still bound a requester to
// its tags; it is outside <prefix>.segment.> (the queue group's endpoint)
// and <prefix>.owner.> (the workers' forwarded requests, which are trusted).
func DirectSubject(prefix, tag, owner string) string {
	return DirectPrefix(prefix) + tag + "." + owner
}

// DirectPrefix is the direct subjects' part before the tag:
// "<prefix>.direct.".
func DirectPrefix(prefix string) string { return prefix + ".direct." }

// CheckDirect checks a DirectHeader value of a reply to a request for tag:
// it must be DirectSubject(prefix, tag, owner) for an owner that is a valid
// token (ValidTag's rule). A reply is untrusted input: a client sends
// nothing to a subject that fails.
func CheckDirect(subject, prefix, tag string) error {
	rest, ok := strings.CutPrefix(subject, DirectPrefix(prefix))
	if ok {
		rest, ok = strings.CutPrefix(rest, tag+".")
	}
	if !ok || !ValidTag(rest) {
		return fmt.Errorf("%w %q: want %s", ErrBadDirect, truncate(subject, 200), DirectSubject(prefix, tag, "<owner>"))
	}
	return nil
}

// SnowflakeSubject is the subject of requests for snowflake IDs.
func SnowflakeSubject(prefix string) string { return prefix + ".snowflake" }

// Headers.
const (
	// FormatHeader selects the reply format: "list" (default) or "range".
	FormatHeader = "Id-Format"
	// WorkerHeader, on a request with any value, asks the worker to name
	// itself in the reply's header of the same name.
	WorkerHeader = "Id-Worker"
	// ForwardedHeader marks a message of requests one worker forwarded to
	// the owner of their ordered tag; its value names the forwarding
	// worker.
	ForwardedHeader = "Id-Forwarded"
	// DirectHeader, on a request with any value, asks the owner of an
	// ordered tag to name its direct subject (DirectSubject) in the reply's
	// header of the same name: the client may send the tag's next requests
	// there, to the owner, instead of to <prefix>.segment.<tag>, where they
	// would reach the owner only after a hop through another worker. A
	// reply to a request on the direct subject, or for a plain tag, does
	// not carry it; nor does one to a request without it, so that clients
	// that do not follow it pay nothing for it.
	DirectHeader = "Id-Direct"
	// HopHeader marks a request a worker that could not serve it published
	// again for another worker of its queue group to answer; a worker
	// answers such a request itself rather than hand it on again.
	HopHeader = "Id-Hop"
	// TokenHeader, on a request, is a value the requester chose (a token:
	// ValidToken); every reply to that request, with IDs or an error, from
	// whichever worker answers it (an ordered tag's owner included),
	// carries it back in the header of the same name, so that a requester
	// that makes the value unpredictable (128 random bits, new for every
	// request) can tell the replies to its own request from replies
	// anything else published to its inbox: a reply without it, or with
	// another value, is not one. A request without it gets replies without
	// it.
	TokenHeader = "Id-Token"
	// ErrorCodeHeader and ErrorHeader carry a failure's code and
	// description: the headers of NATS micro services.
	ErrorCodeHeader = "Nats-Service-Error-Code"
	ErrorHeader     = "Nats-Service-Error"
)

// Error codes of failed requests, in ErrorCodeHeader.
const (
	CodeBadRequest = "400"
	CodeNotFound   = "404"
	// CodeGone: the tag is exhausted (its IDs would pass 2^63-1); final,
	// retrying does not help.
	CodeGone        = "410"
	CodeUnavailable = "503"
	CodeInternal    = "500"
	// CodeMisdirected: a request on a direct subject (DirectSubject) reached
	// a worker that does not own the tag (any more), or the tag is not
	// ordered; nothing was taken. Send it, at once, to
	// <prefix>.segment.<tag> instead, and forget the direct subject.
	CodeMisdirected = "421"
)

// Format is the reply format of a request.
type Format uint8

const (
	// FormatList replies with the IDs in decimal, one per line.
	FormatList Format = iota
	// FormatRange replies with one "first-last" line per contiguous run.
	FormatRange
	// FormatFormatted replies with the IDs as the tag's format writes them
	// (such as ORD-20261124-000123), one per line: segment tags with a
	// format only.
	FormatFormatted
)

func (f Format) String() string {
	switch f {
	case FormatRange:
		return "range"
	case FormatFormatted:
		return "formatted"
	}
	return "list"
}

// MaxCountDigits bounds a count's digits before it is parsed, so that no
// body can overflow the parser or make it work long: no request can ask
// for more than MaxCount IDs, whatever the service's batch limit.
const (
	MaxCountDigits = 9
	MaxCount       = 999_999_999
)

// ParseCount parses a request body: empty means 1, otherwise a decimal
// number in 1..max, optionally surrounded by ASCII white space (so that
// `echo 10 | nats req ...` works).
func ParseCount(body []byte, max int) (int, error) {
	s := trimSpace(body) // a string only for an error: no allocation
	if len(s) == 0 {
		return 1, nil
	}
	if len(s) > MaxCountDigits {
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

// ParseFormat reads the FormatHeader values: none, "list", "range" or
// "formatted" (case-insensitive).
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
	case strings.EqualFold(v, "formatted"):
		return FormatFormatted, nil
	default:
		return 0, fmt.Errorf("%w: %s %q: want list, range or formatted", ErrBadHeader, FormatHeader, truncate(v, 64))
	}
}

// MaxTagLen is the longest tag, in bytes.
const MaxTagLen = 128

// ValidTag reports whether name is a valid tag: 1 to MaxTagLen characters
// from [A-Za-z0-9_-], so that it is always a single NATS subject token.
func ValidTag(name string) bool {
	if len(name) == 0 || len(name) > MaxTagLen {
		return false
	}
	for i := 0; i < len(name); i++ {
		c := name[i]
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '_' || c == '-') {
			return false
		}
	}
	return true
}

// MaxTokenLen is the longest TokenHeader value, in bytes.
const MaxTokenLen = 64

// ValidToken reports whether v is a valid TokenHeader value: 1 to
// MaxTokenLen characters from [A-Za-z0-9_-] (base64url without padding
// fits).
func ValidToken(v string) bool {
	return len(v) <= MaxTokenLen && ValidTag(v)
}

// ParseToken reads the TokenHeader values of a request: none (""), or one
// valid token.
func ParseToken(values []string) (string, error) {
	switch {
	case len(values) == 0:
		return "", nil
	case len(values) > 1:
		return "", fmt.Errorf("%w: %s given %d times", ErrBadToken, TokenHeader, len(values))
	case !ValidToken(values[0]):
		return "", fmt.Errorf("%w: %s %q: want 1-%d characters of [A-Za-z0-9_-]", ErrBadToken, TokenHeader, truncate(values[0], 80), MaxTokenLen)
	}
	return values[0], nil
}

// TagRule describes a valid tag, for error messages.
const TagRule = "1-128 characters of [A-Za-z0-9_-]"

// ParseTag returns the tag of a segment subject: its token after prefix,
// which ends with "segment.".
func ParseTag(subject, prefix string) (string, error) {
	tag, ok := strings.CutPrefix(subject, prefix)
	if !ok || !ValidTag(tag) {
		return "", fmt.Errorf("%w %q: want %s<tag>, tag %s", ErrBadSubject, truncate(subject, 200), prefix, TagRule)
	}
	return tag, nil
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}
