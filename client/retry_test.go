package client_test

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"

	"github.com/dispenser-dev/dispenser/client"
	"github.com/dispenser-dev/dispenser/dispenser"
	"github.com/dispenser-dev/dispenser/internal/tests/testdb"
	"github.com/dispenser-dev/dispenser/protocol"
	"github.com/dispenser-dev/dispenser/segment"
	"github.com/dispenser-dev/dispenser/tagmodel"
	"github.com/dispenser-dev/dispenser/testenv"
)

// restartable is one worker that a test stops and starts again, on one
// store and one NATS server.
type restartable struct {
	store tagmodel.Store
	ns    *server.Server
	alloc *segment.Allocator
	svc   *dispenser.Service
}

func (w *restartable) start(tb testing.TB) {
	tb.Helper()
	quiet := slog.New(slog.DiscardHandler)
	alloc, err := segment.New(segment.Settings{Store: w.store, MaxWait: 10 * time.Second, Logger: quiet})
	if err != nil {
		tb.Fatal(err)
	}
	svc, err := dispenser.New(dispenser.Config{Conn: testenv.Connect(tb, w.ns), Segments: alloc, Logger: quiet})
	if err != nil {
		tb.Fatal(err)
	}
	w.alloc, w.svc = alloc, svc
}

func (w *restartable) stop(tb testing.TB) {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := w.svc.Stop(ctx); err != nil {
		tb.Error(err)
	}
	if err := w.alloc.Close(ctx); err != nil {
		tb.Error(err)
	}
}

// TestRetriesAcrossRestart: requests made while the only worker restarts
// (a gap in which nobody answers) all succeed through a Client, with no ID
// twice; a Client WithoutRetries fails some of them with no responders,
// which shows that the load did meet the gap.
func TestRetriesAcrossRestart(t *testing.T) {
	for _, tt := range []struct {
		name     string
		opts     []client.Option
		wantFail bool
	}{
		{name: "retries", opts: nil},
		{name: "without retries", opts: []client.Option{client.WithoutRetries()}, wantFail: true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			w := &restartable{store: testdb.New(t, map[string]int64{"orders": 50}).Store, ns: testenv.NATS(t)}
			w.start(t)
			c := newClient(t, testenv.Connect(t, w.ns), tt.opts...)
			ctx, cancel := context.WithCancel(context.Background())
			var mu sync.Mutex // protects seen and fails
			seen := map[int64]bool{}
			var fails []error
			var answered atomic.Int64
			var wg sync.WaitGroup
			for range 4 {
				wg.Go(func() {
					for ctx.Err() == nil {
						id, err := c.Segment(context.Background(), "orders")
						mu.Lock()
						if err != nil {
							fails = append(fails, err)
						} else if seen[id] {
							t.Errorf("ID %d handed out twice", id)
						} else {
							seen[id] = true
						}
						mu.Unlock()
						answered.Add(1)
					}
				})
			}
			waitAnswered := func(n int64) {
				t.Helper()
				want := answered.Load() + n
				for deadline := time.Now().Add(30 * time.Second); answered.Load() < want; time.Sleep(time.Millisecond) {
					if time.Now().After(deadline) {
						t.Fatalf("fewer than %d requests answered within 30 s", n)
					}
				}
			}
			waitAnswered(50)
			for range 3 {
				w.stop(t)
				time.Sleep(100 * time.Millisecond) // nobody answers meanwhile
				w.start(t)
				waitAnswered(50)
			}
			cancel()
			wg.Wait()
			w.stop(t)
			mu.Lock()
			defer mu.Unlock()
			if tt.wantFail && len(fails) == 0 {
				t.Fatalf("no request failed without retries: the load missed the gaps")
			}
			if !tt.wantFail && len(fails) > 0 {
				t.Fatalf("%d of %d requests failed across restarts, e.g. %v", len(fails), answered.Load(), fails[0])
			}
			t.Logf("%d requests, %d failed, %d IDs", answered.Load(), len(fails), len(seen))
		})
	}
}

// TestRetriesAfterSilentAttempt: an attempt that gets no reply (its worker
// stopped answering, or the connection moved) is sent again after
// AttemptTimeout and answered by a worker that is up by then.
// The caller's context either has a deadline or none (context.Background:
// the client's timeout bounds the request, and no context is made for an
// attempt, a timer of nats.go's is).
func TestRetriesAfterSilentAttempt(t *testing.T) {
	for _, tt := range []struct {
		name       string
		opts       []client.Option
		noDeadline bool
		ok         bool
	}{
		{name: "retries", ok: true},
		{name: "without retries", opts: []client.Option{client.WithoutRetries()}},
		{name: "retries, no deadline", noDeadline: true, ok: true},
		{name: "without retries, no deadline", opts: []client.Option{client.WithoutRetries(), client.WithTimeout(client.AttemptTimeout)}, noDeadline: true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			w := &restartable{store: testdb.New(t, map[string]int64{"orders": 50}).Store, ns: testenv.NATS(t)}
			snc := testenv.Connect(t, w.ns)
			silent, err := snc.QueueSubscribeSync("id.segment.orders", "dispenser")
			if err != nil {
				t.Fatal(err)
			}
			if err := snc.Flush(); err != nil { // the server knows it before the request
				t.Fatal(err)
			}
			c := newClient(t, testenv.Connect(t, w.ns), tt.opts...)
			done := make(chan error, 1)
			go func() {
				ctx, cancel := context.WithTimeout(context.Background(), client.AttemptTimeout+2*time.Second)
				defer cancel()
				if tt.noDeadline {
					ctx = context.Background()
				}
				_, err := c.Segment(ctx, "orders")
				done <- err
			}()
			if _, err := silent.NextMsg(10 * time.Second); err != nil { // the first attempt reached it
				t.Fatal(err)
			}
			if err := silent.Unsubscribe(); err != nil {
				t.Fatal(err)
			}
			w.start(t)
			t.Cleanup(func() { w.stop(t) })
			var got error
			select {
			case got = <-done:
			case <-time.After(hangAfter):
				t.Fatalf("Segment after a silent attempt did not return within %v: its first attempt never timed out", hangAfter)
			}
			if (got == nil) != tt.ok {
				t.Fatalf("Segment after a silent attempt: %v, want success %v", got, tt.ok)
			}
		})
	}
}

