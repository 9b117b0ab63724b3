// Package client is a small Go client of the dispenser ID service. It
// depends only on nats.go.
//
//	c, err := client.New(nc)
//	id, err := c.Segment(ctx, "orders")
//
// A Client is safe for concurrent use. It treats replies as untrusted:
// anything subscribed to the service's subjects can answer a request, so a
// reply that is not exactly the IDs asked for, well formed, fails with
// ErrBadReply and none of its IDs is used.
package client

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math"
	"strconv"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
)

// Errors mapped from the service's error codes. Errors returned by a Client
// wrap one of them (test with errors.Is) or a NATS error such as
// nats.ErrNoResponders or context.DeadlineExceeded.
var (
	// ErrBadRequest is code 400: a malformed count or an invalid tag.
	ErrBadRequest = errors.New("client: bad request")
	// ErrUnknownTag is code 404: the tag does not exist.
	ErrUnknownTag = errors.New("client: unknown tag")
	// ErrExhausted is code 410: the tag has run out of IDs (its next
	// segment would pass 2^63-1). Retrying does not help.
	ErrExhausted = errors.New("client: tag exhausted")
	// ErrUnavailable is code 503: try again later (store down and buffers
	// empty, snowflake lease not held, clock moved back, shutting down).
	ErrUnavailable = errors.New("client: service unavailable")
	// ErrInternal is code 500 or any other code.
	ErrInternal = errors.New("client: internal service error")
	// ErrBadReply means a reply broke the protocol: not exactly the IDs
	// asked for, in strictly increasing runs of valid IDs, in the format
	// asked for. Such a reply comes from something other than a worker (or
	// a faulty one); none of its IDs are used.
	ErrBadReply = errors.New("client: bad reply")
	// ErrClosed means the Client was closed.
	ErrClosed = errors.New("client: closed")
)

// Error is an error reply of the service.
type Error struct {
	Code        string // "400", "404", "410", "503", "500"
	Description string
}

func (e *Error) Error() string {
	return fmt.Sprintf("dispenser: %s %s", e.Code, e.Description)
}

// Is maps the reply code to the package's sentinel errors.
func (e *Error) Is(target error) bool {
	switch e.Code {
	case "400":
		return target == ErrBadRequest
	case "404":
		return target == ErrUnknownTag
	case "410":
		return target == ErrExhausted
	case "503":
		return target == ErrUnavailable
	}
	return target == ErrInternal
}

// Option configures a Client.
type Option func(*Client) error

// WithPrefix sets the subject prefix of the service (default "id").
func WithPrefix(prefix string) Option {
	return func(c *Client) error {
		if prefix == "" {
			return errors.New("client: empty prefix")
		}
		c.prefix = prefix
		return nil
	}
}

// WithTimeout bounds requests whose context has no deadline (default 2 s).
func WithTimeout(d time.Duration) Option {
	return func(c *Client) error {
		if d <= 0 {
			return fmt.Errorf("client: timeout %v: must be positive", d)
		}
		c.timeout = d
		return nil
	}
}

// WithPrefetch turns on client-side prefetch of segment IDs: per tag, the
// client keeps a local range of up to batch IDs fetched with
// "Id-Format: range" and refills it in the background when less than half
// is left, so most Segment calls never touch the network.
//
// Off by default, because it gives up ordering: IDs of one tag still never
// repeat, but a client hands them out in the order its ranges arrived, not
// in the order the workers issued them, and the unused rest of the local
// range is lost when the process exits (a gap, never a duplicate).
func WithPrefetch(batch int) Option {
	return func(c *Client) error {
		if batch < 2 || batch > maxCount {
			return fmt.Errorf("client: prefetch batch %d: want 2..%d", batch, maxCount)
		}
		c.prefetch = batch
		return nil
	}
}

// Client requests IDs from dispenser workers.
type Client struct {
	nc       *nats.Conn
	prefix   string
	timeout  time.Duration
	prefetch int

	ctx    context.Context // background refills; canceled by Close
	cancel context.CancelFunc

	mu    sync.Mutex // protects pools
	pools map[string]*pool
}

// New returns a Client that sends requests on nc.
func New(nc *nats.Conn, opts ...Option) (*Client, error) {
	if nc == nil {
		return nil, errors.New("client: nil connection")
	}
	c := &Client{nc: nc, prefix: "id", timeout: 2 * time.Second, pools: map[string]*pool{}}
	for _, o := range opts {
		if err := o(c); err != nil {
			return nil, err
		}
	}
	c.ctx, c.cancel = context.WithCancel(context.Background())
	return c, nil
}

