// Package dispenser serves unique IDs over NATS as a micro service named
// "dispenser": segment IDs on <prefix>.segment.<tag> and snowflake IDs on
// <prefix>.snowflake, in a queue group so that many workers share the load.
package dispenser

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/dispenser-dev/dispenser/protocol"

	"github.com/nats-io/nats.go/micro"

	"github.com/dispenser-dev/dispenser/ordered"
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
	ordered *ordered.Tags[replier]
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
	cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
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
		s.ordered, err = ordered.New(ordered.Settings[replier]{Conn: cfg.Conn, Allocator: cfg.Segments, Owners: cfg.Owners,
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
