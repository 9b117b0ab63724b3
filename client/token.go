package client

import (
	crand "crypto/rand"
	"encoding/base64"
	"math/rand/v2"
	"sync"
)

// Request tokens (protocol.TokenHeader) must be unpredictable to anyone
// who sees other replies of the same connection (a tenant that can read
// the inbox sees every earlier token): 128 bits from a cryptographically
// strong generator. crypto/rand costs a system call on kernels without a
// getrandom vDSO, so each generator here is a ChaCha8 (math/rand/v2's,
// a CSPRNG) seeded with 32 bytes of crypto/rand, one per goroutine at a
// time through a sync.Pool: a token costs about as much as formatting an
// ID (BenchmarkNewToken).
var tokenRNG = sync.Pool{New: func() any {
	var seed [32]byte
	if _, err := crand.Read(seed[:]); err != nil {
		panic("client: crypto/rand: " + err.Error()) // crypto/rand.Read does not fail on supported systems
	}
	return rand.NewChaCha8(seed)
}}

// tokenLen is the length of a token: 16 bytes in unpadded base64url.
const tokenLen = 22

// newToken returns a fresh request token: 128 random bits, base64url
// (protocol.ValidToken).
func newToken() string {
	g := tokenRNG.Get().(*rand.ChaCha8)
	var b [16]byte
	_, _ = g.Read(b[:]) // never fails
	tokenRNG.Put(g)
	var out [tokenLen]byte
	base64.RawURLEncoding.Encode(out[:], b[:])
	return string(out[:])
}
