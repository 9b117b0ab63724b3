// Package dispenser serves unique IDs over NATS as a micro service named
// "dispenser": segment IDs on <prefix>.segment.<tag> and snowflake IDs on
// <prefix>.snowflake, in a queue group so that many workers share the load.
package dispenser

import (
	"context"
	"errors"
	"fmt"
	"github.com/dispenser-dev/dispenser/protocol"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/dispenser-dev/dispenser/internal/kvbucket"
	"github.com/dispenser-dev/dispenser/ordered"
	"github.com/dispenser-dev/dispenser/segment"
	"github.com/dispenser-dev/dispenser/snowflake"
)

// Snowflake issues snowflake IDs; *snowflake.Worker implements it.
type Snowflake interface {
	// AppendIDs appends n IDs to dst. Errors for which Unavailable reports
	// true are answered with 503, others with 500.
	AppendIDs(dst []int64, n int) ([]int64, error)
	// Unavailable reports whether err means "try again later".
	Unavailable(err error) bool
	// Epoch is the time of timestamp 0, for decoding IDs.
	Epoch() time.Time
	// Stats returns the lease and generator state for micro stats.
	Stats() any
}

// Config configures a Service. Zero values mean the documented defaults.
type Config struct {
	// Conn is the NATS connection to serve on. Required. Use a connection of
	// its own: Stop waits until all of its subscriptions are drained.
	Conn *nats.Conn
	// Segments serves <prefix>.segment.<tag>; nil leaves the endpoint out.
	Segments *segment.Allocator
	// Snowflake serves <prefix>.snowflake and <prefix>.snowflake.decode;
	// nil leaves them out.
	Snowflake Snowflake
	// Prefix is the first subject token. Default "id".
	Prefix string
	// QueueGroup is the endpoints' queue group. Default "dispenser".
	QueueGroup string
	// MaxBatch is the most IDs one request may ask for. Default 10000.
	MaxBatch int
	// Version is the service version reported by micro. Default "0.1.0".
	Version string
	// Store names the segment store (e.g. "postgres:host:5432/ids" or
	// "kv:dispenser_segments"). It is published in the micro metadata under
	// StoreMetadata, so that workers can refuse to share a queue group with
	// a worker of another store: two stores hand out the same IDs.
	Store string
	// SnowflakeLeases names the snowflake lease bucket and epoch (e.g.
	// "dispenser_workers@<bucket creation time> epoch <epoch>"). It is
	// published in the micro metadata under SnowflakeMetadata, so that
	// workers can refuse to share a queue group with a worker that leases
	// its worker IDs elsewhere: both would issue the same IDs.
	SnowflakeLeases string
	// Logger receives unexpected errors. Default slog.Default().
	Logger *slog.Logger
	// Registerer, if set, receives the service's Prometheus metrics.
	Registerer prometheus.Registerer
	// MetricsTags names the tags whose requests and buffers get metric
	// series of their own; all others are counted together (tag ""), so
	// that a scrape stays small whatever the number of tags.
	MetricsTags []string
	// Owners, if set, serves ordered tags: only a tag's owner serves it,
	// other workers forward its requests to the owner. Without it, requests
	// for ordered tags get 503.
	Owners ordered.Owners
	// OwnerSubject is where this worker takes forwarded requests
	// (OwnerSubject.<tag>); it must be the subject its Owners records.
	// Required with Owners.
	OwnerSubject string
	// PeerCheck, if positive, is how long New waits for the running
	// dispenser workers to describe themselves before it serves: it
	// refuses (ErrPeerMismatch) to join a queue group whose workers use
	// another Store or other SnowflakeLeases. Zero: no check.
	PeerCheck time.Duration
	// ReadyTimeout is how long New waits for the allocator's tag list
	// before it serves without the segment endpoint, which it then adds
	// once the list has loaded: a worker that cannot reach its store must
	// not take a share of the segment requests its peers could serve.
	// Default 2 s.
	ReadyTimeout time.Duration
}

