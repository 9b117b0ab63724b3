package dispenser

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/dispenser-dev/dispenser/internal/redact"
	"github.com/dispenser-dev/dispenser/protocol"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"
	"github.com/nats-io/nuid"

	"github.com/dispenser-dev/dispenser/snowflake"
)

// Snowflake issues snowflake IDs; *snowflake.Node implements it.
type Snowflake interface {
	// AppendIDs appends n IDs to dst. Errors for which Unavailable reports
	// true are answered with 503, others with 500.
	AppendIDs(dst []int64, n int) ([]int64, error)
	// Unavailable reports whether err means "try again later".
	Unavailable(err error) bool
	// Epoch is the time of timestamp 0 and Layout the bit layout, for
	// decoding IDs.
	Epoch() time.Time
	Layout() snowflake.Layout
	// Stats returns the lease and generator state for micro stats.
	Stats() any
}

// Errors of package dispenser.
var (
	// ErrPeerMismatch means a running worker of the same prefix and queue
	// group uses another segment store, or leases its snowflake worker IDs
	// from another bucket or with another epoch (both would hand out the
	// same IDs), or records the owners of ordered tags in another bucket
	// (both would own an ordered tag and serve it out of order).
	ErrPeerMismatch = errors.New("dispenser: a worker of this queue group uses another store, snowflake leases or owners bucket")
	// ErrStopped is Move's error after Stop.
	ErrStopped = errors.New("dispenser: service stopped")
	// ErrOwnershipMoving means no worker could be found to own an ordered
	// tag within the wait (the owner died, paused past its lease, or is
	// handing the tag over), or a forwarded request reached a worker that
	// no longer owns it: try again.
	ErrOwnershipMoving = errors.New("dispenser: ordered tag's owner is changing")
	// ErrNotOwner means a request on this worker's direct subject is for a
	// tag this worker does not own (any more, or the tag is not ordered):
	// nothing was taken; the requester sends it to the queue group's
	// subject instead (protocol.CodeMisdirected).
	ErrNotOwner = errors.New("dispenser: this worker does not own the tag; ask <prefix>.segment.<tag>")
)

// Service is a running dispenser micro service. It is safe for concurrent use.
type Service struct {
	cfg     Config
	parked  sync.WaitGroup // requests waiting for a segment
	bufs    sync.Pool      // *[]byte reply buffers
	metrics *metrics       // nil without Config.Registerer
	// limits bound the requests protocol.ReadRequest accepts: MaxBatch,
	// and the max payload of the connection the service serves on now.
	limits protocol.Limits
	// segPrefix is "<prefix>.segment.", the subject before a tag.
	segPrefix string
	bg        sync.WaitGroup // adds the segment endpoint late
	done      chan struct{}  // closed by Stop
	// bound is the connection the service serves on and what is
	// registered there; Move replaces it. Handlers read it once per use.
	bound atomic.Pointer[binding]
	// forwarded counts the requests the ordered tags of every binding
	// forwarded to an owner.
	forwarded atomic.Uint64
	// direct and misdirected count the requests on this worker's direct
	// subject served as owner and refused (orderedStats), over every
	// binding.
	direct, misdirected atomic.Uint64
	// noOwner counts the requests of ordered tags answered 503 because
	// no owner was found within the wait (orderedStats), over every
	// binding.
	noOwner atomic.Uint64
	// directSubjects caches, per ordered tag, this worker's direct
	// subject (protocol.DirectSubject), named in the owner's replies to
	// every request that asks for it: built once, not a string a reply.
	// At most one entry per ordered tag this worker answered as owner.
	directSubjects sync.Map
	// own are the subject prefixes no reply goes to (CheckReply).
	own []string
	// noReply and badReply count requests refused for their reply subject
	// (none, or one CheckReply refuses); refuseLog spaces their log lines.
	noReply, badReply atomic.Uint64
	refuseLog         rateLimit
	// handedOff counts the requests this worker could not serve and
	// handed to another worker (handOff), by endpoint (handOffIndex).
	handedOff [2]atomic.Uint64
	// hop names this worker in protocol.HopHeader (handedBefore): random,
	// known only to the workers a request is handed to.
	hop string

	// Lock order: mu before an endpoint's mu (endpoint.mu): mu is held
	// while endpoints join their queue groups (addSegmentEndpoint, and
	// Move's bind), never the other way round. statsMu is never held with
	// mu or an endpoint's mu: it is taken alone (stats), and while held
	// takes only the allocator's and the ownership leases' own locks
	// (segmentStats), which never call back into the service.
	mu      sync.Mutex // protects stopped, replacing bound and adding endpoints
	stopped bool

	statsMu sync.Mutex // protects statsAt and segStats
	// segStats is the segment endpoint's stats as of statsAt: $SRV.STATS
	// requests within statsEvery get it again instead of a new walk over
	// every tag. statsAt is zero when the last walk was over few tags.
	statsAt  time.Time
	segStats any
	now      func() time.Time // time.Now; tests set it
}

