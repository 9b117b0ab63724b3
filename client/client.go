// Package client is a small Go client of the dispenser ID service. It
// depends only on nats.go and the wire protocol's package (protocol, which
// depends on nothing but the standard library).
//
//	c, err := client.New(nc)
//	id, err := c.Segment(ctx, "orders")
//
// A Client is safe for concurrent use. It treats replies as untrusted:
// anything subscribed to the service's subjects can answer a request, so a
// reply that is not exactly the IDs asked for, well formed, fails with
// ErrBadReply and none of its IDs is used. And anything that may publish to
// the client's inbox can send it a reply it did not ask for: every request
// carries a new, unpredictable token (128 random bits) in its body, after
// the count (protocol, "Tokens"), the workers echo it, and a reply without
// it or with another one (a forgery, or a worker older than the token)
// fails with ErrBadReply too, its IDs unused. A worker older than tokens
// in the body answers one with a 400 that lacks it: the client then sends
// the request again with the token in protocol.TokenHeader, and keeps to
// the header for a minute.
//
// Replies come to one subscription per connection, "<inbox>.*", made by
// the first request of any Client on it and ended when the connection
// closes; <inbox> is nc.NewInbox(), under the connection's inbox prefix
// (nats.CustomInboxPrefix), so a client needs the same permissions as
// nats.go's own requests. It is the client's, not nats.go's request
// machinery, which costs more per request than the rest of the client
// (replies.go says why, and why it is safe).
package client

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/dispenser-dev/dispenser/protocol"
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
	// It is also the error of a reply that does not carry the request's
	// token (in its first line, or protocol.TokenHeader): not a reply to
	// this request, or one of a worker older than the token.
	ErrBadReply = errors.New("client: bad reply")
	// ErrClosed means the Client was closed: Segment of a prefetching
	// client that has no ID at hand (Close).
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
	case protocol.CodeBadRequest:
		return target == ErrBadRequest
	case protocol.CodeNotFound:
		return target == ErrUnknownTag
	case protocol.CodeGone:
		return target == ErrExhausted
	case protocol.CodeUnavailable:
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

// WithTimeout bounds requests whose context has no deadline, retries
// included (default 5 s).
func WithTimeout(d time.Duration) Option {
	return func(c *Client) error {
		if d <= 0 {
			return fmt.Errorf("client: timeout %v: must be positive", d)
		}
		c.timeout = d
		return nil
	}
}

// WithoutRetries makes a request fail at its first failure. By default a
// request that found no worker (nats.ErrNoResponders), got no reply within
// an attempt (AttemptTimeout: a worker stopped, or the connection moved to
// another server), or was answered 503 is sent again, with a short backoff,
// until it succeeds or its context ends. Asking again is always safe: an
// ID handed out to a lost attempt is never handed out again (a gap, never
// a duplicate).
func WithoutRetries() Option {
	return func(c *Client) error {
		c.noRetry = true
		return nil
	}
}

// WithoutDirect makes the client send every request for a tag to
// <prefix>.segment.<tag>, ignoring protocol.DirectHeader. By default a
// reply of the owner of an ordered tag names the owner's direct subject
// (protocol.DirectSubject), and the client sends the tag's next requests
// there: to the owner, without the hop through another worker. A requester
// needs permission to publish to <prefix>.direct.<tag>.* for that; without
// it the first request to the direct subject waits an AttemptTimeout, and
// the client then keeps to <prefix>.segment.<tag> for that tag.
func WithoutDirect() Option {
	return func(c *Client) error {
		c.noDirect = true
		return nil
	}
}

// AttemptTimeout bounds one attempt of a request that is retried: longer
// than any reply of a worker takes (it answers 503 after at most its
// MaxWait, or 2 s for an ordered tag whose owner moves), shorter than the
// default request timeout. An attempt of a request whose context has
// neither a deadline nor a Done channel (context.Background) may wait up
// to attemptSlack longer, never past the client's timeout.
const AttemptTimeout = 2500 * time.Millisecond