// Service is a running dispenser micro service. It is safe for concurrent use.
type Service struct {
	cfg     Config
	svc     micro.Service
	baseSub int            // subscriptions on Conn before the service
	parked  sync.WaitGroup // requests waiting for a segment
	bufs    sync.Pool      // *[]byte reply buffers
	metrics *metrics       // nil without Config.Registerer
	id      string         // micro service ID: unique per worker process
	// segPrefix is "<prefix>.segment.", the subject before a tag.
	segPrefix  string
	segScratch scratch // the segment handler's
	sfScratch  scratch // the snowflake handler's
	group      micro.Group
	bg         sync.WaitGroup // adds the segment endpoint late
	done       chan struct{}  // closed by Stop
	// ordered serves the ordered tags; nil without Owners or Segments.
	ordered *ordered.Tags
	// own are the subject prefixes no reply goes to (CheckReply).
	own []string
	// noReply and badReply count requests refused for their reply subject
	// (none, or one CheckReply refuses); refuseLog spaces their log lines.
	noReply, badReply atomic.Uint64
	refuseLog         rateLimit

	mu      sync.Mutex // protects stopped and adding endpoints
	stopped bool

	statsMu sync.Mutex // protects statsAt and segStats
	// segStats is the segment endpoint's stats as of statsAt: $SRV.STATS
	// requests within statsEvery get it again instead of a new walk over
	// every tag. statsAt is zero when the last walk was over few tags.
	statsAt  time.Time
	segStats any
	now      func() time.Time // time.Now; tests set it
}

// statsEvery bounds how often micro stats walk the tags when there are
// StatsTags or more of them: however many $SRV.STATS requests come in, at
// most once per statsEvery. With fewer, every request gets fresh stats.
const statsEvery = time.Second

// ID returns the micro service ID of this worker.
func (s *Service) ID() string { return s.id }

// StoreMetadata is the micro metadata key naming a worker's segment store.
const StoreMetadata = "store"

// SnowflakeMetadata is the micro metadata key naming a worker's snowflake
// lease bucket and epoch (Config.SnowflakeLeases).
const SnowflakeMetadata = "snowflake"

// Name is the micro service name.
const Name = "dispenser"