// binding is what ties the service to the connection it serves on: the
// endpoints, discovery, and the ordered tags with their subscription to
// forwarded requests. Its fields do not change once published; the
// endpoints join and leave their queue groups (endpoint.mu), and added is
// set once the segment endpoint first joined (under s.mu).
type binding struct {
	conn    *nats.Conn
	id      string // micro service ID: unique per binding
	disc    *discovery
	ordered *orderedTags // nil without Owners or Segments
	baseSub int          // subscriptions on conn before the service's
	// seg, sf and decode are the endpoints; sf and decode nil without
	// Snowflake. added: seg has been added (it joins once the tag list
	// has loaded).
	seg, sf, decode *endpoint
	added           atomic.Bool
}

// conn returns the connection the service serves on now: any reply can go
// out on it, whichever connection its request came in on.
func (s *Service) conn() *nats.Conn { return s.bound.Load().conn }

// orderedTags returns the current binding's ordered tags, or nil (also
// while New has not bound the service yet).
func (s *Service) orderedTags() *orderedTags {
	if b := s.bound.Load(); b != nil {
		return b.ordered
	}
	return nil
}

// ID returns the micro service ID of this worker: a new one after Move.
func (s *Service) ID() string { return s.bound.Load().id }

// StoreMetadata is the micro metadata key naming a worker's segment store.
const StoreMetadata = "store"

// StoreIDMetadata is the micro metadata key of Config.StoreID.
const StoreIDMetadata = "store_id"

// SnowflakeMetadata is the micro metadata key naming a worker's snowflake
// lease bucket and epoch (Config.SnowflakeLeases).
const SnowflakeMetadata = "snowflake"

// OwnersMetadata is the micro metadata key naming the bucket of a worker's
// owners of ordered tags (Config.OwnersBucket).
const OwnersMetadata = "owners"

// RegionMetadata and RegionSettingsMetadata are the micro metadata keys of
// a region-aware worker's region and region settings (Config.Region);
// empty without regions.
const (
	RegionMetadata         = "region"
	RegionSettingsMetadata = "region_settings"
)

// regionN renders the region of r, "" without regions.
func regionN(r Region) string {
	if !r.On() {
		return ""
	}
	return strconv.Itoa(r.N)
}

// Name is the micro service name.
const Name = "dispenser"

// New validates cfg, registers the micro service and starts serving.
func New(cfg Config) (*Service, error) {
	cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	s := &Service{cfg: cfg, own: []string{cfg.Prefix}, now: time.Now, done: make(chan struct{}), hop: rand.Text()}
	if cfg.OwnerSubject != "" {
		s.own = append(s.own, cfg.OwnerSubject)
	}
	s.bufs.New = func() any { b := make([]byte, 0, 64); return &b }
	s.segPrefix = protocol.SegmentSubject(cfg.Prefix, "")
	s.limits = protocol.Limits{MaxBatch: cfg.MaxBatch, MaxPayload: func() int64 { return s.conn().MaxPayload() }}
	// Metrics first: handlers record in them from the first request on.
	m, err := newMetrics(cfg.Registerer, s)
	if err != nil {
		return nil, fmt.Errorf("dispenser: registering metrics: %w", err)
	}
	s.metrics = m
	b, err := s.bind(cfg.Conn, func(b *binding) error {
		// Peers are asked once others can see this worker and before it
		// serves anything (checkPeers).
		if cfg.PeerCheck <= 0 {
			return nil
		}
		err := cfg.Conn.FlushTimeout(5 * time.Second)
		if err == nil {
			err = s.checkPeers(cfg.PeerCheck, b.id)
		}
		return err
	})
	if err != nil {
		s.metrics.unregister(cfg.Registerer)
		return nil, err
	}
	s.bound.Store(b)
	if cfg.Segments != nil {
		select {
		case <-cfg.Segments.Loaded():
			s.warm(b)
			s.mu.Lock()
			err = s.addSegmentEndpoint(b)
			s.mu.Unlock()
			if err == nil {
				// New returns once the server knows the endpoint: a
				// request sent right after it finds a responder.
				err = b.conn.FlushTimeout(5 * time.Second)
			}
		case <-time.After(cfg.ReadyTimeout):
			cfg.Logger.Warn("dispenser: segment store not reachable yet; serving segments once the tag list has loaded")
			s.bg.Add(1)
			go s.addSegmentEndpointWhenLoaded()
		}
		if err != nil {
			s.stop()
			return nil, fmt.Errorf("dispenser: adding endpoint: %w", err)
		}
	}
	if sv, ok := cfg.Snowflake.(servable); ok {
		s.bg.Add(1)
		go s.watchSnowflake(sv)
	}
	// Make sure the server knows our subscriptions before we say we serve.
	if err := cfg.Conn.FlushTimeout(5 * time.Second); err != nil {
		s.stop()
		return nil, fmt.Errorf("dispenser: flushing subscriptions: %w", err)
	}
	return s, nil
}

