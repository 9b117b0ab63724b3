package client

import (
	"errors"
	"fmt"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/nats-io/nats.go"
)

// The client's own request-reply: one subscription per connection on
// "<inbox>.*" (nc.NewInbox, so the connection's inbox prefix), shared by
// every Client on it, and a slot per request object, whose attempts get
// reply subjects "<inbox>.<slot>-<attempt>".
//
// Why not nc.RequestMsgWithContext: for every request it makes a channel
// and a reply subject (two allocations), and takes the connection's
// mutex three times (to file the channel in a map, to publish, and to
// find the channel when the reply comes), which every caller, nats.go's
// reader and its flusher contend for. That machinery cost more than the
// rest of the client, token and checks included (issue 38; `dispenser
// bench --modes client --cpuprofile` profiles the load generator). Here a
// request object keeps its channel and its reply subject's bytes, and the
// reply finds its slot by index, without a lock; the connection's mutex
// is taken once, to publish.
//
// Safety: a slot's reply subject is reused from one attempt to the next,
// the attempt number (gen) is not: each attempt draws 63 random bits from
// its request object's generator (the token's, a CSPRNG). The
// subscription's handler delivers a reply only to the attempt its subject
// names while it waits (want), and the attempt takes only a reply on its
// own subject: a late reply to an earlier attempt (one that timed out),
// of the same call or of another that got the request object or its slot
// since (a request object dropped by the pool's garbage collection gives
// its slot back, runtime.AddCleanup), reaches a later one only if their
// numbers are equal, one chance in 2^63. Random, not counted: a subject
// that can be guessed lets anything that may publish into the inbox, and
// reads nothing, pre-empt the reply with its own, which then fails the
// request (TestBlindForgerCannotPreemptAReply). What the reply holds is
// checked as before (check): the token is the only thing that makes a
// reply this request's, so even a matching number yields no ID.

// replies is the request-reply of one connection.
type replies struct {
	nc     *nats.Conn
	prefix string // "<inbox>.": the subscription is prefix+"*"
	sub    *nats.Subscription
	reqs   sync.Pool // *request, each holding a slot

	// slots is every slot, by index; it only grows, by a copy under mu,
	// so the handler reads it without a lock.
	slots atomic.Pointer[[]*slot]
	mu    sync.Mutex // protects free and the growth of slots
	free  []*slot    // slots whose request object was collected
}

// slot is where the replies to one request object's attempts arrive.
type slot struct {
	index uint32
	ch    chan *nats.Msg // capacity 1; a nil message: the connection closed
	// want is the attempt that waits for its reply, 0 while none does.
	want atomic.Uint64
	// subject is the reply subject's bytes up to the attempt (prefix,
	// index, '-'), with room for it: only the slot's holder (one
	// goroutine at a time) uses it.
	subject []byte
	base    int
}

// muxes is the replies of each connection in use by a Client; one is
// removed when its connection closes.
var (
	muxes   sync.Map   // *nats.Conn -> *replies
	muxesMu sync.Mutex // serializes the making of one
)

// repliesOf returns nc's replies, subscribing on its first use.
func repliesOf(nc *nats.Conn) (*replies, error) {
	if m, ok := muxes.Load(nc); ok {
		return m.(*replies), nil
	}
	muxesMu.Lock()
	defer muxesMu.Unlock()
	if m, ok := muxes.Load(nc); ok {
		return m.(*replies), nil
	}
	m := &replies{nc: nc, prefix: nc.NewInbox() + "."}
	m.reqs.New = m.newRequest
	empty := []*slot{}
	m.slots.Store(&empty)
	// Listening first: a connection that closes after the subscription
	// was made is seen.
	closed := nc.StatusChanged(nats.CLOSED)
	sub, err := nc.Subscribe(m.prefix+"*", m.deliver)
	if err != nil {
		nc.RemoveStatusListener(closed)
		return nil, fmt.Errorf("client: subscribing to replies on %s*: %w", m.prefix, err)
	}
	m.sub = sub
	muxes.Store(nc, m)
	go func() {
		<-closed
		nc.RemoveStatusListener(closed)
		muxes.CompareAndDelete(nc, m)
		m.wakeAll()
	}()
	return m, nil
}

// newRequest makes a request object with a slot of its own.
func (m *replies) newRequest() any {
	r := newRequestObject()
	m.mu.Lock()
	if n := len(m.free); n > 0 {
		r.slot = m.free[n-1]
		m.free = m.free[:n-1]
	} else {
		old := *m.slots.Load()
		s := &slot{index: uint32(len(old)), ch: make(chan *nats.Msg, 1)}
		s.subject = strconv.AppendUint(append(make([]byte, 0, len(m.prefix)+32), m.prefix...), uint64(s.index), 10)
		s.subject = append(s.subject, '-')
		s.base = len(s.subject)
		grown := append(old[:len(old):len(old)], s)
		m.slots.Store(&grown)
		r.slot = s
	}
	m.mu.Unlock()
	r.replies = m
	runtime.AddCleanup(r, m.freeSlot, r.slot)
	return r
}