// TestRetriesAnOrderedTagsMove: what a worker answers while an ordered
// tag's owner moves, a 503 ("owner is changing", issue 37), is hidden by a
// Client's retries: the request is sent again and answered; WithoutRetries
// returns ErrUnavailable. (A request lost in flight at the move is a
// silent attempt: TestRetriesAfterSilentAttempt.)
func TestRetriesAnOrderedTagsMove(t *testing.T) {
	for _, tt := range []struct {
		name string
		opts []client.Option
		want error
	}{
		{name: "retries"},
		{name: "without retries", opts: []client.Option{client.WithoutRetries()}, want: client.ErrUnavailable},
	} {
		t.Run(tt.name, func(t *testing.T) {
			ns := testenv.NATS(t)
			wnc := testenv.Connect(t, ns)
			var asked atomic.Int32
			// A worker whose first answer is the move's 503, then an ID.
			if _, err := wnc.QueueSubscribe("id.segment.ledger", "dispenser", func(msg *nats.Msg) {
				var reply *nats.Msg
				if asked.Add(1) == 1 {
					reply = failure(msg, protocol.CodeUnavailable, `dispenser: ordered tag's owner is changing: "ledger" is not owned here any more; try again`)
				} else {
					reply = answer(msg, []byte("42"), "")
				}
				_ = msg.RespondMsg(reply)
			}); err != nil {
				t.Fatal(err)
			}
			if err := wnc.Flush(); err != nil {
				t.Fatal(err)
			}
			c := newClient(t, testenv.Connect(t, ns), append([]client.Option{client.WithoutDirect()}, tt.opts...)...)
			id, err := c.Segment(context.Background(), "ledger")
			switch {
			case tt.want == nil && (err != nil || id != 42):
				t.Fatalf("Segment during a move: %d, %v; want 42 after a retry", id, err)
			case tt.want != nil && !errors.Is(err, tt.want):
				t.Fatalf("Segment during a move without retries: %d, %v; want %v", id, err, tt.want)
			}
		})
	}
}

// TestTimeoutErrors: a request nobody answers fails at the deadline with an
// error that wraps context.DeadlineExceeded, whichever bounds it: the
// client's timeout (a context without a deadline, canceled or not) or the
// context's deadline, with retries or without.
func TestTimeoutErrors(t *testing.T) {
	ns := testenv.NATS(t)
	snc := testenv.Connect(t, ns)
	if _, err := snc.QueueSubscribeSync("id.segment.orders", "dispenser"); err != nil { // never answers
		t.Fatal(err)
	}
	if err := snc.Flush(); err != nil {
		t.Fatal(err)
	}
	nc := testenv.Connect(t, ns)
	const timeout = 200 * time.Millisecond
	for _, tt := range []struct {
		name string
		ctx  func() (context.Context, context.CancelFunc)
		opts []client.Option
	}{
		{name: "background", ctx: func() (context.Context, context.CancelFunc) { return context.Background(), func() {} }},
		{name: "cancelable, no deadline", ctx: func() (context.Context, context.CancelFunc) { return context.WithCancel(context.Background()) }},
		{name: "deadline", ctx: func() (context.Context, context.CancelFunc) {
			return context.WithTimeout(context.Background(), timeout)
		}},
		{name: "background, without retries", ctx: func() (context.Context, context.CancelFunc) { return context.Background(), func() {} },
			opts: []client.Option{client.WithoutRetries()}},
		{name: "deadline, without retries", ctx: func() (context.Context, context.CancelFunc) {
			return context.WithTimeout(context.Background(), timeout)
		},
			opts: []client.Option{client.WithoutRetries()}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			c := newClient(t, nc, append([]client.Option{client.WithTimeout(timeout)}, tt.opts...)...)
			ctx, cancel := tt.ctx()
			defer cancel()
			if _, err := c.Segment(ctx, "orders"); !errors.Is(err, context.DeadlineExceeded) {
				t.Fatalf("Segment nobody answers: %v, want %v", err, context.DeadlineExceeded)
			}
		})
	}
}