// New validates cfg, registers the micro service and starts serving.
func New(cfg Config) (*Service, error) {
	if cfg.Conn == nil {
		return nil, errors.New("dispenser: Config.Conn is required")
	}
	if cfg.Segments == nil && cfg.Snowflake == nil {
		return nil, errors.New("dispenser: nothing to serve: set Segments or Snowflake")
	}
	if cfg.Prefix == "" {
		cfg.Prefix = "id"
	}
	if cfg.QueueGroup == "" {
		cfg.QueueGroup = "dispenser"
	}
	if cfg.MaxBatch == 0 {
		cfg.MaxBatch = 10000
	}
	if cfg.Version == "" {
		cfg.Version = "0.1.0"
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.ReadyTimeout == 0 {
		cfg.ReadyTimeout = 2 * time.Second
	}
	if !validSubjectPrefix(cfg.Prefix) {
		return nil, fmt.Errorf("dispenser: subject prefix %q: want dot-separated tokens without wildcards or spaces", cfg.Prefix)
	}
	// A decimal list of MaxBatch IDs, with the reply's headers, must fit in
	// one message.
	if limit := fits(cfg.Conn.MaxPayload(), protocol.FormatList); cfg.MaxBatch < 1 || cfg.MaxBatch > limit || cfg.MaxBatch > 1e9 {
		return nil, fmt.Errorf("dispenser: MaxBatch %d: want 1..%d (the server's max payload less %d bytes for headers, / %d bytes an ID)",
			cfg.MaxBatch, limit, replyHeaderRoom, protocol.ListBytesPerID)
	}
	if cfg.Owners != nil && (cfg.OwnerSubject == "" || !validSubjectPrefix(cfg.OwnerSubject)) {
		return nil, fmt.Errorf("dispenser: OwnerSubject %q: want dot-separated tokens without wildcards (required with Owners)", cfg.OwnerSubject)
	}
	s := &Service{cfg: cfg, baseSub: cfg.Conn.NumSubscriptions(), own: []string{cfg.Prefix}, now: time.Now}
	if cfg.OwnerSubject != "" {
		s.own = append(s.own, cfg.OwnerSubject)
	}
	s.bufs.New = func() any { b := make([]byte, 0, 64); return &b }
	svc, err := micro.AddService(cfg.Conn, micro.Config{
		Name:    Name,
		Version: cfg.Version,
		Metadata: map[string]string{StoreMetadata: cfg.Store, SnowflakeMetadata: cfg.SnowflakeLeases,
			PrefixMetadata: cfg.Prefix, QueueGroupMetadata: cfg.QueueGroup},
		Description:  "Unique 64-bit IDs: segment (per-tag sequences) and snowflake",
		QueueGroup:   cfg.QueueGroup,
		StatsHandler: s.stats,
	})
	if err != nil {
		return nil, fmt.Errorf("dispenser: adding micro service: %w", err)
	}
	s.svc = svc
	s.id = svc.Info().ID
	s.segPrefix = protocol.SegmentSubject(cfg.Prefix, "")
	if cfg.PeerCheck > 0 {
		err := cfg.Conn.FlushTimeout(5 * time.Second) // others can see this worker now
		if err == nil {
			err = s.checkPeers(cfg.PeerCheck)
		}
		if err != nil {
			_ = svc.Stop()
			return nil, err
		}
	}
	if cfg.Owners != nil && cfg.Segments != nil { // before any request can be routed
		s.ordered, err = ordered.New(ordered.Settings{Conn: cfg.Conn, Allocator: cfg.Segments, Owners: cfg.Owners,
			Subject: cfg.OwnerSubject, Replies: replies{s}, MaxBatch: cfg.MaxBatch, Logger: cfg.Logger}, s.id)
		if err != nil {
			_ = svc.Stop()
			return nil, fmt.Errorf("dispenser: %w", err)
		}
	}
	m, err := newMetrics(cfg.Registerer, s)
	if err != nil {
		if s.ordered != nil {
			_ = s.ordered.Drain()
			s.ordered.Leave()
		}
		_ = svc.Stop()
		return nil, fmt.Errorf("dispenser: registering metrics: %w", err)
	}
	s.metrics = m
	g := svc.AddGroup(cfg.Prefix)
	s.group = g
	s.done = make(chan struct{})
	if cfg.Segments != nil {
		select {
		case <-cfg.Segments.Loaded():
			err = s.addSegmentEndpoint()
		case <-time.After(cfg.ReadyTimeout):
			cfg.Logger.Warn("dispenser: segment store not reachable yet; serving segments once the tag list has loaded")
			s.bg.Add(1)
			go s.addSegmentEndpointWhenLoaded()
		}
	}
	if err == nil && cfg.Snowflake != nil {
		err = g.AddEndpoint("snowflake", micro.HandlerFunc(s.handleSnowflake),
			micro.WithEndpointMetadata(map[string]string{
				"description": "snowflake IDs: body empty or a count N; header Id-Format: list|range",
			}))
		if err == nil {
			err = g.AddEndpoint("snowflake_decode", micro.HandlerFunc(s.handleDecode),
				micro.WithEndpointSubject("snowflake.decode"),
				micro.WithEndpointMetadata(map[string]string{
					"description": "body a snowflake ID; replies JSON with time, worker and sequence",
				}))
		}
	}
	if err != nil {
		s.stop()
		return nil, fmt.Errorf("dispenser: adding endpoint: %w", err)
	}
	// Make sure the server knows our subscriptions before we say we serve.
	if err := cfg.Conn.FlushTimeout(5 * time.Second); err != nil {
		s.stop()
		return nil, fmt.Errorf("dispenser: flushing subscriptions: %w", err)
	}
	return s, nil
}

// addSegmentEndpoint adds the segment endpoint unless the service stopped.
func (s *Service) addSegmentEndpoint() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.stopped {
		return nil
	}
	return s.group.AddEndpoint("segment", micro.HandlerFunc(s.handleSegment),
		micro.WithEndpointSubject("segment.>"), // dotted tags get their 400
		micro.WithEndpointMetadata(map[string]string{
			"description": "IDs of a tag: body empty or a count N; header Id-Format: list|range",
		}))
}

