package dispenser

import (
	"cmp"
	"errors"
	"fmt"
	"log/slog"
	"regexp"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/dispenser-dev/dispenser/internal/buildinfo"
	"github.com/dispenser-dev/dispenser/protocol"
	"github.com/dispenser-dev/dispenser/segment"
)

// Config configures a Service. Zero values mean the documented defaults.
type Config struct {
	// Conn is the NATS connection to serve on, until Service.Move moves the
	// service to another. Required. Use a connection of its own: Stop and
	// Move wait until all of its subscriptions are drained.
	Conn *nats.Conn
	// Segments serves <prefix>.segment.<tag>; nil leaves the endpoint out.
	Segments *segment.Allocator
	// Snowflake serves <prefix>.snowflake and <prefix>.snowflake.decode;
	// nil leaves them out.
	Snowflake Snowflake
	// Prefix is the first subject token. Default protocol.DefaultPrefix
	// ("id").
	Prefix string
	// QueueGroup is the endpoints' queue group. Default
	// protocol.DefaultQueueGroup ("dispenser").
	QueueGroup string
	// MaxBatch is the most IDs one request may ask for. Default
	// protocol.DefaultMaxBatch (10,000).
	MaxBatch int
	// Version is the service version reported by micro, a semantic
	// version. Default: the binary's (package internal/buildinfo), the
	// one `dispenser version` and the status page show.
	Version string
	// Store names the segment store (e.g. "postgres:host:5432/ids" or
	// "kv:dispenser_segments"). It is published in the micro metadata under
	// StoreMetadata, so that workers can refuse to share a queue group with
	// a worker of another store: two stores hand out the same IDs.
	Store string
	// StoreID identifies the data behind Store whichever addresses this
	// worker reaches it by (for PostgreSQL its cluster's system identifier
	// and the database name); empty if unknown. It is published under
	// StoreIDMetadata: two workers that both publish one are compared by
	// it instead of by Store, so that workers reaching one database by
	// different addresses (a service name, an IP, a proxy) serve together.
	StoreID string
	// SnowflakeLeases names the snowflake lease bucket and epoch, and a
	// layout other than the default (e.g. "dispenser_workers@<bucket
	// creation time> epoch <epoch>", plus " layout js (41+5+7 bits)"). It is
	// published in the micro metadata under SnowflakeMetadata, so that
	// workers can refuse to share a queue group with a worker that leases
	// its worker IDs elsewhere: both would issue the same IDs.
	SnowflakeLeases string
	// OwnersBucket names the bucket of the owners of ordered tags (e.g.
	// "dispenser_owners@<bucket creation time>"), empty without Owners. It
	// is published in the micro metadata under OwnersMetadata, so that
	// workers can refuse to share a queue group with a worker whose owners
	// are recorded elsewhere: each would own an ordered tag at once and
	// serve it from its own segments, out of order.
	OwnersBucket string
	// Region is the worker's region; the zero value without regions. Peers of other regions may use other stores and
	// lease buckets as Region says (checkPeers), but must have the same
	// region settings.
	Region Region
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
	Owners Owners
	// OwnerSubject is where this worker takes forwarded requests
	// (OwnerSubject.<tag>); it must be the subject its Owners records.
	// Required with Owners.
	OwnerSubject string
	// OwnerID, if set with Owners, names this worker in its direct
	// subject: it takes the requests for the ordered tags it owns on
	// protocol.DirectSubject(Prefix, <tag>, OwnerID) too, and its replies
	// to requests for them that came another way carry that subject in
	// protocol.DirectHeader. One token of [A-Za-z0-9_-], unique among the
	// workers of Prefix. Empty: no direct subject.
	OwnerID string
	// PeerCheck, if positive, is how long New waits for the running
	// dispenser workers to describe themselves before it serves: it
	// refuses (ErrPeerMismatch) to join a queue group whose workers use
	// another Store, other SnowflakeLeases or another OwnersBucket. Zero:
	// no check.
	PeerCheck time.Duration
	// WarmTimeout bounds the warm-up of a starting service: with
	// PeerCheck, before it joins the segment endpoint, it asks its peers
	// which tags they served last and loads the first segment of each
	// (segment.Allocator.Warm), so that it answers them from memory at
	// once, also while the store is slow (a leader election of the
	// witness bucket). It joins when they are loaded or when WarmTimeout
	// has passed. Default 10 s.
	WarmTimeout time.Duration
	// ReadyTimeout is how long New waits for the allocator's tag list
	// before it serves without the segment endpoint, which it then adds
	// once the list has loaded: a worker that cannot reach its store must
	// not take a share of the segment requests its peers could serve.
	// Default 2 s.
	ReadyTimeout time.Duration
}

