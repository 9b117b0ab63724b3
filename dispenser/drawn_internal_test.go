package dispenser

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nats.go/micro"

	"github.com/dispenser-dev/dispenser/ownership"
	"github.com/dispenser-dev/dispenser/segment"
	"github.com/dispenser-dev/dispenser/segment/kv"
	"github.com/dispenser-dev/dispenser/testenv"
)

// fixedOwners is an Owners whose owner of every ordered tag never changes:
// the worker itself (self) or the one answering on subject.
type fixedOwners struct {
	self    bool
	subject string
}

func (f fixedOwners) Owns(string) bool { return f.self }
func (f fixedOwners) Cached(string) (ownership.Route, bool) {
	return f.route(), true
}
func (f fixedOwners) Route(context.Context, string) (ownership.Route, error) { return f.route(), nil }
func (f fixedOwners) Claim(context.Context, string) (ownership.Route, error) { return f.route(), nil }
func (f fixedOwners) Stats() ownership.Stats                                 { return ownership.Stats{} }
func (f fixedOwners) route() ownership.Route {
	if f.self {
		return ownership.Route{Self: true}
	}
	return ownership.Route{Owner: "owner", Subject: f.subject}
}

// drawnPair is two workers of the ordered tag "seq" on an embedded
// nats-server: owner, which owns it for good and draws its requests with
// weight subscriptions of perSub requests each, and other, which forwards
// them to owner.
type drawnPair struct {
	owner, other *Service
	ownerConn    *nats.Conn
	baseSubs     int        // owner's subscriptions before it drew the tag
	nc           *nats.Conn // a requester's
}

func newDrawnPair(t *testing.T, weight, perSub int) *drawnPair {
	t.Helper()
	old := drawnPerSub
	drawnPerSub = perSub
	t.Cleanup(func() { drawnPerSub = old })
	ns := testenv.NATS(t)
	js, err := jetstream.New(testenv.Connect(t, ns))
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	store, err := kv.New(ctx, js, kv.Settings{})
	if err != nil {
		t.Fatal(err)
	}
	if err := store.CreateTag(ctx, segment.Tag{Name: "seq", Step: 1000, MaxID: 1, Ordered: true}); err != nil {
		t.Fatal(err)
	}
	start := func(owners fixedOwners, subject string) (*Service, *nats.Conn) {
		alloc, err := segment.New(segment.Settings{Store: store, Logger: slog.New(slog.DiscardHandler)})
		if err != nil {
			t.Fatal(err)
		}
		conn := testenv.Connect(t, ns)
		svc, err := New(Config{Conn: conn, Segments: alloc, Owners: owners, OwnerSubject: subject,
			OwnerWeight: weight, Logger: slog.New(slog.DiscardHandler)})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			_ = svc.Stop(ctx)
			_ = alloc.Close(ctx)
		})
		return svc, conn
	}
	p := &drawnPair{}
	p.owner, p.ownerConn = start(fixedOwners{self: true}, "id.owner.a")
	p.other, _ = start(fixedOwners{subject: "id.owner.a"}, "id.owner.b")
	p.baseSubs = p.ownerConn.NumSubscriptions()
	p.nc = testenv.Connect(t, ns)
	deadline := time.Now().Add(10 * time.Second)
	for { // until the owner draws the tag's requests
		msg, err := p.nc.Request("id.segment.seq", nil, 5*time.Second)
		if err != nil || msg.Header.Get(micro.ErrorCodeHeader) != "" {
			t.Fatalf("warm-up request: %v %v", err, msg)
		}
		if _, ok := p.owner.attracted.has.Load("seq"); ok {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the owner draws no requests")
		}
	}
	if err := p.ownerConn.Flush(); err != nil { // the server knows the subscriptions
		t.Fatal(err)
	}
	return p
}

// load sends requests for seq from 20 clients with timeout; it returns how
// many timed out and how many failed otherwise.
func (p *drawnPair) load(requests int, timeout time.Duration) (timedOut, failed int) {
	var to, f atomic.Int64
	var wg sync.WaitGroup
	for range 20 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range requests / 20 {
				msg, err := p.nc.Request("id.segment.seq", nil, timeout)
				switch {
				case errors.Is(err, nats.ErrTimeout):
					to.Add(1)
				case err != nil || msg.Header.Get(micro.ErrorCodeHeader) != "":
					f.Add(1)
				}
			}
		}()
	}
	wg.Wait()
	return int(to.Load()), int(f.Load())
}

// TestFrozenOwnerSwallowsBoundedRequests: an owner that stops handling the
// requests it draws (as a frozen process does) swallows at most
// OwnerWeight*drawnPerSub of them: the server drops each drawing
// subscription after drawnPerSub requests, and the other workers get the
// rest. Without that limit it swallows its share of all of them.
func TestFrozenOwnerSwallowsBoundedRequests(t *testing.T) {
	const weight, requests = 4, 200
	tests := []struct {
		name             string
		perSub           int
		wantMin, wantMax int // requests swallowed
	}{
		{name: "limited", perSub: 5, wantMin: 1, wantMax: weight * 5},
		{name: "no limit", perSub: 0, wantMin: requests / 4, wantMax: requests},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := newDrawnPair(t, weight, tt.perSub)
			// Freeze the owner's handling of drawn requests: its
			// goroutine leaves, and they pile up in its channel.
			p.owner.attracted.leave()
			time.Sleep(100 * time.Millisecond) // it has left
			if _, failed := p.load(requests, 500*time.Millisecond); failed != 0 {
				t.Fatalf("%d requests failed otherwise than by a timeout", failed)
			}
			if n := len(p.owner.attracted.ch); n < tt.wantMin || n > tt.wantMax {
				t.Fatalf("the frozen owner swallowed %d of %d requests, want %d..%d", n, requests, tt.wantMin, tt.wantMax)
			}
		})
	}
}

// TestDrawingSubscriptionsAreRenewed: a live owner replaces each drawing
// subscription the server dropped after its drawnPerSub requests, so it
// keeps drawing most of its tag's requests.
func TestDrawingSubscriptionsAreRenewed(t *testing.T) {
	const weight, perSub, requests = 4, 5, 600
	p := newDrawnPair(t, weight, perSub)
	if timedOut, failed := p.load(requests, 10*time.Second); timedOut+failed != 0 {
		t.Fatalf("%d requests timed out, %d failed", timedOut, failed)
	}
	// 1 of 6 matching subscriptions is the other worker's while the owner
	// renews its 4; 1 of 2 once they are all spent.
	if share := float64(p.other.forwarded.Load()) / requests; share > 0.35 {
		t.Fatalf("%.2f of the requests were forwarded, want about 1/6: drawing subscriptions not renewed", share)
	}
	deadline := time.Now().Add(10 * time.Second)
	for p.ownerConn.NumSubscriptions() != p.baseSubs+weight && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if got := p.ownerConn.NumSubscriptions() - p.baseSubs; got != weight {
		t.Fatalf("the owner has %d drawing subscriptions, want %d", got, weight)
	}
}