// addSegmentEndpointWhenLoaded adds the segment endpoint once the
// allocator's tag list has loaded, unless the service stops first.
func (s *Service) addSegmentEndpointWhenLoaded() {
	defer s.bg.Done()
	select {
	case <-s.cfg.Segments.Loaded():
	case <-s.done:
		return
	}
	if err := s.addSegmentEndpoint(); err != nil {
		s.cfg.Logger.Error("dispenser: adding the segment endpoint", "err", err)
		return
	}
	if err := s.cfg.Conn.Flush(); err != nil {
		s.cfg.Logger.Warn("dispenser: flushing the segment endpoint", "err", err)
	}
	s.cfg.Logger.Info("dispenser: segment store reachable; serving segments")
}

func validSubjectPrefix(p string) bool {
	for _, tok := range strings.Split(p, ".") {
		if tok == "" || strings.ContainsAny(tok, "*> \t\r\n") {
			return false
		}
	}
	return true
}

// Info returns the micro service's identity and endpoints.
func (s *Service) Info() micro.Info { return s.svc.Info() }

// Stop stops taking requests and waits, at most until ctx ends, until the
// requests already received have been answered. It does not close the
// allocator or the snowflake worker: their owner does that after Stop.
func (s *Service) Stop(ctx context.Context) error {
	if err := s.stop(); err != nil {
		s.leaveOrdered()
		return fmt.Errorf("dispenser: stopping: %w", err)
	}
	// micro drains the subscriptions: messages already received are still
	// handled. Wait for the drains to finish, then for parked requests. A
	// drain cannot finish without a server (it waits for a flush): while
	// disconnected there is nobody to answer anyway, so stop waiting.
	tick := time.NewTicker(time.Millisecond)
	defer tick.Stop()
	for s.cfg.Conn.NumSubscriptions() > s.baseSub && s.cfg.Conn.IsConnected() {
		select {
		case <-ctx.Done():
			s.leaveOrdered()
			return fmt.Errorf("dispenser: draining requests: %w", ctx.Err())
		case <-tick.C:
		}
	}
	s.leaveOrdered() // no handler runs any more: send what it holds
	done := make(chan struct{})
	go func() { s.parked.Wait(); close(done) }()
	select {
	case <-done:
	case <-ctx.Done():
		return fmt.Errorf("dispenser: waiting for parked requests: %w", ctx.Err())
	}
	if s.ordered != nil {
		if err := s.ordered.Wait(ctx); err != nil {
			return fmt.Errorf("dispenser: %w", err)
		}
	}
	return nil
}

// leaveOrdered makes the ordered tags' forwarder send what it holds and
// stop.
func (s *Service) leaveOrdered() {
	if s.ordered != nil {
		s.ordered.Leave()
	}
}

// stop ends adding endpoints and stops the micro service, which drains the
// endpoints' subscriptions.
func (s *Service) stop() error {
	s.mu.Lock()
	if !s.stopped {
		s.stopped = true
		close(s.done)
	}
	s.mu.Unlock()
	s.bg.Wait()
	if s.ordered != nil {
		if err := s.ordered.Drain(); err != nil {
			s.cfg.Logger.Warn("dispenser: stopping", "err", err)
		}
	}
	return s.svc.Stop()
}

// StatsTags is the most tags whose state micro stats shows: beyond it, those
// fetched most recently, so that the reply fits in a NATS message.
const StatsTags = 1000

