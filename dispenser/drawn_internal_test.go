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
		{name: "limited", perSub: 5, wantMin: 0, wantMax: weight * 5},
		{name: "no limit", perSub: 0, wantMin: requests / 4, wantMax: requests},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			defer func(n int) { drawnPerSub = n }(drawnPerSub)
			drawnPerSub = tt.perSub
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
			start := func(owners fixedOwners, subject string) *Service {
				alloc, err := segment.New(segment.Settings{Store: store, Logger: slog.New(slog.DiscardHandler)})
				if err != nil {
					t.Fatal(err)
				}
				svc, err := New(Config{Conn: testenv.Connect(t, ns), Segments: alloc, Owners: owners, OwnerSubject: subject,
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
				return svc
			}
			owner := start(fixedOwners{self: true}, "id.owner.a")
			start(fixedOwners{subject: "id.owner.a"}, "id.owner.b")
			nc := testenv.Connect(t, ns)
			deadline := time.Now().Add(10 * time.Second)
			for { // until the owner draws the tag's requests
				msg, err := nc.Request("id.segment.seq", nil, 5*time.Second)
				if err != nil || msg.Header.Get(micro.ErrorCodeHeader) != "" {
					t.Fatalf("warm-up request: %v %v", err, msg)
				}
				if _, ok := owner.attracted.has.Load("seq"); ok {
					break
				}
				if time.Now().After(deadline) {
					t.Fatal("the owner draws no requests")
				}
			}
			if err := nc.Flush(); err != nil {
				t.Fatal(err)
			}
			// Freeze the owner's handling of drawn requests: its
			// goroutine leaves, and they pile up in its channel.
			owner.attracted.leave()

			var swallowed, failed atomic.Int64
			var wg sync.WaitGroup
			for range 20 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for range requests / 20 {
						msg, err := nc.Request("id.segment.seq", nil, 500*time.Millisecond)
						switch {
						case errors.Is(err, nats.ErrTimeout):
							swallowed.Add(1)
						case err != nil || msg.Header.Get(micro.ErrorCodeHeader) != "":
							failed.Add(1)
						}
					}
				}()
			}
			wg.Wait()
			if n := failed.Load(); n != 0 {
				t.Fatalf("%d requests failed otherwise than by a timeout", n)
			}
			if n := int(swallowed.Load()); n < tt.wantMin || n > tt.wantMax {
				t.Fatalf("the frozen owner swallowed %d of %d requests, want %d..%d", n, requests, tt.wantMin, tt.wantMax)
			}
		})
	}
}
