// Package dispensertest runs a dispenser worker inside a test, in the style
// of net/http/httptest: a service that takes IDs from dispenser gets a real
// worker on an embedded nats-server (JetStream on, storage in a temporary
// directory, segments in the JetStream KV store) and talks to it over NATS,
// with the Go client or any NATS client.
//
//	func TestOrders(t *testing.T) {
//		s := dispensertest.New(t, dispensertest.Options{
//			Tags: []dispensertest.Tag{{Name: "orders", Start: 1000}},
//		})
//		c, err := client.New(s.Conn())
//		…
//		id, err := c.Segment(ctx, "orders") // 1000
//	}
//
// Tags are created on first use unless Options.NoAutoCreate, or given up
// front with a first ID, a step and whether they are ordered. New stops
// the worker and the server when the test ends.
//
// The embedded nats-server listens on a random port of 127.0.0.1 and has
// no authorization: any process of the machine may connect to it, answer
// its requests or change its buckets. It is for tests only; a deployment's
// worker is dispenser serve (its zero-setup mode authenticates whoever may
// serve or administer).
//
// It depends on nats-server, nats.go and dispenser's own packages, not on
// PostgreSQL or its driver.
package dispensertest

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/dispenser-dev/dispenser/segment"
	"github.com/dispenser-dev/dispenser/segment/kv"
	"github.com/dispenser-dev/dispenser/tagmodel"
	"github.com/dispenser-dev/dispenser/worker"
)

// ErrOptions means Options cannot work; Start returns it before it starts
// anything.
var ErrOptions = errors.New("dispensertest: invalid options")

// Defaults of Options' and Tag's zero values.
const (
	DefaultStep    = 1000
	DefaultMaxWait = 5 * time.Second
)

// Tag is a segment tag created before the worker starts.
type Tag struct {
	// Name is 1 to 128 characters of [A-Za-z0-9_-].
	Name string
	// Step is the number of IDs the worker takes from the store at a
	// time. Default DefaultStep.
	Step int64
	// Start is the tag's first ID. Default 1.
	Start int64
	// Ordered makes the tag's IDs increase across workers (see the
	// README, "Ordered tags").
	Ordered bool
}

// Options configure a Server. The zero value is a worker under the subject
// prefix "id" that creates tags on first use with step DefaultStep.
type Options struct {
	// Tags are created before the worker starts.
	Tags []Tag
	// NoAutoCreate answers an unknown tag with 404 (client.ErrUnknownTag),
	// as a production worker does unless told otherwise; default: an
	// unknown tag is created on first use with step DefaultStep, starting
	// at 1.
	NoAutoCreate bool
	// Prefix is the subject prefix (client.WithPrefix). Default "id".
	Prefix string
	// MaxWait is how long a request waits for a segment before it fails
	// with 503 (client.ErrUnavailable). Default DefaultMaxWait, longer than
	// a production worker's 100 ms, so that a busy test machine sees no
	// 503s.
	MaxWait time.Duration
	// Logger gets the worker's log. Default: discarded.
	Logger *slog.Logger
}

// Server is a dispenser worker on an embedded nats-server.
type Server struct {
	// URL is the nats-server's client URL, for nats.Connect.
	URL string
	// Prefix is the worker's subject prefix.
	Prefix string

	dir string // temporary; removed by Close
	ns  *server.Server
	nc  *nats.Conn
	w   *worker.Worker

	closeOnce sync.Once
}

// New starts a Server for a test and stops it when the test ends
// (tb.Cleanup). A failure to start fails the test.
func New(tb testing.TB, o Options) *Server {
	tb.Helper()
	s, err := Start(o)
	if err != nil {
		tb.Fatalf("dispensertest: %v", err)
	}
	tb.Cleanup(s.Close)
	return s
}

// Start starts a Server outside a test; the caller must Close it. In a
// test, use New.
func Start(o Options) (_ *Server, err error) {
	tags := slices.Clone(o.Tags) // defaults filled in, the caller's slice left alone
	for i, t := range tags {
		t.Step, t.Start = cmp.Or(t.Step, DefaultStep), cmp.Or(t.Start, 1)
		if err := tagmodel.CheckTag(t.Name); err != nil {
			return nil, fmt.Errorf("%w: Tags[%d]: %w", ErrOptions, i, err)
		}
		if t.Step < 1 || t.Step > tagmodel.MaxStepLimit || t.Start < 1 {
			return nil, fmt.Errorf("%w: tag %s: step %d, start %d: want a step of 1..%d and a start of at least 1", ErrOptions, t.Name, t.Step, t.Start, tagmodel.MaxStepLimit)
		}
		tags[i] = t
	}
	if o.MaxWait < 0 {
		return nil, fmt.Errorf("%w: MaxWait %v: must not be negative", ErrOptions, o.MaxWait)
	}
	s := &Server{Prefix: cmp.Or(o.Prefix, worker.DefaultPrefix)}
	defer func() {
		if err != nil {
			s.Close()
		}
	}()
	if s.dir, err = os.MkdirTemp("", "dispensertest-"); err != nil {
		return nil, err
	}
	s.ns, err = server.NewServer(worker.EmbeddedOptions("dispensertest", "127.0.0.1", server.RANDOM_PORT, s.dir, false))
	if err != nil {
		return nil, fmt.Errorf("nats-server: %w", err)
	}
	s.ns.Start()
	if !s.ns.ReadyForConnections(10 * time.Second) {
		return nil, errors.New("nats-server did not start within 10s")
	}
	s.URL = s.ns.ClientURL()
	if s.nc, err = nats.Connect(s.URL, nats.Name("dispensertest")); err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := s.createTags(ctx, tags); err != nil {
		return nil, err
	}
	settings := segment.Settings{MaxWait: cmp.Or(o.MaxWait, DefaultMaxWait)}
	if !o.NoAutoCreate {
		settings.AutoCreateStep = DefaultStep
	}
	s.w, err = worker.New(ctx, worker.Config{
		NATS:     worker.NATS{URL: s.URL},
		Instance: "dispensertest",
		Logger:   cmp.Or(o.Logger, slog.New(slog.DiscardHandler)),
		Prefix:   s.Prefix,
		Segment:  settings,
	})
	if err != nil {
		return nil, err
	}
	return s, nil
}

// createTags creates tags in the KV store the worker will open.
func (s *Server) createTags(ctx context.Context, tags []Tag) error {
	if len(tags) == 0 {
		return nil
	}
	js, err := jetstream.New(s.nc)
	if err != nil {
		return err
	}
	st, err := kv.New(ctx, js, kv.Settings{})
	if err != nil {
		return err
	}
	for _, t := range tags {
		if err := st.CreateTag(ctx, tagmodel.Tag{Name: t.Name, Step: t.Step, MaxID: t.Start, Ordered: t.Ordered, Description: "dispensertest"}); err != nil {
			return fmt.Errorf("creating tag %s: %w", t.Name, err)
		}
	}
	return nil
}

// Conn returns a connection to the server, closed by Close. Give it to
// client.New.
func (s *Server) Conn() *nats.Conn { return s.nc }

// Close stops the worker (it gives its unused IDs back), closes Conn and
// stops the nats-server. Calls after the first do nothing.
func (s *Server) Close() {
	s.closeOnce.Do(func() {
		if s.w != nil {
			s.w.Close()
		}
		if s.nc != nil {
			s.nc.Close()
		}
		if s.ns != nil {
			s.ns.Shutdown()
			s.ns.WaitForShutdown()
		}
		if s.dir != "" {
			os.RemoveAll(s.dir)
		}
	})
}
