package bench

import (
	"context"
	crand "crypto/rand"
	"encoding/base64"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/dispenser-dev/dispenser/protocol"
	"github.com/nats-io/nats.go"
)

// The load child's callers: targets loaded the way an application calls,
// through the Go client or as raw nc.RequestWithContext calls (with or
// without a token), one goroutine per request in flight.

// clientTarget returns the client prefix and tag of a subject loaded
// through the Go client.
func clientTarget(subject string) (prefix, tag string, ok bool) {
	rest, ok := strings.CutPrefix(subject, clientPrefix)
	if !ok {
		return "", "", false
	}
	prefix, tag, ok = strings.Cut(rest, ".segment.")
	return prefix, tag, ok && prefix != "" && protocol.ValidTag(tag)
}

// rawPrefix marks a subject loaded with plain nc.RequestWithContext calls,
// one ID each: "raw:<subject>". Like the Go client's targets, and with the
// same callers (see callers), but without the client: the Go client's
// baseline.
const rawPrefix = "raw:"

// tokenPrefix marks a subject loaded like a rawPrefix one, but with a new
// token in each request's body ("1 <token>": 128 bits of a ChaCha8 seeded
// from crypto/rand, as the Go client makes and sends them) whose echo in
// the reply's first line is checked: the protocol's share of the Go
// client's cost.
const tokenPrefix = "token:"

// tokenRNG holds the generators of tokenPrefix targets.
var tokenRNG = sync.Pool{New: func() any {
	var seed [32]byte
	if _, err := crand.Read(seed[:]); err != nil {
		panic("load: crypto/rand: " + err.Error()) // crypto/rand.Read does not fail on supported systems
	}
	return rand.NewChaCha8(seed)
}}

// newToken returns a request token: 128 random bits, base64url.
func newToken() string {
	g := tokenRNG.Get().(*rand.ChaCha8)
	var b [16]byte
	_, _ = g.Read(b[:])
	tokenRNG.Put(g)
	return base64.RawURLEncoding.EncodeToString(b[:])
}

// callers loads target t (index i) until end the way an application calls
// the Go client: one goroutine per request in flight (cfg.Inflight
// callers), each sending its next request when the last one returns.
// Their slots are all free when a slice starts (the last one waited for
// its replies, or the run stopped); it returns the requests sent.
func (l *loader) callers(ctx context.Context, t *target, i int, end int64, measured bool) uint64 {
	var sent atomic.Uint64
	var wg sync.WaitGroup
	done := ctx.Done()
	for range len(l.free) {
		slot := <-l.free
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() { l.free <- slot }()
			var n uint64
			defer func() { sent.Add(n) }()
			for {
				select {
				case <-done:
					return
				default:
				}
				now := l.now()
				if now >= end {
					return
				}
				l.sent[slot].Store(now)
				l.slotTgt[slot].Store(int32(i))
				l.slotMeas[slot].Store(measured)
				l.busy[slot].Store(true)
				n++
				if !l.call(t, slot) {
					return
				}
			}
		}()
	}
	wg.Wait()
	return sent.Load()
}

// call sends slot's request to t, through the Go client or as a raw
// request, and records the reply; false if the slot was answered twice.
func (l *loader) call(t *target, slot int32) bool {
	var reply []segmentRun
	var ids int
	var err error
	if t.raw != "" {
		var m *nats.Msg
		var token string
		if t.token {
			// The token in the body, as the Go client sends it, and
			// its echo in the reply's first line checked.
			token = newToken()
			m, err = l.nc.RequestWithContext(context.Background(), t.raw, []byte("1 "+token))
			if err == nil && len(m.Header) == 0 {
				tok, _, rest, ok := protocol.CutTokenLine(m.Data)
				if !ok || string(tok) != token {
					err = fmt.Errorf("%w: token line %.40q, want the request's", errBadReply, tok)
				}
				m.Data = rest
			}
		} else {
			m, err = l.nc.RequestWithContext(context.Background(), t.raw, nil)
		}
		if err == nil {
			var id int64
			if id, err = checkRaw(m); err == nil {
				ids = 1
				if l.cfg.Verify {
					reply = []segmentRun{{id, id}}
				}
			}
		}
	} else {
		var got []int64
		if l.cfg.Batch == 1 { // one ID: the call a user makes for it
			var id int64
			if id, err = t.client.Segment(context.Background(), t.tag); err == nil {
				ids = 1
				if l.cfg.Verify {
					reply = []segmentRun{{id, id}}
				}
			}
		} else {
			got, err = t.client.SegmentN(context.Background(), t.tag, l.cfg.Batch)
			ids = len(got)
		}
		if err == nil && l.cfg.Verify {
			for _, id := range got {
				if n := len(reply); n > 0 && reply[n-1].Last+1 == id {
					reply[n-1].Last = id
				} else {
					reply = append(reply, segmentRun{id, id})
				}
			}
		}
	}
	now := l.now()
	if err != nil && !errors.Is(err, errBadReply) {
		err = fmt.Errorf("%w: %w", errErrorReply, err)
	}
	if !l.busy[slot].CompareAndSwap(true, false) {
		t.fail(fmt.Errorf("%w: slot %d answered twice", errBadReply, slot))
		return false
	}
	l.record(now, int(slot), ids, reply, err)
	return true
}

// checkRaw returns the ID of a raw request's reply: one ID, no error
// headers.
func checkRaw(m *nats.Msg) (int64, error) {
	if code := m.Header.Get(protocol.ErrorCodeHeader); code != "" {
		return 0, fmt.Errorf("%w %s: %s", errErrorReply, code, m.Header.Get(protocol.ErrorHeader))
	}
	id, ok := parseID(m.Data)
	if !ok {
		return 0, fmt.Errorf("%w: %q is no ID", errBadReply, truncateBytes(m.Data))
	}
	return id, nil
}