// withDefaults fills in the documented defaults of zero fields.
func (cfg *Config) withDefaults() {
	cfg.Prefix = cmp.Or(cfg.Prefix, protocol.DefaultPrefix)
	cfg.QueueGroup = cmp.Or(cfg.QueueGroup, protocol.DefaultQueueGroup)
	cfg.MaxBatch = cmp.Or(cfg.MaxBatch, protocol.DefaultMaxBatch)
	cfg.Version = cmp.Or(cfg.Version, buildinfo.Version())
	cfg.ReadyTimeout = cmp.Or(cfg.ReadyTimeout, 2*time.Second)
	cfg.WarmTimeout = cmp.Or(cfg.WarmTimeout, 10*time.Second)
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
}

// validate checks cfg once its defaults are in.
func (cfg *Config) validate() error {
	if cfg.Conn == nil {
		return errors.New("dispenser: Config.Conn is required")
	}
	if cfg.Segments == nil && cfg.Snowflake == nil {
		return errors.New("dispenser: nothing to serve: set Segments or Snowflake")
	}
	if !semVer.MatchString(cfg.Version) {
		return fmt.Errorf("dispenser: Version %q: not a semantic version (micro clients require one)", cfg.Version)
	}
	if !validSubjectPrefix(cfg.Prefix) {
		return fmt.Errorf("dispenser: subject prefix %q: want dot-separated tokens without wildcards or spaces", cfg.Prefix)
	}
	// A decimal list of MaxBatch IDs, with the reply's headers, must fit in
	// one message.
	if limit := protocol.Fits(cfg.Conn.MaxPayload(), protocol.FormatList); cfg.MaxBatch < 1 || cfg.MaxBatch > limit || cfg.MaxBatch > 1e9 {
		return fmt.Errorf("dispenser: MaxBatch %d: want 1..%d (the server's max payload less %d bytes for headers, / %d bytes an ID)",
			cfg.MaxBatch, limit, protocol.ReplyHeaderRoom, protocol.ListBytesPerID)
	}
	if cfg.Owners != nil && (cfg.OwnerSubject == "" || !validSubjectPrefix(cfg.OwnerSubject)) {
		return fmt.Errorf("dispenser: OwnerSubject %q: want dot-separated tokens without wildcards (required with Owners)", cfg.OwnerSubject)
	}
	if cfg.OwnerID != "" && (cfg.Owners == nil || !protocol.ValidTag(cfg.OwnerID)) {
		return fmt.Errorf("dispenser: OwnerID %q: want a token of %s, with Owners", cfg.OwnerID, protocol.TagRule)
	}
	return nil
}

// semVer is micro's rule for a service version (ADR-32: SemVer 2.0).
var semVer = regexp.MustCompile(`^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(?:-((?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(?:\.(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*))?(?:\+([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?$`)

func validSubjectPrefix(p string) bool {
	for _, tok := range strings.Split(p, ".") {
		if tok == "" || strings.ContainsAny(tok, "*> \t\r\n") {
			return false
		}
	}
	return true
}
