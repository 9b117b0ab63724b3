package client

import (
	crand "crypto/rand"
	"encoding/base64"
	"encoding/binary"
	"math/rand/v2"
	"strconv"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/dispenser-dev/dispenser/protocol"
)

// Request tokens (protocol.TokenHeader) must be unpredictable to anyone
// who sees other replies of the same connection (a tenant that can read
// the inbox sees every earlier token): 128 bits from a cryptographically
// strong generator. crypto/rand costs a system call on kernels without a
// getrandom vDSO, so each generator here is a ChaCha8 (math/rand/v2's,
// a CSPRNG) seeded with 32 bytes of crypto/rand, one per request object
// (below), which one goroutine at a time holds: a token costs about as
// much as formatting an ID (BenchmarkNewToken).

// request is one request's reusable parts: the message and its header
// map, the token, a buffer for the body, a token generator and the slot
// its replies arrive in (replies). A call takes one from its connection's
// replies and puts it back when it has returned: nats.go
// encodes the message, headers included, into its buffer when it
// publishes it and keeps no reference to it (the reply is a message of its
// own), and nothing of a request is handed to the caller. Reusing them
// saves a map, its entries and the body per request (BenchmarkClientCost).
type request struct {
	msg    nats.Msg
	n      int
	direct bool // ask for the owner's direct subject (a segment tag's request)
	// token is the attempt's token (newToken); tokenValue holds it as
	// msg.Header[protocol.TokenHeader] when it goes in the header.
	token      [tokenLen]byte
	tokenValue [1]string
	body       [protocol.MaxCountDigits + 1 + tokenLen]byte // msg.Data
	rng        *rand.ChaCha8
	// subjectOf is the prefix and tag of subject, the last subject built
	// (subject): most calls ask for the tag the request object last
	// served, and a subject built anew costs an allocation.
	subjectOf [2]string
	subjects  string
	// epoch is the attempt context of r's attempts without a deadline
	// of their own (attemptContext).
	epoch epoch
	// timer bounds an attempt near its deadline (Client.attempt), made
	// on first use.
	timer *time.Timer
	// slot is where the replies to r's attempts arrive, in replies.
	slot    *slot
	replies *replies
}

// subject returns prefix's subject for tag (snowflake IDs if tag is
// empty), reusing the one built last if it is the same.
func (r *request) subject(prefix, tag string) string {
	if r.subjects == "" || r.subjectOf != [2]string{prefix, tag} {
		if tag != "" {
			r.subjects = protocol.SegmentSubject(prefix, tag)
		} else {
			r.subjects = protocol.SnowflakeSubject(prefix)
		}
		r.subjectOf = [2]string{prefix, tag}
	}
	return r.subjects
}

// newRequestObject returns a request object without a slot (see
// replies.newRequest, which gives it one).
func newRequestObject() *request {
	var seed [32]byte
	if _, err := crand.Read(seed[:]); err != nil {
		panic("client: crypto/rand: " + err.Error()) // crypto/rand.Read does not fail on supported systems
	}
	return &request{msg: nats.Msg{Header: nats.Header{}}, rng: rand.NewChaCha8(seed)}
}

// release empties r and puts it back for another call.
func (r *request) release() {
	if len(r.msg.Header) > 0 {
		clear(r.msg.Header)
	}
	r.msg.Subject, r.msg.Data, r.tokenValue[0], r.direct = "", nil, "", false
	if r.replies != nil {
		r.replies.reqs.Put(r)
	}
}

// tokenLen is the length of a token: 16 bytes in unpadded base64url.
const tokenLen = 22

// newToken gives r's message a fresh token, 128 random bits in base64url
// (protocol.ValidToken): in its body after the count ("<count> <token>",
// protocol.SplitBody), or, if inBody is false, in protocol.TokenHeader with
// the count alone in the body (and protocol.DirectHeader if r.direct).
func (r *request) newToken(inBody bool) {
	var b [16]byte
	binary.LittleEndian.PutUint64(b[:8], r.rng.Uint64())
	binary.LittleEndian.PutUint64(b[8:], r.rng.Uint64())
	base64.RawURLEncoding.Encode(r.token[:], b[:])
	if inBody {
		d := strconv.AppendInt(r.body[:0], int64(r.n), 10)
		d = append(d, ' ')
		r.msg.Data = append(d, r.token[:]...)
		delete(r.msg.Header, protocol.TokenHeader)
		delete(r.msg.Header, protocol.DirectHeader)
		return
	}
	r.msg.Data = nil
	if r.n > 1 {
		r.msg.Data = strconv.AppendInt(r.body[:0], int64(r.n), 10)
	}
	r.tokenValue[0] = string(r.token[:])
	r.msg.Header[protocol.TokenHeader] = r.tokenValue[:]
	if r.direct {
		r.msg.Header[protocol.DirectHeader] = directWanted
	}
}

// tokenIs reports whether b is r's token.
func (r *request) tokenIs(b []byte) bool { return string(b) == string(r.token[:]) }

// newToken returns a fresh request token, as a request gets it.
func newToken() string {
	r := newRequestObject()
	r.n = 1
	r.newToken(true)
	return string(r.token[:])
}
