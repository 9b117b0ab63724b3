package bench

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/dispenser-dev/dispenser/protocol"
	"github.com/dispenser-dev/dispenser/segment"
	"github.com/dispenser-dev/dispenser/segment/postgres"
	"github.com/dispenser-dev/dispenser/tagmodel"
	"github.com/dispenser-dev/dispenser/worker"
	"github.com/dispenser-dev/dispenser/worker/pgstore"
)

// What Run starts in its own process without Config.URL, and the child
// processes it measures memory and start-up with.

// workerSettings are the settings of a worker of the service under test,
// which startWorker starts with package worker as `dispenser serve` does.
type workerSettings struct {
	NATSURL  string
	Instance string
	// PostgresURL is the segment store (behind the witness, as serve has
	// it); empty: the default JetStream KV bucket.
	PostgresURL string
	// Prefix and QueueGroup are the worker's subject prefix and queue
	// group; empty: serve's defaults. The ordered run starts three workers
	// of their own under another prefix.
	Prefix, QueueGroup string
	// Segment are the allocator's settings; zero fields keep the defaults.
	Segment segment.Settings
	Log     *slog.Logger
}

// startWorker starts a worker of the service under test, serving segment
// and snowflake IDs, and returns once it serves.
func startWorker(ctx context.Context, s workerSettings) (*worker.Worker, error) {
	var store worker.StoreOpener = worker.KV{}
	if s.PostgresURL != "" {
		store = pgstore.Postgres{URL: s.PostgresURL}
	}
	return worker.New(ctx, worker.Config{
		NATS:       worker.NATS{URL: s.NATSURL},
		Instance:   s.Instance,
		Logger:     s.Log,
		Store:      store,
		Segment:    s.Segment,
		Prefix:     s.Prefix,
		QueueGroup: s.QueueGroup,
	})
}

// Tags of the local service under test. The service runs with MaxStep
// localMaxStep, which pins every tag at its configured step.
const (
	tagStep100   = "bench_step100"
	tagStep1M    = "bench_step1m"
	localMaxStep = 100
	// tagStep is the step of Config.Tag and bench_step1m.
	tagStep = 1_000_000
	// memBucket is the KV bucket of the memory measurement's tags.
	memBucket = "dispenser_bench_mem"
	// memPrefix is the subject prefix of the memory measurement's worker,
	// so that it takes no part in the other runs.
	memPrefix = "benchmem"
	// baselineSubject is the baseline responder's subject.
	baselineSubject = "bench.baseline"
)

// env is the local set-up: an embedded nats-server, the baseline responder
// and the service under test (a worker as `dispenser serve` runs it), each
// on connections of their own.
type env struct {
	dir   string // temporary; removed by Close
	ns    *server.Server
	url   string
	store string // "kv" or "postgres"

	ctlNC  *nats.Conn // bench's own requests and tag set-up
	baseNC *nats.Conn // baseline responder
	js     jetstream.JetStream
	srv    *worker.Worker
	// maxWait is the service's --max-wait; zero keeps the default.
	maxWait time.Duration
}

// startEnv starts the local set-up with tag as the segment tag. maxWait,
// if not zero, replaces the service's default --max-wait.
func startEnv(ctx context.Context, tag, postgresURL string, maxWait time.Duration, syncAlways bool, log *slog.Logger) (_ *env, err error) {
	e := &env{store: "kv", maxWait: maxWait}
	defer func() {
		if err != nil {
			e.Close()
		}
	}()
	if e.dir, err = os.MkdirTemp("", "dispenser-bench-"); err != nil {
		return nil, err
	}
	e.ns, err = server.NewServer(worker.EmbeddedOptions("dispenser-bench", "127.0.0.1", server.RANDOM_PORT,
		filepath.Join(e.dir, "jetstream"), syncAlways))
	if err != nil {
		return nil, fmt.Errorf("embedded nats-server: %w", err)
	}
	e.ns.Start()
	if !e.ns.ReadyForConnections(10 * time.Second) {
		return nil, errors.New("embedded nats-server did not start within 10s")
	}
	e.url = e.ns.ClientURL()
	if e.ctlNC, err = nats.Connect(e.url, nats.Name("bench")); err != nil {
		return nil, fmt.Errorf("connecting to the embedded nats-server: %w", err)
	}
	if e.baseNC, err = nats.Connect(e.url, nats.Name("bench-baseline")); err != nil {
		return nil, fmt.Errorf("connecting to the embedded nats-server: %w", err)
	}
	if err := startBaseline(e.baseNC, baselineSubject); err != nil {
		return nil, err
	}
	if e.js, err = jetstream.New(e.ctlNC); err != nil {
		return nil, err
	}
	if err := createTags(ctx, e.js, tag, postgresURL); err != nil {
		return nil, err
	}
	if postgresURL != "" {
		// The service under test records every segment in the witness
		// before serving it, as serve does by default.
		e.store = "postgres (witness on)"
	}
	e.srv, err = startWorker(ctx, workerSettings{
		NATSURL:     e.url,
		Instance:    "bench",
		PostgresURL: postgresURL,
		Segment:     segment.Settings{MaxStep: localMaxStep, MaxWait: maxWait},
		Log:         log,
	})
	if err != nil {
		return nil, fmt.Errorf("service under test: %w", err)
	}
	// Fetch the first segments, so that no run waits for them.
	for _, subj := range []string{"id.segment." + tag, "id.segment." + tagStep100, "id.segment." + tagStep1M} {
		if _, err := requestID(ctx, e.ctlNC, subj, 5*time.Second); err != nil {
			return nil, fmt.Errorf("warming up %s: %w", subj, err)
		}
	}
	return e, nil
}