func (s *Service) stats(e *micro.Endpoint) any {
	switch e.Name {
	case "segment":
		s.statsMu.Lock()
		defer s.statsMu.Unlock()
		if now := s.now(); now.Sub(s.statsAt) >= statsEvery || now.Before(s.statsAt) {
			var many bool
			s.segStats, many = s.segmentStats()
			s.statsAt = time.Time{} // a walk over few tags is cheap: fresh every time
			if many {
				s.statsAt = now
			}
		}
		return s.segStats
	case "snowflake":
		return s.cfg.Snowflake.Stats()
	}
	return nil
}

// segmentStats returns the segment endpoint's stats: totals, the ordered
// tags' ownership and the StatsTags tags fetched most recently.
func (s *Service) segmentStats() (_ any, many bool) {
	tags := s.cfg.Segments.Stats()
	shown := len(tags)
	many = shown >= StatsTags
	if shown > StatsTags {
		slices.SortFunc(tags, func(x, y segment.TagStats) int { return y.LastFetch.Compare(x.LastFetch) })
		tags, shown = tags[:StatsTags], StatsTags
	}
	m := map[string]any{"totals": s.cfg.Segments.Totals(), "shown": shown, "tags": tags,
		"refused": map[string]uint64{"no_reply": s.noReply.Load(), "reply_subject": s.badReply.Load()}}
	if s.ordered != nil {
		m["ordered"] = s.ordered.Stats()
	}
	return m, many
}

// replier answers one request. Inline answers go through micro (so that its
// stats count them); answers from a parked request's goroutine are published
// directly, because micro's request may not be touched after the handler
// returned. A request another worker forwarded has no micro request: it is
// always answered by publishing.
type replier struct {
	s        *Service
	req      micro.Request // nil for a forwarded request
	reply    string        // the requester's reply subject
	inline   bool
	endpoint string
	tag      string    // metrics label
	start    time.Time // zero without metrics
	worker   bool      // the request asked for protocol.WorkerHeader
	n        int       // IDs asked for, once parsed
	format   protocol.Format
}

func (s *Service) newReplier(req micro.Request, endpoint string) replier {
	r := replier{s: s, req: req, reply: req.Reply(), inline: true, endpoint: endpoint}
	if h := req.Headers(); len(h) > 0 {
		_, r.worker = h[protocol.WorkerHeader]
	}
	if s.metrics != nil {
		r.start = time.Now()
	}
	return r
}

// replies makes the replies of requests forwarded to this worker as the
// owner of their ordered tag (ordered.Replies).
type replies struct{ s *Service }

func (rs replies) Forwarded(f protocol.Forward, tag string) ordered.Reply {
	r := replier{s: rs.s, reply: f.Reply, endpoint: "segment", tag: tag, worker: f.Worker, n: f.N, format: f.Format}
	if rs.s.metrics != nil {
		r.start = time.Now()
	}
	return r
}

func (rs replies) Admit(reply, subject string) bool { return rs.s.admitReply(reply, subject) }

// A replier answers a request for an ordered tag too (ordered.Reply).

func (r replier) Request() protocol.Forward {
	return protocol.Forward{Reply: r.reply, N: r.n, Format: r.format, Worker: r.worker}
}

func (r replier) IDs(runs []segment.Run) { r.s.reply(r, r.format, runs, r.n) }

func (r replier) Fail(err error) { r.fail(err) }

func (r replier) Detach() ordered.Reply { return r.detach() }

// detach returns r for use off the handler's goroutine: answered by
// publishing, and without a forwarded batch's memory.
func (r replier) detach() replier {
	r.inline = false
	if r.req == nil {
		// A forwarded request's reply subject is a slice of its whole
		// batch: do not keep the batch while the request waits.
		r.reply = strings.Clone(r.reply)
	}
	return r
}