// attemptSlack is how much longer than AttemptTimeout an attempt that
// uses a shared attempt context (attemptContext) may wait.
const attemptSlack = 50 * time.Millisecond

// Backoff between the attempts of a request.
const (
	retryMin = 5 * time.Millisecond
	retryMax = 200 * time.Millisecond
)

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
	noRetry  bool
	noDirect bool

	ctx    context.Context // background refills; canceled by Close
	cancel context.CancelFunc

	// Lock order: none of mu, directMu and a pool's mu is held while
	// another is taken (a pool's refill requests IDs on a goroutine of
	// its own, without the pool's mu).
	mu    sync.Mutex // protects pools
	pools map[string]*pool

	directMu sync.Mutex // protects direct's writes and directOff
	// direct is, per ordered tag, its owner's direct subject, from the
	// last reply that named it: a map never changed once stored (a write
	// stores a new one, under directMu), so that every request reads it
	// without a lock (a read lock's counter, shared by every caller, cost
	// more than the lookup).
	direct atomic.Pointer[map[string]string]
	// directOff is, per tag, until when its direct subject is not used:
	// one failed by timeout (a worker gone without a word, or a
	// permissions violation, then for good).
	directOff map[string]time.Time

	// mux is the request-reply of nc (replies), once a request made it.
	mux atomic.Pointer[replies]

	// headerUntil is until when (unix nanoseconds) tokens go in
	// protocol.TokenHeader rather than in the body: headerTokensFor after
	// a worker older than body tokens answered one.
	headerUntil atomic.Int64
}

// New returns a Client that sends requests on nc.
func New(nc *nats.Conn, opts ...Option) (*Client, error) {
	if nc == nil {
		return nil, errors.New("client: nil connection")
	}
	c := &Client{nc: nc, prefix: protocol.DefaultPrefix, timeout: 5 * time.Second, pools: map[string]*pool{},
		directOff: map[string]time.Time{}}
	for _, o := range opts {
		if err := o(c); err != nil {
			return nil, err
		}
	}
	c.ctx, c.cancel = context.WithCancel(context.Background())
	return c, nil
}

// Close stops background refills: Segment of a prefetching client still
// hands out the IDs at hand, then fails with ErrClosed (the rest of a
// range in flight is lost: a gap). Other requests, and those in flight,
// go on: they end with their contexts, or when the connection closes.
func (c *Client) Close() { c.cancel() }

// checkTag rejects a tag the service would reject before it becomes a
// subject.
func checkTag(tag string) error {
	if !protocol.ValidTag(tag) {
		return fmt.Errorf("%w: invalid tag %q: want %s", ErrBadRequest, tag, protocol.TagRule)
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
	return c.one(ctx, tag, minSegment)
}

// SegmentN returns n IDs of tag, in increasing order. Prefetch does not
// apply: the batch comes from the service in one request.
func (c *Client) SegmentN(ctx context.Context, tag string, n int) ([]int64, error) {
	if err := checkTag(tag); err != nil {
		return nil, err
	}
	return c.request(ctx, tag, n, true, minSegment)
}

// Formatted returns n numbers of tag written out in the tag's format (such
// as ORD-20261124-000123; Id-Format: formatted), in the order the service
// took them. A tag without a format fails with ErrBadRequest; a reply with
// a number twice fails with ErrBadReply. Prefetch does not apply.
func (c *Client) Formatted(ctx context.Context, tag string, n int) ([]string, error) {
	if err := checkTag(tag); err != nil {
		return nil, err
	}
	r, err := c.newRequest(protocol.SegmentSubject(c.prefix, tag), n)
	if err != nil {
		return nil, err
	}
	defer r.release()
	msg := &r.msg
	msg.Header[protocol.FormatHeader] = formatFormatted
	ans, err := c.send(ctx, r, "")
	if err != nil {
		return nil, err
	}
	out := strings.Split(string(ans.ids), "\n")
	if len(out) != n {
		return nil, fmt.Errorf("%w from %s: %d formatted numbers, want %d", ErrBadReply, msg.Subject, len(out), n)
	}
	for _, s := range out {
		if len(s) < 1 || len(s) > protocol.MaxFormattedBytes || strings.ContainsFunc(s, func(r rune) bool { return r <= ' ' || r > '~' }) {
			return nil, fmt.Errorf("%w from %s: %q is no formatted number", ErrBadReply, msg.Subject, truncate(s, 64))
		}
	}
	// No number twice: the service never hands one out twice, so a reply
	// that repeats one (in any order: a batch may cross a period) comes
	// from something other than a worker, like IDs that do not increase.
	sorted := slices.Sorted(slices.Values(out))
	for i := 1; i < len(sorted); i++ {
		if sorted[i] == sorted[i-1] {
			return nil, fmt.Errorf("%w from %s: %q twice", ErrBadReply, msg.Subject, truncate(sorted[i], 64))
		}
	}
	return out, nil
}

// truncate shortens s to n bytes for a message.
func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}