// createTags creates (or sets the step of) the tags of the local
// service under test: tag and bench_step1m with step 1,000,000 and
// bench_step100 with step 100, in the KV bucket or in PostgreSQL.
func createTags(ctx context.Context, js jetstream.JetStream, tag, postgresURL string) error {
	store, closeStore, err := openStore(ctx, js, postgresURL)
	if err != nil {
		return err
	}
	defer closeStore()
	for _, t := range []struct {
		name string
		step int64
	}{{tag, tagStep}, {tagStep100, 100}, {tagStep1M, tagStep}} {
		if err := ensureTag(ctx, store, t.name, t.step); err != nil {
			return err
		}
	}
	return nil
}

// openStore opens the segment store of the local service under test, the
// default KV bucket or PostgreSQL (migrated), without the witness (bench
// only creates tags with it), and returns it with the function that closes
// it.
func openStore(ctx context.Context, js jetstream.JetStream, postgresURL string) (tagmodel.Store, func(), error) {
	var opener worker.StoreOpener = worker.KV{}
	if postgresURL != "" {
		opener = pgstore.Postgres{URL: postgresURL, Migrate: true, NoWitness: true}
	}
	st, err := opener.OpenStore(ctx, js, worker.StoreEnv{Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		return nil, nil, err
	}
	return st.Store, func() {
		if st.Close != nil {
			st.Close()
		}
	}, nil
}

// openStore opens the store of e's service under test (see openStore).
func (e *env) openStore(ctx context.Context, postgresURL string) (tagmodel.Store, func(), error) {
	return openStore(ctx, e.js, postgresURL)
}

// segmentStats returns the allocator's state of every tag of the service
// under test; nil without a local set-up.
func (e *env) segmentStats() map[string]segment.TagStats {
	if e == nil || e.srv == nil {
		return nil
	}
	m := map[string]segment.TagStats{}
	for _, t := range e.srv.SegmentStats() {
		m[t.Tag] = t
	}
	return m
}

// Close stops everything startEnv started and removes its files.
func (e *env) Close() error {
	var errs []error
	if e.srv != nil {
		errs = append(errs, e.srv.Close())
	}
	for _, nc := range []*nats.Conn{e.ctlNC, e.baseNC} {
		if nc != nil {
			nc.Close()
		}
	}
	if e.ns != nil {
		e.ns.Shutdown()
		e.ns.WaitForShutdown()
	}
	if e.dir != "" {
		errs = append(errs, os.RemoveAll(e.dir))
	}
	return errors.Join(errs...)
}

// ensureTag creates a tag with step, or sets the step of an existing one.
func ensureTag(ctx context.Context, store tagmodel.Store, name string, step int64) error {
	admin, ok := store.(tagmodel.Admin)
	if !ok {
		return fmt.Errorf("the store cannot create tags (%T)", store)
	}
	err := admin.CreateTag(ctx, tagmodel.Tag{Name: name, Step: step, MaxID: 1, Description: "dispenser bench"})
	if errors.Is(err, tagmodel.ErrTagExists) {
		var t tagmodel.Tag
		if t, err = store.Tag(ctx, name); err == nil && t.Step != step {
			err = admin.UpdateTag(ctx, name, tagmodel.Update{Step: &step})
		}
	}
	if err != nil {
		return fmt.Errorf("creating tag %s: %w", name, err)
	}
	return nil
}

// startBaseline serves subject with the ceiling of any ID service: a plain
// queue subscription that answers with an atomic counter, parsing the count
// and formatting the reply as the dispenser does, and echoing the request's
// token as a worker does (the Go client refuses a reply without it): in
// the reply's first line if it came in the body, in protocol.TokenHeader
// if it came there. A request without headers or a token (the raw
// requests every ratio is measured against) costs it what it would cost
// any responder: a count parsed, a number formatted.
func startBaseline(nc *nats.Conn, subject string) error {
	var counter atomic.Int64
	var buf []byte // only the subscription's goroutine uses it
	_, err := nc.QueueSubscribe(subject, "bench", func(m *nats.Msg) {
		count, token, inBody := protocol.SplitBody(m.Data)
		n, err := protocol.ParseCount(count, 1_000_000)
		format := protocol.FormatList
		if err == nil && len(m.Header) > 0 {
			format, err = protocol.ParseFormat(m.Header.Values(protocol.FormatHeader))
		}
		var tokens []string
		if inBody {
			tokens = []string{token}
		} else {
			tokens = m.Header.Values(protocol.TokenHeader)
		}
		if err != nil {
			reply := nats.NewMsg(m.Reply)
			if tokens != nil {
				reply.Header[protocol.TokenHeader] = tokens
			}
			reply.Header.Set(protocol.ErrorCodeHeader, protocol.CodeBadRequest)
			reply.Header.Set(protocol.ErrorHeader, err.Error())
			nc.PublishMsg(reply)
			return
		}
		last := counter.Add(int64(n))
		runs := [1]protocol.Run{{First: last - int64(n) + 1, Last: last}}
		buf = buf[:0]
		if inBody {
			buf = protocol.AppendTokenLine(buf, token, "")
		}
		if format == protocol.FormatRange {
			buf = protocol.AppendRanges(buf, runs[:])
		} else {
			buf = protocol.AppendList(buf, runs[:])
		}
		if tokens != nil && !inBody {
			nc.PublishMsg(&nats.Msg{Subject: m.Reply, Header: nats.Header{protocol.TokenHeader: tokens}, Data: buf})
			return
		}
		nc.Publish(m.Reply, buf)
	})
	if err != nil {
		return fmt.Errorf("baseline responder: %w", err)
	}
	return nc.Flush()
}

// requestID requests one ID from subject, retrying 503s until timeout.
func requestID(ctx context.Context, nc *nats.Conn, subject string, timeout time.Duration) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	for {
		m, err := nc.RequestWithContext(ctx, subject, nil)
		if err == nil {
			code := m.Header.Get(protocol.ErrorCodeHeader)
			if code == "" {
				return string(m.Data), nil
			}
			err = fmt.Errorf("%w %s: %s", errErrorReply, code, m.Header.Get(protocol.ErrorHeader))
			if code != protocol.CodeUnavailable {
				return "", err
			}
		}
		select {
		case <-ctx.Done():
			return "", err
		case <-time.After(5 * time.Millisecond):
		}
	}
}

// parallel calls f for every item with at most n calls at once and returns
// the first error.
func parallel(ctx context.Context, items []string, n int, f func(string) error) error {
	work := make(chan string)
	var wg sync.WaitGroup
	var mu sync.Mutex
	var first error
	for range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for it := range work {
				if err := f(it); err != nil {
					mu.Lock()
					first = cmp.Or(first, err)
					mu.Unlock()
				}
			}
		}()
	}
	for _, it := range items {
		mu.Lock()
		stop := first != nil
		mu.Unlock()
		if stop || ctx.Err() != nil {
			break
		}
		work <- it
	}
	close(work)
	wg.Wait()
	if first == nil {
		first = ctx.Err()
	}
	return first
}

// openMigrated connects to the PostgreSQL segment store at url and applies
// the migrations.
func openMigrated(ctx context.Context, url string) (*pgxpool.Pool, error) {
	pool, err := pgstore.Connect(ctx, url)
	if err != nil {
		return nil, err
	}
	if _, err := postgres.Migrate(ctx, pool); err != nil {
		pool.Close()
		return nil, fmt.Errorf("migrating: %w", err)
	}
	return pool, nil
}