func (r replier) respond(data []byte, ids int) {
	// Counted before the reply goes out, so that a client that got its
	// IDs finds them counted.
	r.s.metrics.observe(r.endpoint, r.tag, "200", ids, r.start)
	var err error
	switch {
	case r.worker && r.inline:
		err = r.req.Respond(data, micro.WithHeaders(micro.Headers{protocol.WorkerHeader: []string{r.s.id}}))
	case r.worker:
		msg := nats.NewMsg(r.reply)
		msg.Header.Set(protocol.WorkerHeader, r.s.id)
		msg.Data = data
		err = r.s.cfg.Conn.PublishMsg(msg)
	default: // a plain publish: micro's Respond costs a nats.Msg per reply
		err = r.s.cfg.Conn.Publish(r.reply, data)
	}
	if err != nil {
		r.s.cfg.Logger.Warn("dispenser: reply failed", "endpoint", r.endpoint, "tag", r.tag, "reply", r.reply, "err", err)
	}
}

func (r replier) fail(err error) {
	code, desc := r.s.classify(err)
	r.s.metrics.observe(r.endpoint, r.tag, code, 0, r.start)
	var perr error
	switch {
	case r.inline && r.worker:
		perr = r.req.Error(code, desc, nil, micro.WithHeaders(micro.Headers{protocol.WorkerHeader: []string{r.s.id}}))
	case r.inline:
		perr = r.req.Error(code, desc, nil)
	default:
		msg := nats.NewMsg(r.reply)
		msg.Header.Set(micro.ErrorHeader, desc)
		msg.Header.Set(micro.ErrorCodeHeader, code)
		if r.worker {
			msg.Header.Set(protocol.WorkerHeader, r.s.id)
		}
		perr = r.s.cfg.Conn.PublishMsg(msg)
	}
	if perr != nil {
		r.s.cfg.Logger.Warn("dispenser: error reply failed", "endpoint", r.endpoint, "tag", r.tag, "reply", r.reply, "err", perr)
	}
}

// classify maps an error to a reply code and description. 400 and 404
// describe the request; 503 and 500 say what happened without the store's
// or the network's details (addresses, users, databases), which go to the
// log instead.
func (s *Service) classify(err error) (code, desc string) {
	switch {
	case errors.Is(err, protocol.ErrBadCount), errors.Is(err, protocol.ErrBadHeader), errors.Is(err, protocol.ErrBadSubject),
		errors.Is(err, segment.ErrInvalidTag), errors.Is(err, segment.ErrInvalidCount),
		errors.Is(err, snowflake.ErrInvalidCount):
		return protocol.CodeBadRequest, err.Error()
	case errors.Is(err, segment.ErrUnknownTag):
		return protocol.CodeNotFound, err.Error()
	case errors.Is(err, segment.ErrExhausted):
		return protocol.CodeGone, err.Error()
	case errors.Is(err, segment.ErrClosed):
		return protocol.CodeUnavailable, segment.ErrClosed.Error()
	case errors.Is(err, ordered.ErrOwnershipMoving):
		return protocol.CodeUnavailable, err.Error() + "; try again"
	case errors.Is(err, segment.ErrOrdered) && s.cfg.Owners != nil:
		return protocol.CodeUnavailable, ordered.ErrOwnershipMoving.Error() + "; try again"
	case errors.Is(err, segment.ErrOrdered):
		return protocol.CodeUnavailable, err.Error() + ": this worker serves no ordered tags"
	case errors.Is(err, segment.ErrTagDeleted):
		return protocol.CodeUnavailable, "the tag's record was deleted by hand: it is not created again until an operator restores it"
	case errors.Is(err, kvbucket.ErrPurged), errors.Is(err, kvbucket.ErrRecreated):
		s.cfg.Logger.Debug("dispenser: unavailable", "err", err)
		return protocol.CodeUnavailable, "the store's bucket was purged or recreated: an operator must restore it"
	case errors.Is(err, segment.ErrUnavailable):
		s.cfg.Logger.Debug("dispenser: unavailable", "err", err)
		return protocol.CodeUnavailable, segment.ErrUnavailable.Error() + " (store slow or unreachable); try again"
	case s.cfg.Snowflake != nil && s.cfg.Snowflake.Unavailable(err):
		s.cfg.Logger.Debug("dispenser: unavailable", "err", err)
		for _, e := range snowflakeUnavailable {
			if errors.Is(err, e) {
				return protocol.CodeUnavailable, e.Error()
			}
		}
		return protocol.CodeUnavailable, snowflake.ErrUnavailable.Error()
	}
	s.cfg.Logger.Error("dispenser: unexpected error", "err", err)
	return protocol.CodeInternal, "internal error"
}

