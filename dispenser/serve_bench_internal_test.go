package dispenser

import (
	"context"
	"log/slog"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nats.go/micro"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/dispenser-dev/dispenser/ownership"
	"github.com/dispenser-dev/dispenser/protocol"
	"github.com/dispenser-dev/dispenser/segment"
	"github.com/dispenser-dev/dispenser/segment/kv"
	"github.com/dispenser-dev/dispenser/snowflake"
	"github.com/dispenser-dev/dispenser/tagmodel"
	"github.com/dispenser-dev/dispenser/testenv"
)

// BenchmarkServe is one single-ID request as an endpoint's subscription
// hands it to the service (endpoint.serve: the handler, the reply
// published, micro's counts), beside the bench's bare responder (the
// baseline of `dispenser bench`, bench/local.go startBaseline) doing its
// parse-add-format-publish on a connection to the same server: the
// difference is what a request costs the service beyond NATS. Compare
// ns/op, cpu-ns/op and allocs/op within one run; the replies go to a
// subject nobody subscribes to.
func BenchmarkServe(b *testing.B) {
	ns := testenv.NATS(b)
	js, err := jetstream.New(testenv.Connect(b, ns))
	if err != nil {
		b.Fatal(err)
	}
	ctx := context.Background()
	store, err := kv.New(ctx, js, kv.Settings{})
	if err != nil {
		b.Fatal(err)
	}
	for _, t := range []tagmodel.Tag{{Name: "bench", Step: 1_000_000, MaxID: 1}, {Name: "bench_ord", Step: 1_000_000, MaxID: 1, Ordered: true},
		{Name: "bench_ord_late", Step: 1_000_000, MaxID: 1, Ordered: true}} {
		if err := store.CreateTag(ctx, t); err != nil {
			b.Fatal(err)
		}
	}
	quiet := slog.New(slog.DiscardHandler)
	alloc, err := segment.New(segment.Settings{Store: store, Logger: quiet})
	if err != nil {
		b.Fatal(err)
	}
	node, err := snowflake.Start(ctx, js, snowflake.NodeSettings{Instance: "bench", Settings: snowflake.Settings{Logger: quiet}})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = alloc.Close(ctx)
		_ = node.Close(ctx)
	})
	const reply = "_INBOX.bench.nobody"

	b.Run("baseline", func(b *testing.B) {
		nc := testenv.Connect(b, ns)
		var counter atomic.Int64
		var buf []byte
		// bench/local.go startBaseline's handler, as it runs for a
		// request without headers.
		handle := func(m *nats.Msg) {
			n, err := protocol.ParseCount(m.Data, 1_000_000)
			format := protocol.FormatList
			if err == nil && len(m.Header) > 0 {
				format, err = protocol.ParseFormat(m.Header.Values(protocol.FormatHeader))
			}
			token := m.Header.Values(protocol.TokenHeader)
			if err != nil {
				b.Fatal(err)
			}
			last := counter.Add(int64(n))
			runs := [1]protocol.Run{{First: last - int64(n) + 1, Last: last}}
			if format == protocol.FormatRange {
				buf = protocol.AppendRanges(buf[:0], runs[:])
			} else {
				buf = protocol.AppendList(buf[:0], runs[:])
			}
			if token != nil {
				nc.PublishMsg(&nats.Msg{Subject: m.Reply, Header: nats.Header{protocol.TokenHeader: token}, Data: buf})
				return
			}
			nc.Publish(m.Reply, buf)
		}
		msg := &nats.Msg{Subject: "bench.baseline", Reply: reply}
		loopCPU(b, func() { handle(msg) })
	})
	for _, metrics := range []bool{false, true} {
		cfg := Config{Conn: testenv.Connect(b, ns), Segments: alloc, Snowflake: node, Logger: quiet}
		name := "metrics=off"
		if metrics {
			cfg.Registerer, cfg.MetricsTags, name = prometheus.NewRegistry(), []string{"bench"}, "metrics=on"
		}
		svc, err := New(cfg)
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { _ = svc.Stop(context.Background()) })
		// The tag's first segment, fetched before the loop.
		if _, err := testenv.Connect(b, ns).Request("id.segment.bench", nil, 10*time.Second); err != nil {
			b.Fatal(err)
		}
		bd := svc.bound.Load()
		for _, ep := range []*endpoint{bd.seg, bd.sf} {
			for _, body := range []string{"", "1 AAAAAAAAAAAAAAAAAAAAAA"} {
				bname := ep.name + "/" + name
				if body != "" {
					bname += "/token" // as the Go client sends it
				}
				b.Run(bname, func(b *testing.B) {
					subject := "id.snowflake"
					if ep == bd.seg {
						subject = "id.segment.bench"
					}
					msg := &nats.Msg{Subject: subject, Reply: reply, Data: []byte(body)}
					sc := new(scratch)
					loopCPU(b, func() { ep.serve(msg, sc) })
					if got := ep.errs.Load(); got != 0 {
						b.Fatalf("%d errors, last %s", got, *ep.lastError.Load())
					}
				})
			}
		}
	}
	// An owner serves from segments fetched before its switch window
	// ended (segment.Allocator.SwitchWindow, about a minute by default
	// from the first time it saw the tag ordered, as in `dispenser bench`)
	// with one more reading of the wall clock per request; past the
	// window, without it.
	b.Run("owner", func(b *testing.B) { benchOwner(b, ns, js, store, "bench_ord", segment.Settings{}) })
	b.Run("owner-past-window", func(b *testing.B) {
		benchOwner(b, ns, js, store, "bench_ord_late", segment.Settings{RefreshInterval: 300 * time.Millisecond, FetchTimeout: 100 * time.Millisecond})
	})
}

