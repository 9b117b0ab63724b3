package protocol

import (
	"fmt"
	"strings"
	"unsafe"
)

// Request is what a request for IDs asks for, as ReadRequest reads it.
type Request struct {
	// N is the count of IDs and Format the reply's format.
	N      int
	Format Format
	// Worker and Direct: the request carries WorkerHeader, DirectHeader
	// (any value).
	Worker, Direct bool
	// Token is the request's token (TokenHeader, or the body's second
	// field: BodyToken), to echo in every reply; "" if it has none.
	Token string
	// BodyToken: the token came in the body ("<count> <token>"), so a
	// reply with IDs carries it as its body's first line (AppendTokenLine),
	// not as a header, and names the owner's direct subject there too
	// (Direct is set: the line has room for it at no cost to the
	// requester). An error reply still carries it in TokenHeader.
	BodyToken bool
}

// Limits bound the requests ReadRequest accepts.
type Limits struct {
	// MaxBatch is the most IDs one request may ask for.
	MaxBatch int
	// MaxPayload returns the max payload of the server the reply goes out
	// through now (a reconnect may bring a smaller one). It is called only
	// for a count whose reply may not fit in every server's message.
	MaxPayload func() int64
}

// ReplyHeaderRoom is kept free of the max payload for a reply's headers.
const ReplyHeaderRoom = 1024

// Fits returns the most IDs a reply in format can carry within
// maxPayload, with ReplyHeaderRoom left for its headers.
func Fits(maxPayload int64, format Format) int {
	return int(max(maxPayload-ReplyHeaderRoom, 0) / int64(format.BytesPerID()))
}

// ReadHeaders reads the headers any request may carry: WorkerHeader and
// DirectHeader (by their exact names), then TokenHeader (HeaderValues).
// With an error (an unreadable token) the Request has Worker and Direct
// only: its replies carry no token.
func ReadHeaders(h map[string][]string) (Request, error) {
	var r Request
	err := r.readHeaders(h)
	return r, err
}

// readHeaders is ReadHeaders into r, which is zero.
func (r *Request) readHeaders(h map[string][]string) error {
	if len(h) == 0 {
		return nil
	}
	_, r.Worker = h[WorkerHeader]
	_, r.Direct = h[DirectHeader]
	var err error
	r.Token, err = ParseToken(HeaderValues(h, TokenHeader))
	return err
}

// ReadRequest reads a request for IDs, before anything is taken for it:
// its headers (ReadHeaders), the token in its body if it has one
// (SplitBody), its FormatHeader (ParseFormat), the count in its body
// (ParseCount, 1..l.MaxBatch) and whether a reply of that many IDs in that
// format fits in one message of the server (Fits), in that order. An error
// wraps ErrBadHeader (ErrBadToken for the token) or ErrBadCount
// (CodeBadRequest); the Request then has what was read before it, for the
// error's reply (the token first, so that every later error echoes it). A
// caller with checks of its own between the headers and the count (the
// service's hand-on and tag) fails an ErrBadToken at once and the others
// after its checks, as it did when it read them apart. It allocates nothing
// but its error. A token from the body shares body's memory (SplitBody).
func ReadRequest(h map[string][]string, body []byte, l Limits) (Request, error) {
	var r Request
	err := r.Read(h, body, l)
	return r, err
}

// Read is ReadRequest into r, in place: every field of r is set, as
// ReadRequest would return it. A caller that keeps the Request in a larger
// struct (the service's replier) spares the copies of a returned one.
func (r *Request) Read(h map[string][]string, body []byte, l Limits) error {
	*r = Request{}
	// Most requests have no headers: nothing to look up in them.
	hasHeaders := len(h) > 0
	if hasHeaders {
		if err := r.readHeaders(h); err != nil {
			return err
		}
	}
	count, token, tokened := SplitBody(body)
	if tokened {
		switch {
		case r.Token != "":
			r.Token = "" // which would a reply echo? neither
			return fmt.Errorf("%w: a token in both %s and the body", ErrBadToken, TokenHeader)
		case !ValidToken(token):
			return fmt.Errorf("%w: body token %q: want 1-%d characters of [A-Za-z0-9_-] after the count and one space", ErrBadToken, truncate(token, 80), MaxTokenLen)
		}
		r.Token, r.BodyToken, r.Direct = token, true, true
	}
	var err error
	if hasHeaders { // without, the format is FormatList, r.Format's zero
		if r.Format, err = ParseFormat(HeaderValues(h, FormatHeader)); err != nil {
			return err
		}
	}
	if r.N, err = ParseCount(count, l.MaxBatch); err != nil {
		return err
	}
	// A batch whose reply may not fit in one message is refused: a reply
	// in runs may need twice the bytes of a list.
	if r.N*ListBytesPerID < ReplyHeaderRoom {
		return nil // every server's max payload holds it: spare the call
	}
	if mp := l.MaxPayload(); r.N > Fits(mp, r.Format) {
		n := r.N
		r.N = 0
		return fmt.Errorf("%w %d: a reply of that many IDs may not fit in one message of this server (max payload %d bytes); at most %d (%s)",
			ErrBadCount, n, mp, Fits(mp, r.Format), r.Format)
	}
	return nil
}