// Snowflake returns one snowflake ID.
func (c *Client) Snowflake(ctx context.Context) (int64, error) {
	return c.one(ctx, "", minSnowflake)
}

// one asks for one ID of tag (a snowflake ID if tag is empty), at least
// lowest, without the slice that request returns.
func (c *Client) one(ctx context.Context, tag string, lowest int64) (int64, error) {
	var arr [1]protocol.Run
	runs, err := c.requestRuns(ctx, tag, 1, false, lowest, arr[:0])
	if err != nil {
		return 0, err
	}
	return runs[0].First, nil // protocol.ParseIDs has checked: one run of one ID
}

// SnowflakeN returns n snowflake IDs, in increasing order.
func (c *Client) SnowflakeN(ctx context.Context, n int) ([]int64, error) {
	return c.request(ctx, "", n, true, minSnowflake)
}

// The smallest IDs of the protocol.
const (
	minSegment   = protocol.MinSegmentID
	minSnowflake = protocol.MinSnowflakeID
)

// request asks for n IDs of tag (snowflake IDs if tag is empty), each at
// least lowest, and returns them; ranges asks for the compact "first-last"
// reply format.
func (c *Client) request(ctx context.Context, tag string, n int, ranges bool, lowest int64) ([]int64, error) {
	// One ID is one line either way: no FormatHeader (a header costs a
	// request more than the rest of the client).
	var arr [1]protocol.Run
	runs, err := c.requestRuns(ctx, tag, n, ranges && n > 1, lowest, arr[:0])
	if err != nil {
		return nil, err
	}
	// protocol.ParseIDs has made sure that the runs hold exactly n IDs, so
	// no run is longer than n and First+k below never passes Last (which
	// may be 2^63-1).
	ids := make([]int64, 0, n)
	for _, r := range runs {
		for k := range r.Len() {
			ids = append(ids, r.First+k)
		}
	}
	return ids, nil
}

// maxCount is the largest count a request can carry.
const maxCount = protocol.MaxCount

// newRequest checks a count of n and returns the request for n IDs on
// subject; release it when the call returns.
func (c *Client) newRequest(subject string, n int) (*request, error) {
	if n < 1 || n > maxCount {
		return nil, fmt.Errorf("%w: count %d: want 1..%d", ErrBadRequest, n, maxCount)
	}
	m, err := c.replies()
	if err != nil {
		return nil, err
	}
	return m.get(subject, n), nil
}

// Values of protocol.FormatHeader, shared by all requests (nats.go only
// reads them).
var (
	formatRange     = []string{protocol.FormatRange.String()}
	formatFormatted = []string{protocol.FormatFormatted.String()}
)