// Close stops background refills. Prefetched IDs not yet taken are lost.
func (c *Client) Close() { c.cancel() }

// checkTag rejects a tag the service would reject (1-128 characters of
// [A-Za-z0-9_-]) before it becomes a subject.
func checkTag(tag string) error {
	ok := len(tag) > 0 && len(tag) <= 128
	for i := 0; ok && i < len(tag); i++ {
		c := tag[i]
		ok = 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '_' || c == '-'
	}
	if !ok {
		return fmt.Errorf("%w: invalid tag %q: want 1-128 characters of [A-Za-z0-9_-]", ErrBadRequest, tag)
	}
	return nil
}

// Segment returns one ID of tag.
func (c *Client) Segment(ctx context.Context, tag string) (int64, error) {
	if err := checkTag(tag); err != nil {
		return 0, err
	}
	if c.prefetch > 0 {
		return c.pool(tag).take(ctx)
	}
	ids, err := c.request(ctx, c.prefix+".segment."+tag, 1, false, minSegment)
	if err != nil {
		return 0, err
	}
	return ids[0], nil
}

// SegmentN returns n IDs of tag, in increasing order. Prefetch does not
// apply: the batch comes from the service in one request.
func (c *Client) SegmentN(ctx context.Context, tag string, n int) ([]int64, error) {
	if err := checkTag(tag); err != nil {
		return nil, err
	}
	return c.request(ctx, c.prefix+".segment."+tag, n, true, minSegment)
}

// Snowflake returns one snowflake ID.
func (c *Client) Snowflake(ctx context.Context) (int64, error) {
	ids, err := c.request(ctx, c.prefix+".snowflake", 1, false, minSnowflake)
	if err != nil {
		return 0, err
	}
	return ids[0], nil
}

// SnowflakeN returns n snowflake IDs, in increasing order.
func (c *Client) SnowflakeN(ctx context.Context, n int) ([]int64, error) {
	return c.request(ctx, c.prefix+".snowflake", n, true, minSnowflake)
}

// The smallest IDs of the protocol: segment IDs start at 1, snowflake IDs
// at 0.
const (
	minSegment   = 1
	minSnowflake = 0
)

// request asks subject for n IDs, each at least lowest, and returns them;
// ranges asks for the compact "first-last" reply format.
func (c *Client) request(ctx context.Context, subject string, n int, ranges bool, lowest int64) ([]int64, error) {
	runs, err := c.requestRuns(ctx, subject, n, ranges, lowest)
	if err != nil {
		return nil, err
	}
	// checkReply has made sure that the runs hold exactly n IDs, so no run
	// is longer than n and first+k below never passes last (which may be
	// 2^63-1).
	ids := make([]int64, 0, n)
	for _, r := range runs {
		for k := range r.last - r.first + 1 {
			ids = append(ids, r.first+k)
		}
	}
	return ids, nil
}

// run is the IDs first..last, both included.
type run struct{ first, last int64 }

// maxCount is the largest count a request can carry: the service reads at
// most nine digits.
const maxCount = 999_999_999

// requestRuns asks subject for n IDs, each at least lowest, and returns them
// as runs.
func (c *Client) requestRuns(ctx context.Context, subject string, n int, ranges bool, lowest int64) ([]run, error) {
	if n < 1 || n > maxCount {
		return nil, fmt.Errorf("%w: count %d: want 1..%d", ErrBadRequest, n, maxCount)
	}
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, c.timeout)
		defer cancel()
	}
	msg := nats.NewMsg(subject)
	if n > 1 {
		msg.Data = strconv.AppendInt(nil, int64(n), 10)
	}
	if ranges {
		msg.Header.Set("Id-Format", "range")
	}
	resp, err := c.nc.RequestMsgWithContext(ctx, msg)
	if err != nil {
		return nil, fmt.Errorf("client: %s: %w", subject, err)
	}
	if code := resp.Header.Get("Nats-Service-Error-Code"); code != "" {
		return nil, &Error{Code: code, Description: resp.Header.Get("Nats-Service-Error")}
	}
	runs, err := checkReply(resp.Data, n, ranges, lowest)
	if err != nil {
		return nil, fmt.Errorf("%w from %s: %w", ErrBadReply, subject, err)
	}
	return runs, nil
}

