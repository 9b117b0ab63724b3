package client

import (
	crand "crypto/rand"
	"encoding/base64"
	"math/rand/v2"
	"strconv"
	"sync"

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
// map, the token header's value, a buffer for the count and a token
// generator. A call takes one from requests and puts it back when it has
// returned: nats.go encodes the message, headers included, into its
// buffer when it publishes it and keeps no reference to it (the reply is
// a message of its own), and nothing of a request is handed to the
// caller. Reusing them saves a map, its entries and the header values per
// request (BenchmarkClientCost).
type request struct {
	msg   nats.Msg
	token [1]string // msg.Header[protocol.TokenHeader]
	count [20]byte  // msg.Data for a count above 1
	rng   *rand.ChaCha8
}

var requests = sync.Pool{New: func() any {
	var seed [32]byte
	if _, err := crand.Read(seed[:]); err != nil {
		panic("client: crypto/rand: " + err.Error()) // crypto/rand.Read does not fail on supported systems
	}
	return &request{msg: nats.Msg{Header: nats.Header{}}, rng: rand.NewChaCha8(seed)}
}}

// getRequest returns an empty request for n IDs on subject; put it back
// with release.
func getRequest(subject string, n int) *request {
	r := requests.Get().(*request)
	r.msg.Subject = subject
	if n > 1 {
		r.msg.Data = strconv.AppendInt(r.count[:0], int64(n), 10)
	}
	return r
}

// release empties r and puts it back for another call.
func (r *request) release() {
	clear(r.msg.Header)
	r.msg.Subject, r.msg.Data, r.token[0] = "", nil, ""
	requests.Put(r)
}

// tokenLen is the length of a token: 16 bytes in unpadded base64url.
const tokenLen = 22

// newToken sets a fresh request token on r's message and returns it: 128
// random bits, base64url (protocol.ValidToken).
func (r *request) newToken() string {
	var b [16]byte
	_, _ = r.rng.Read(b[:]) // never fails
	var out [tokenLen]byte
	base64.RawURLEncoding.Encode(out[:], b[:])
	r.token[0] = string(out[:])
	r.msg.Header[protocol.TokenHeader] = r.token[:]
	return r.token[0]
}

// newToken returns a fresh request token, as a request gets it.
func newToken() string {
	r := getRequest("", 1)
	defer r.release()
	return r.newToken()
}