// requestRuns asks for n IDs of tag (snowflake IDs if tag is empty), each
// at least lowest, and returns them as runs appended to dst.
func (c *Client) requestRuns(ctx context.Context, tag string, n int, ranges bool, lowest int64, dst []protocol.Run) ([]protocol.Run, error) {
	r, err := c.newRequest("", n)
	if err != nil {
		return nil, err
	}
	r.msg.Subject = r.subject(c.prefix, tag)
	defer r.release()
	msg := &r.msg
	format := protocol.FormatList
	if ranges {
		format = protocol.FormatRange
		msg.Header[protocol.FormatHeader] = formatRange
	}
	r.direct = tag != "" && !c.noDirect // the owner names its direct subject
	ans, err := c.send(ctx, r, tag)
	if err != nil {
		return nil, err
	}
	runs, err := protocol.AppendParsedIDs(dst, ans.ids, n, format, lowest)
	if err != nil {
		return nil, fmt.Errorf("%w from %s: %w", ErrBadReply, msg.Subject, err)
	}
	if tag != "" && len(ans.direct) > 0 {
		c.learnDirect(tag, string(ans.direct))
	}
	return runs, nil
}

// send sends r's message and returns the reply with IDs, retrying what is
// safe to retry (see WithoutRetries) until ctx ends, or the client's
// timeout if ctx has no deadline. An error reply is returned as *Error. A
// request for tag (empty for snowflake IDs) goes to the tag's direct
// subject if the client knows one; if that fails with CodeMisdirected, no
// responders or a timeout (the owner moved, or is gone), the client
// forgets it and sends the request to the message's subject at once,
// retries or not: a request lost on the way is a gap, never a duplicate.
func (c *Client) send(ctx context.Context, r *request, tag string) (answer, error) {
	msg := &r.msg
	// The request's deadline: ctx's, or the client's timeout from now
	// (own). It is kept as a time, not as a context of its own: most
	// requests end at their first attempt, and a context with a timer
	// for each would cost more than a NATS round trip's own work
	// (BenchmarkClientCost).
	// One reading of the clock for the deadline and the first attempt.
	now := time.Now()
	deadline, hasDeadline := ctx.Deadline()
	own := !hasDeadline
	if own {
		deadline = now.Add(c.timeout)
	}
	backoff := retryMin
	var last error
	segment := msg.Subject
	direct := false
	if tag != "" {
		msg.Subject, direct = c.directSubject(tag, segment)
	}
	for first := true; ; first = false {
		if !first {
			now = time.Now()
		}
		// A new token for every attempt: an error reply shows its
		// attempt's token to whoever can read the inbox.
		inBody := c.tokensInBody()
		r.newToken(inBody)
		resp, err := c.attempt(ctx, r, now, deadline, own, !c.noRetry || direct)
		if err == nil {
			var ans answer
			switch ans, err = c.check(resp, r, inBody); {
			case err == nil:
				return ans, nil
			case errors.Is(err, errOlderWorker):
				// Nothing was taken: send it again at once, with the
				// token in the header. (A forged 400 can make the
				// client do so too: it costs a round trip, no more.)
				c.headerUntil.Store(time.Now().Add(headerTokensFor).UnixNano())
				continue
			case errors.Is(err, ErrBadReply):
				return answer{}, err
			}
		} else {
			err = fmt.Errorf("client: %s: %w", msg.Subject, err)
		}
		ended := requestEnded(ctx, deadline)
		if direct && ended == nil {
			var e *Error
			moved := errors.As(err, &e) && e.Code == protocol.CodeMisdirected
			timedOut := errors.Is(err, context.DeadlineExceeded) || errors.Is(err, nats.ErrTimeout)
			if moved || timedOut || retryable(err) {
				c.forgetDirect(tag, msg.Subject, timedOut)
				msg.Subject, direct = segment, false
				if moved || timedOut || errors.Is(err, nats.ErrNoResponders) {
					continue // the owner moved or went: ask the queue group now
				}
			}
		}
		if ended != nil && last != nil && errors.Is(err, ended) {
			err = last // the deadline cut a retry short: say why it was retried
		}
		if c.noRetry || ended != nil || !retryable(err) {
			return answer{}, err
		}
		last = err
		t := time.NewTimer(min(backoff, time.Until(deadline)))
		select {
		case <-ctx.Done():
			t.Stop()
			return answer{}, last
		case <-t.C:
		}
		if requestEnded(ctx, deadline) != nil {
			return answer{}, last
		}
		backoff = min(2*backoff, retryMax)
	}
}