// SplitBody splits a request body into its count and its token: a body
// "<count> <token>" (after ASCII white space is trimmed from both ends, the
// two fields separated by spaces or tabs) has a token, and tokened is
// true; any other body is all count (ParseCount reads it). The token is not
// checked here (ValidToken). It shares body's memory, not a copy (a
// request's hot path allocates nothing for it): body must not change while
// the token is used. A NATS message's body is its own (nats.go copies each
// message out of its read buffer) and nobody writes to it.
func SplitBody(body []byte) (count []byte, token string, tokened bool) {
	b := trimSpace(body)
	i := 0
	for i < len(b) && b[i] != ' ' && b[i] != '\t' {
		i++
	}
	if i == len(b) {
		return body, "", false
	}
	t := trimSpace(b[i:])
	return b[:i], unsafe.String(unsafe.SliceData(t), len(t)), true
}

// RequestToken returns the token of a request with headers h and body,
// and whether it came in the body (SplitBody) rather than in TokenHeader
// (its first value); "" if it has none. Nothing is checked: it is for
// responders other than the service (tests, a benchmark's baseline) that
// echo the token as a worker does, in the body's first line
// (AppendTokenLine) or in TokenHeader.
func RequestToken(h map[string][]string, body []byte) (token string, inBody bool) {
	if _, token, inBody = SplitBody(body); inBody {
		return token, true
	}
	if v := h[TokenHeader]; len(v) > 0 {
		return v[0], false
	}
	return "", false
}

// trimSpace trims the ASCII white space ParseCount ignores from b's ends.
func trimSpace(b []byte) []byte {
	isSpace := func(c byte) bool { return c == ' ' || c == '\t' || c == '\r' || c == '\n' }
	for len(b) > 0 && isSpace(b[0]) {
		b = b[1:]
	}
	for len(b) > 0 && isSpace(b[len(b)-1]) {
		b = b[:len(b)-1]
	}
	return b
}

// AppendTokenLine appends the first line of a reply with IDs to a request
// whose token came in its body: the token, then, if direct is not empty,
// one space and direct (the owner's direct subject, DirectSubject), then a
// newline. The IDs follow as in any reply.
func AppendTokenLine(dst []byte, token, direct string) []byte {
	dst = append(dst, token...)
	if direct != "" {
		dst = append(dst, ' ')
		dst = append(dst, direct...)
	}
	return append(dst, '\n')
}

// CutTokenLine reads the first line of a reply with IDs to a request whose
// token came in its body (AppendTokenLine): the token, the direct subject
// ("" if none) and the body after the line. ok is false if body has no
// newline. Nothing is checked: a reply is untrusted, and the requester
// compares the token with its own and the direct subject with CheckDirect.
func CutTokenLine(body []byte) (token, direct []byte, rest []byte, ok bool) {
	for i, c := range body {
		if c == '\n' {
			line := body[:i]
			for j, c := range line {
				if c == ' ' {
					return line[:j], line[j+1:], body[i+1:], true
				}
			}
			return line, nil, body[i+1:], true
		}
	}
	return nil, nil, nil, false
}

// HeaderValues returns the values of header key, matched without regard
// to case (NATS headers are case-sensitive; people type id-format).
func HeaderValues(h map[string][]string, key string) []string {
	if v, ok := h[key]; ok || len(h) == 0 {
		return v
	}
	for k, v := range h {
		if strings.EqualFold(k, key) {
			return v
		}
	}
	return nil
}