// bind registers the service on nc: discovery, then (after registered,
// if set, has not failed) the ordered tags' subscription, then the
// snowflake endpoints (the ID endpoint only while the generator can issue),
// and the segment endpoint if the tag list has loaded. On an error nothing
// stays registered.
func (s *Service) bind(nc *nats.Conn, registered func(*binding) error) (*binding, error) {
	cfg := s.cfg
	b := &binding{conn: nc, baseSub: nc.NumSubscriptions(), id: nuid.Next()}
	// The endpoints exist before discovery, which lists them, answers;
	// they join their queue groups below.
	b.seg = newEndpoint(nc, "segment", cfg.Prefix+".segment.>", cfg.QueueGroup, // dotted tags get their 400
		map[string]string{"description": "IDs of a tag: body empty or a count N; header Id-Format: list|range"},
		s.handleSegment)
	if cfg.Snowflake != nil {
		b.sf = newEndpoint(nc, "snowflake", cfg.Prefix+".snowflake", cfg.QueueGroup,
			map[string]string{"description": "snowflake IDs: body empty or a count N; header Id-Format: list|range"},
			s.handleSnowflake)
		b.decode = newEndpoint(nc, "snowflake_decode", cfg.Prefix+".snowflake.decode", cfg.QueueGroup,
			map[string]string{"description": "body a snowflake ID; replies JSON with time, worker and sequence"},
			s.handleDecode)
	}
	for _, e := range []*endpoint{b.seg, b.sf, b.decode} {
		if e != nil {
			e.timeAll = s.metrics != nil // the latency starts at scratch.start
		}
	}
	b.disc = &discovery{
		identity: micro.ServiceIdentity{Name: Name, ID: b.id, Version: cfg.Version,
			Metadata: map[string]string{StoreMetadata: cfg.Store, StoreIDMetadata: cfg.StoreID, SnowflakeMetadata: cfg.SnowflakeLeases, OwnersMetadata: cfg.OwnersBucket,
				PrefixMetadata: cfg.Prefix, QueueGroupMetadata: cfg.QueueGroup,
				RegionMetadata: regionN(cfg.Region), RegionSettingsMetadata: cfg.Region.Settings()}},
		description: "Unique 64-bit IDs: segment (per-tag sequences) and snowflake",
		started:     time.Now().UTC(),
		endpoints:   b.endpoints,
		data:        s.stats,
		admit:       s.admitReply,
	}
	if err := b.disc.start(nc); err != nil {
		return nil, err
	}
	if registered != nil {
		if err := registered(b); err != nil {
			b.disc.stop()
			return nil, err
		}
	}
	var err error
	if cfg.Owners != nil && cfg.Segments != nil { // before any request can be routed
		if b.ordered, err = s.newOrderedTags(nc, b.id); err != nil {
			b.disc.stop()
			return nil, err
		}
	}
	if cfg.Snowflake != nil {
		err = b.decode.join()
		if err == nil && s.snowflakeServable() {
			err = b.sf.join()
		}
		if err != nil {
			s.unbindNow(b)
			return nil, err
		}
	}
	return b, nil
}

// endpoints returns the endpoints b has: the segment endpoint once added.
func (b *binding) endpoints() []*endpoint {
	eps := make([]*endpoint, 0, 3)
	if b.added.Load() {
		eps = append(eps, b.seg)
	}
	if b.sf != nil {
		eps = append(eps, b.sf, b.decode)
	}
	return eps
}

// close leaves every endpoint's queue group for good and stops discovery;
// requests already received are still handled.
func (b *binding) close() {
	b.seg.close()
	if b.sf != nil {
		b.sf.close()
		b.decode.close()
	}
	b.disc.stop()
}

// unbindNow stops b's registrations without waiting for requests in flight.
func (s *Service) unbindNow(b *binding) {
	if b.ordered != nil {
		_ = b.ordered.drain()
		b.ordered.leave()
	}
	b.close()
}