// freeSlot gives s back once its request object is gone.
func (m *replies) freeSlot(s *slot) {
	s.want.Store(0)
	m.mu.Lock()
	m.free = append(m.free, s)
	m.mu.Unlock()
}

// get returns an empty request for n IDs on subject; put it back with
// release.
func (m *replies) get(subject string, n int) *request {
	r := m.reqs.Get().(*request)
	r.msg.Subject, r.n = subject, n
	return r
}

// deliver is the subscription's handler: it hands a reply to the attempt
// its subject names, if that attempt waits for it; anything else is
// dropped (a late reply, or one that no attempt asked for).
func (m *replies) deliver(msg *nats.Msg) {
	index, gen, ok := parseReplySubject(msg.Subject, m.prefix)
	if !ok {
		return
	}
	slots := *m.slots.Load()
	if index >= uint64(len(slots)) {
		return
	}
	s := slots[index]
	if !s.want.CompareAndSwap(gen, 0) { // one reply per attempt
		return
	}
	select {
	case s.ch <- msg:
	default: // a reply its attempt gave up on is still there: never
	}
}

// wakeAll ends the attempts that wait: the connection closed.
func (m *replies) wakeAll() {
	for _, s := range *m.slots.Load() {
		if s.want.Swap(0) != 0 {
			select {
			case <-s.ch: // a late reply in the way
			default:
			}
			select {
			case s.ch <- nil:
			default:
			}
		}
	}
}

// parseReplySubject returns the slot index and attempt of a reply subject
// prefix+"<index>-<gen>", false if it is not one.
func parseReplySubject(subject, prefix string) (index, gen uint64, ok bool) {
	if len(subject) <= len(prefix) || subject[:len(prefix)] != prefix {
		return 0, 0, false
	}
	rest := subject[len(prefix):]
	index, rest, ok = cutUint(rest)
	if !ok || len(rest) == 0 || rest[0] != '-' {
		return 0, 0, false
	}
	gen, rest, ok = cutUint(rest[1:])
	if !ok || rest != "" || gen == 0 {
		return 0, 0, false
	}
	return index, gen, true
}

// cutUint reads the decimal number at the start of s (1 to 19 digits).
func cutUint(s string) (v uint64, rest string, ok bool) {
	i := 0
	for ; i < len(s) && i < 19 && '0' <= s[i] && s[i] <= '9'; i++ {
		v = v*10 + uint64(s[i]-'0')
	}
	return v, s[i:], i > 0
}

// errAttemptEnded is exchange's error when its attempt ended without a
// reply: the caller knows why (its context's error, or its timer's).
var errAttemptEnded = errors.New("client: attempt ended")

// exchange sends r's message as a new attempt of r's slot and returns its
// reply, or errAttemptEnded when done or expired comes first, or the error
// of publishing it, or nats.ErrConnectionClosed. A reply of the server's
// that no one serves the subject is nats.ErrNoResponders, as with nats.go's
// requests.
func (r *request) exchange(done <-chan struct{}, expired <-chan time.Time) (*nats.Msg, error) {
	s, m := r.slot, r.replies
	select {
	case <-done: // ended before it began: nothing sent (as nats.go does)
		return nil, errAttemptEnded
	default:
	}
	select {
	case <-s.ch: // a reply that came after its attempt gave up
	default:
	}
	gen := r.rng.Uint64()>>1 | 1 // 63 random bits, never 0 (no attempt)
	b := strconv.AppendUint(s.subject[:s.base], gen, 10)
	// nats.go copies the reply subject into its buffer before publish
	// returns and keeps no reference to it: the bytes may be reused by
	// the next attempt.
	reply := unsafe.String(unsafe.SliceData(b), len(b))
	r.msg.Reply = reply
	s.want.Store(gen)
	err := m.nc.PublishMsg(&r.msg)
	r.msg.Reply = ""
	if err != nil {
		s.want.Store(0)
		return nil, err
	}
	for {
		select {
		case msg := <-s.ch:
			if msg == nil {
				return nil, nats.ErrConnectionClosed
			}
			if msg.Subject != reply {
				continue // a late reply to an earlier attempt (see replies)
			}
			if len(msg.Data) == 0 && msg.Header.Get("Status") == "503" {
				return nil, nats.ErrNoResponders
			}
			return msg, nil
		case <-done:
		case <-expired:
		}
		s.want.Store(0)
		return nil, errAttemptEnded
	}
}

// replies returns the request-reply of c's connection.
func (c *Client) replies() (*replies, error) {
	if m := c.mux.Load(); m != nil {
		return m, nil
	}
	m, err := repliesOf(c.nc)
	if err != nil {
		return nil, err
	}
	c.mux.Store(m)
	return m, nil
}
