package protocol

import (
	"fmt"
	"strings"
)

// Request is what a request for IDs asks for, as ReadRequest reads it.
type Request struct {
	// N is the count of IDs and Format the reply's format.
	N      int
	Format Format
	// Worker and Direct: the request carries WorkerHeader, DirectHeader
	// (any value).
	Worker, Direct bool
	// Token is the request's TokenHeader, to echo in every reply; "" if
	// it has none.
	Token string
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
	if len(h) == 0 {
		return r, nil
	}
	_, r.Worker = h[WorkerHeader]
	_, r.Direct = h[DirectHeader]
	var err error
	r.Token, err = ParseToken(HeaderValues(h, TokenHeader))
	return r, err
}

// ReadRequest reads a request for IDs, before anything is taken for it:
// its headers (ReadHeaders), its FormatHeader (ParseFormat), the count in
// its body (ParseCount, 1..l.MaxBatch) and whether a reply of that many IDs
// in that format fits in one message of the server (Fits), in that order.
// An error wraps ErrBadHeader (ErrBadToken for the token) or ErrBadCount
// (CodeBadRequest); the Request then has what was read before it, for the
// error's reply. A caller with checks of its own between the headers and
// the count (the service's hand-on and tag) fails an ErrBadToken at once
// and the others after its checks, as it did when it read them apart. It allocates
// nothing but its error.
func ReadRequest(h map[string][]string, body []byte, l Limits) (Request, error) {
	r, err := ReadHeaders(h)
	if err != nil {
		return r, err
	}
	if r.Format, err = ParseFormat(HeaderValues(h, FormatHeader)); err != nil {
		return r, err
	}
	if r.N, err = ParseCount(body, l.MaxBatch); err != nil {
		return r, err
	}
	// A batch whose reply may not fit in one message is refused: a reply
	// in runs may need twice the bytes of a list.
	if r.N*ListBytesPerID < ReplyHeaderRoom {
		return r, nil // every server's max payload holds it: spare the call
	}
	if mp := l.MaxPayload(); r.N > Fits(mp, r.Format) {
		n := r.N
		r.N = 0
		return r, fmt.Errorf("%w %d: a reply of that many IDs may not fit in one message of this server (max payload %d bytes); at most %d (%s)",
			ErrBadCount, n, mp, Fits(mp, r.Format), r.Format)
	}
	return r, nil
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