// checkReply parses the reply to a request for n IDs and checks it, as
// anything subscribed to the service's subjects may have sent it: exactly
// n IDs, each in lowest..2^63-1, in runs that strictly increase (no run
// overlaps or repeats another), the lines in the format asked for (ranges:
// "first-last" with first <= last; otherwise one ID per line), in decimal
// without signs, leading zeros or white space, separated by single
// newlines. The body's length is checked before anything is parsed, and no
// arithmetic passes 2^63-1.
func checkReply(body []byte, n int, ranges bool, lowest int64) ([]run, error) {
	if len(body) == 0 {
		return nil, errors.New("empty body")
	}
	// Each ID takes at most 20 bytes in a list ("9223372036854775807\n"),
	// each run at most 40 in ranges.
	limit := 20 * int64(n)
	if ranges {
		limit = 40 * int64(n)
	}
	if int64(len(body)) > limit {
		return nil, fmt.Errorf("body of %d bytes: %d IDs take at most %d", len(body), n, limit)
	}
	var runs []run
	left := int64(n) // IDs still to come
	for no := 1; ; no++ {
		line, rest, more := bytes.Cut(body, []byte{'\n'})
		var r run
		var err error
		if ranges {
			first, last, ok := bytes.Cut(line, []byte{'-'})
			if !ok {
				err = errors.New("want first-last")
			} else if r.first, err = parseID(first, lowest); err == nil {
				if r.last, err = parseID(last, lowest); err == nil && r.last < r.first {
					err = errors.New("last below first")
				}
			}
		} else {
			r.first, err = parseID(line, lowest)
			r.last = r.first
		}
		switch {
		case err != nil:
		case len(runs) > 0 && r.first <= runs[len(runs)-1].last:
			err = fmt.Errorf("does not start above the line before (%d)", runs[len(runs)-1].last)
		case r.last-r.first >= left: // no overflow: 0 <= first <= last
			// Refused at the first run too many, so that left and the
			// run sizes below stay within 0..n.
			err = fmt.Errorf("more IDs than the %d asked for", n)
		}
		if err != nil {
			return nil, fmt.Errorf("line %d %q: %w", no, truncate(line, 48), err)
		}
		runs = append(runs, r)
		left -= r.last - r.first + 1
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

// parseID parses an ID of the reply: 1 to 19 decimal digits without a
// sign or leading zeros, in lowest..2^63-1.
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

func truncate(s []byte, n int) string {
	if len(s) <= n {
		return string(s)
	}
	return string(s[:n]) + "..."
}

func (c *Client) pool(tag string) *pool {
	c.mu.Lock()
	defer c.mu.Unlock()
	p := c.pools[tag]
	if p == nil {
		p = &pool{c: c, tag: tag, ready: make(chan struct{})}
		c.pools[tag] = p
	}
	return p
}

// pool is the local range of one tag's prefetched IDs.
type pool struct {
	c   *Client
	tag string

	mu sync.Mutex // protects the fields below
	// runs are the IDs at hand, in increasing order; runs[0].first is next.
	runs    []run
	left    int           // IDs in runs
	filling bool          // a refill request is in flight
	ready   chan struct{} // closed and replaced when a refill ends
	err     error         // the last refill's error
}

// take returns the next prefetched ID, waiting for a refill when none is at
// hand.
func (p *pool) take(ctx context.Context) (int64, error) {
	for {
		p.mu.Lock()
		if p.left > 0 {
			r := &p.runs[0]
			id := r.first
			if r.first == r.last {
				p.runs = p.runs[1:]
			} else {
				r.first++
			}
			p.left--
			if p.left < p.c.prefetch/2 {
				p.refillLocked()
			}
			p.mu.Unlock()
			return id, nil
		}
		p.refillLocked()
		ready, err := p.ready, p.err
		p.mu.Unlock()
		select {
		case <-ready:
		case <-ctx.Done():
			return 0, ctx.Err()
		case <-p.c.ctx.Done():
			return 0, ErrClosed
		}
		p.mu.Lock()
		err = p.err
		empty := p.left == 0
		p.mu.Unlock()
		if empty && err != nil {
			return 0, err
		}
	}
}

// refillLocked starts a background refill unless one is in flight.
func (p *pool) refillLocked() {
	if p.filling || p.c.ctx.Err() != nil {
		return
	}
	p.filling = true
	go func() {
		runs, err := p.c.requestRuns(p.c.ctx, p.c.prefix+".segment."+p.tag, p.c.prefetch, true, minSegment)
		p.mu.Lock()
		defer p.mu.Unlock()
		p.filling = false
		p.err = err
		for _, r := range runs { // checked: prefetch IDs in all
			p.runs = append(p.runs, r)
			p.left += int(r.last - r.first + 1)
		}
		close(p.ready)
		p.ready = make(chan struct{})
	}()
}