// benchOwner is BenchmarkServe's ordered cases: a worker that owns the
// ordered tag ord (a real lease in the owners bucket, claimed by the first
// request), with an allocator of settings as, serves a request for it that
// came on the segment endpoint, as `dispenser bench --modes ordered` loads
// the owner alone; beside it the plain tag bench on the same service.
// Compare with baseline.
func benchOwner(b *testing.B, ns *server.Server, js jetstream.JetStream, store tagmodel.Store, ord string, as segment.Settings) {
	quiet := slog.New(slog.DiscardHandler)
	as.Store, as.Logger = store, quiet
	alloc, err := segment.New(as)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = alloc.Close(ctx)
	})
	prefix := "b" + strings.ReplaceAll(ord, "_", "") // a prefix of its own, out of the other cases' queue groups
	owners, err := ownership.Open(context.Background(), js, alloc, ownership.Settings{Owner: prefix, Subject: prefix + ".owner.w",
		Logger: quiet})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(owners.Close)
	svc, err := New(Config{Conn: testenv.Connect(b, ns), Prefix: prefix, Segments: alloc, Logger: quiet,
		Owners: owners, OwnerSubject: prefix + ".owner.w", OwnerID: "w"})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = svc.Stop(context.Background()) })
	nc := testenv.Connect(b, ns)
	request := func(tag string) {
		if resp, err := nc.Request(prefix+".segment."+tag, nil, 10*time.Second); err != nil {
			b.Fatal(err)
		} else if code := resp.Header.Get(micro.ErrorCodeHeader); code != "" {
			b.Fatalf("%s: %s %s", tag, code, resp.Header.Get(micro.ErrorHeader))
		}
	}
	request("bench") // the first segments, the claim
	request(ord)
	if !owners.Owns(ord) {
		b.Fatalf("%s is not owned after its first request", ord)
	}
	if w := alloc.SwitchWindow(); w < time.Second {
		time.Sleep(w + 10*time.Millisecond)
		request(ord) // past the window: drops the segment fetched before its end
	}
	ep := svc.bound.Load().seg
	for _, tag := range []string{"bench", ord} {
		b.Run(tag, func(b *testing.B) {
			msg := &nats.Msg{Subject: prefix + ".segment." + tag, Reply: "_INBOX.bench.nobody"}
			sc := new(scratch)
			loopCPU(b, func() { ep.serve(msg, sc) })
			if got := ep.errs.Load(); got != 0 {
				b.Fatalf("%d errors, last %s", got, *ep.lastError.Load())
			}
		})
	}
}

// loopCPU runs op in b's loop, reporting allocations and the process's
// CPU time per op (cpu-ns/op: the embedded server's share included, which
// is the same for every case), steadier than ns/op on a shared machine.
func loopCPU(b *testing.B, op func()) {
	b.ReportAllocs()
	before, ok := processCPU()
	for b.Loop() {
		op()
	}
	if after, _ := processCPU(); ok {
		b.ReportMetric(float64(after-before)/float64(b.N), "cpu-ns/op")
	}
}

// processCPU is the CPU time this process used so far, user and system
// (testenv's servers need a unix too).
func processCPU() (time.Duration, bool) {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0, false
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano()), true
}