// snowflakeUnavailable are the reasons a snowflake worker cannot issue.
var snowflakeUnavailable = []error{snowflake.ErrBucketDeleted, snowflake.ErrEpochLost, snowflake.ErrClockBackwards, snowflake.ErrFenced,
	snowflake.ErrOverloaded, snowflake.ErrClosed, snowflake.ErrNoWorkerID}

// headerValues returns the values of header key, matched without regard
// to case (NATS headers are case-sensitive; people type id-format).
func headerValues(h micro.Headers, key string) []string {
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

// parse reads the count and format of a request.
func (s *Service) parse(req micro.Request) (int, protocol.Format, error) {
	format, err := protocol.ParseFormat(headerValues(req.Headers(), protocol.FormatHeader))
	if err != nil {
		return 0, 0, err
	}
	n, err := protocol.ParseCount(req.Data(), s.cfg.MaxBatch)
	if err != nil {
		return n, format, err
	}
	if err := s.checkFits(n, format); err != nil {
		return 0, format, err
	}
	return n, format, nil
}

// checkFits refuses, before any ID is taken, a batch whose reply may not fit
// in one message of the server the worker is connected to now (a reconnect
// may have brought a smaller max payload; a reply in runs may need twice
// the bytes of a list).
func (s *Service) checkFits(n int, format protocol.Format) error {
	if n*protocol.ListBytesPerID < replyHeaderRoom {
		return nil // every server's max payload holds it: spare the lock
	}
	mp := s.cfg.Conn.MaxPayload()
	if limit := fits(mp, format); n > limit {
		return fmt.Errorf("%w %d: a reply of that many IDs may not fit in one message of this server (max payload %d bytes); at most %d (%s)",
			protocol.ErrBadCount, n, mp, limit, format)
	}
	return nil
}

// admit reports whether the service may answer req at all: only if its
// reply subject passes CheckReply. A refused request is counted and logged
// (at a bounded rate); it gets no answer and takes no ID.
func (s *Service) admit(req micro.Request) bool {
	return s.admitReply(req.Reply(), req.Subject())
}

func (s *Service) admitReply(reply, subject string) bool {
	err := protocol.CheckReply(reply, s.own...)
	if err == nil {
		return true
	}
	if errors.Is(err, protocol.ErrNoReply) {
		s.noReply.Add(1)
	} else {
		s.badReply.Add(1)
	}
	if ok, suppressed := s.refuseLog.allow(time.Now()); ok {
		s.cfg.Logger.Warn("dispenser: request refused for its reply subject; not answered, no ID taken",
			"subject", truncate(subject, 200), "err", err, "refused_since_last_log", suppressed)
	}
	return false
}

// rateLimit lets one event through per refuseLogEvery and counts the rest.
// It is safe for concurrent use.
type rateLimit struct {
	next       atomic.Int64 // UnixNano before which events are suppressed
	suppressed atomic.Uint64
}

// refuseLogEvery spaces the log lines about refused requests.
const refuseLogEvery = 10 * time.Second

// allow reports whether an event at now may be logged, and how many were
// suppressed since the last one that was.
func (l *rateLimit) allow(now time.Time) (bool, uint64) {
	next := l.next.Load()
	if now.UnixNano() < next || !l.next.CompareAndSwap(next, now.Add(refuseLogEvery).UnixNano()) {
		l.suppressed.Add(1)
		return false, 0
	}
	return true, l.suppressed.Swap(0)
}

// replyHeaderRoom is kept free of the max payload for a reply's headers.
const replyHeaderRoom = 1024

// fits returns the most IDs a reply in format can carry within maxPayload.
func fits(maxPayload int64, format protocol.Format) int {
	return int(max(maxPayload-replyHeaderRoom, 0) / int64(format.BytesPerID()))
}

func (s *Service) handleSegment(req micro.Request) {
	if !s.admit(req) {
		return
	}
	r := s.newReplier(req, "segment")
	tag, err := protocol.ParseTag(req.Subject(), s.segPrefix)
	if err != nil {
		r.fail(err)
		return
	}
	r.tag = tag
	n, format, err := s.parse(req)
	if err != nil {
		r.fail(err)
		return
	}
	r.n, r.format = n, format
	var arr [2]segment.Run
	runs, pending, err := s.cfg.Segments.TakeNow(tag, n, arr[:0])
	switch {
	case errors.Is(err, segment.ErrOrdered) && s.ordered != nil:
		s.ordered.Serve(r, tag)
	case err != nil:
		r.fail(err)
	case pending != nil:
		s.park(r, pending)
	default:
		s.reply(r, format, runs, n)
	}
}

// park answers a request that waits for a segment from a goroutine of its
// own, so that the handler goes on with other requests (and other tags).
func (s *Service) park(r replier, p *segment.Pending) {
	r = r.detach()
	s.parked.Add(1)
	go func() {
		defer s.parked.Done()
		runs, err := p.Wait(context.Background())
		if errors.Is(err, segment.ErrOrdered) && s.ordered != nil {
			// Known to be ordered only now: its owner serves it.
			s.ordered.Reroute(r, r.tag)
			return
		}
		if err != nil {
			r.fail(err)
			return
		}
		s.reply(r, r.format, runs, r.n)
	}()
}

// reply answers with runs. Inline replies format into the endpoint's
// scratch buffer (an endpoint's handler runs on one goroutine: its
// subscription's); parked ones into a pooled buffer.
func (s *Service) reply(r replier, format protocol.Format, runs []segment.Run, n int) {
	if r.inline {
		s.segScratch.buf = protocol.AppendRuns(s.segScratch.buf[:0], format, runs)
		r.respond(s.segScratch.buf, n)
		return
	}
	bp := s.bufs.Get().(*[]byte)
	buf := protocol.AppendRuns((*bp)[:0], format, runs)
	r.respond(buf, n)
	if cap(buf) <= 1<<16 { // keep big batch buffers out of the pool
		*bp = buf
		s.bufs.Put(bp)
	}
}

// scratch is memory one endpoint's handler reuses from request to request.
// Only that endpoint's handler goroutine touches it.
type scratch struct {
	ids  []int64
	runs []segment.Run
	buf  []byte
}

func (s *Service) handleSnowflake(req micro.Request) {
	if !s.admit(req) {
		return
	}
	r := s.newReplier(req, "snowflake")
	n, format, err := s.parse(req)
	if err != nil {
		r.fail(err)
		return
	}
	sc := &s.sfScratch
	ids, err := s.cfg.Snowflake.AppendIDs(sc.ids[:0], n)
	sc.ids = ids
	if err != nil {
		r.fail(err)
		return
	}
	if format == protocol.FormatRange {
		sc.runs = protocol.Runs(sc.runs[:0], ids)
		sc.buf = protocol.AppendRanges(sc.buf[:0], sc.runs)
	} else {
		sc.buf = protocol.AppendIDs(sc.buf[:0], ids)
	}
	r.respond(sc.buf, n)
}

func (s *Service) handleDecode(req micro.Request) {
	if !s.admit(req) {
		return
	}
	r := s.newReplier(req, "snowflake_decode")
	body := strings.TrimSpace(string(req.Data()))
	id, err := strconv.ParseInt(body, 10, 64)
	if err != nil || id < 0 {
		r.fail(fmt.Errorf("%w: %q is not a snowflake ID (a non-negative decimal int64)", protocol.ErrBadCount, truncate(body, 64)))
		return
	}
	if err := req.RespondJSON(snowflake.Decode(id, s.cfg.Snowflake.Epoch())); err != nil {
		s.cfg.Logger.Warn("dispenser: reply failed", "subject", req.Subject(), "err", err)
	}
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}