// addSegmentEndpoint adds the segment endpoint to b unless the service
// stopped or b has it. Call it with s.mu held.
func (s *Service) addSegmentEndpoint(b *binding) error {
	if s.stopped || b.added.Load() {
		return nil
	}
	err := b.seg.join()
	b.added.Store(err == nil)
	return err
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
	s.warm(s.bound.Load())
	s.mu.Lock()
	b := s.bound.Load()
	err := s.addSegmentEndpoint(b)
	s.mu.Unlock()
	if err != nil {
		s.cfg.Logger.Error("dispenser: adding the segment endpoint", "err", err)
		return
	}
	if err := b.conn.Flush(); err != nil {
		s.cfg.Logger.Warn("dispenser: flushing the segment endpoint", "err", err)
	}
	s.cfg.Logger.Info("dispenser: segment store reachable; serving segments")
}

// Info returns the micro service's identity and endpoints.
func (s *Service) Info() micro.Info { return s.bound.Load().disc.info() }

// Stop stops taking requests and waits, at most until ctx ends, until the
// requests already received have been answered. It does not close the
// allocator or the snowflake worker: their owner does that after Stop.
func (s *Service) Stop(ctx context.Context) error {
	b, err := s.stop()
	if err != nil {
		if b.ordered != nil {
			b.ordered.leave()
		}
		return fmt.Errorf("dispenser: stopping: %w", err)
	}
	if err := s.drained(ctx, b); err != nil {
		return err
	}
	done := make(chan struct{})
	go func() { s.parked.Wait(); close(done) }()
	select {
	case <-done:
	case <-ctx.Done():
		return fmt.Errorf("dispenser: waiting for parked requests: %w", ctx.Err())
	}
	return nil
}

// drained waits, at most until ctx ends, until b's subscriptions are
// drained (micro and the ordered tags drain them: messages already
// received are still handled), then makes b's ordered tags' forwarder
// send what it holds and waits for their parked requests. A drain cannot
// finish without a server (it waits for a flush): while disconnected there
// is nobody to answer anyway, so it stops waiting.
func (s *Service) drained(ctx context.Context, b *binding) error {
	tick := time.NewTicker(time.Millisecond)
	defer tick.Stop()
	for b.conn.NumSubscriptions() > b.baseSub && b.conn.IsConnected() {
		select {
		case <-ctx.Done():
			if b.ordered != nil {
				b.ordered.leave()
			}
			return fmt.Errorf("dispenser: draining requests: %w", ctx.Err())
		case <-tick.C:
		}
	}
	if b.ordered == nil {
		return nil
	}
	b.ordered.leave() // no handler runs any more: send what it holds
	if err := b.ordered.waitParked(ctx); err != nil {
		return fmt.Errorf("dispenser: %w", err)
	}
	return nil
}

// stop ends adding endpoints and moving, and stops the current binding's
// micro service and ordered tags, which drain their subscriptions; it
// returns that binding.
func (s *Service) stop() (*binding, error) {
	s.mu.Lock()
	if !s.stopped {
		s.stopped = true
		close(s.done)
	}
	b := s.bound.Load()
	s.mu.Unlock()
	s.bg.Wait()
	s.unbind(b)
	return b, nil
}

// unbind stops b's ordered tags from taking forwarded requests and b's
// micro service, which drain their subscriptions.
func (s *Service) unbind(b *binding) {
	if b.ordered != nil {
		if err := b.ordered.drain(); err != nil {
			s.cfg.Logger.Warn("dispenser: stopping", "err", err)
		}
	}
	b.close()
}

// Move serves on nc from now on, for a connection whose server is going
// away (lame-duck mode): it registers the service on nc, so that requests
// reach it there, then stops the registration on the old connection,
// whose requests already received are still answered, and returns once
// that is done or ctx ends. It returns the old connection, which the
// caller closes then, once the service serves on nc, even with an error
// (ctx ended first); nil if it does not (ErrStopped, or registering on nc
// failed). The micro service gets a new ID (ID).
func (s *Service) Move(ctx context.Context, nc *nats.Conn) (*nats.Conn, error) {
	s.mu.Lock()
	if s.stopped {
		s.mu.Unlock()
		return nil, ErrStopped
	}
	old := s.bound.Load()
	b, err := s.bind(nc, nil)
	if err == nil && old.added.Load() {
		err = s.addSegmentEndpoint(b)
	}
	if err == nil {
		err = nc.FlushTimeout(5 * time.Second) // the server knows the new subscriptions
	}
	if err != nil {
		s.mu.Unlock()
		if b != nil {
			s.unbindNow(b)
		}
		return nil, fmt.Errorf("dispenser: moving to %s: %w", redact.URL(nc.ConnectedUrl()), err)
	}
	s.bound.Store(b)
	s.mu.Unlock()
	s.unbind(old)
	return old.conn, s.drained(ctx, old)
}
