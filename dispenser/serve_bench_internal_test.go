package dispenser

import (
	"context"
	"log/slog"
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
	for _, t := range []tagmodel.Tag{{Name: "bench", Step: 1_000_000, MaxID: 1}, {Name: "bench_ord", Step: 1_000_000, MaxID: 1, Ordered: true}} {
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
	b.Run("owner", func(b *testing.B) { benchOwner(b, ns, js, alloc) })
}

// benchOwner is BenchmarkServe's ordered cases: a worker that owns the
// ordered tag bench_ord (a real lease in the owners bucket, claimed by the
// first request) serves a request for it that came on the segment
// endpoint, as `dispenser bench --modes ordered` loads the owner alone;
// beside it the plain tag bench on the same service. Compare with
// baseline.
func benchOwner(b *testing.B, ns *server.Server, js jetstream.JetStream, alloc *segment.Allocator) {
	owners, err := ownership.Open(context.Background(), js, alloc, ownership.Settings{Owner: "bench-owner", Subject: "benchord.owner.bench",
		Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(owners.Close)
	// A prefix of its own: the other cases' services are in the queue
	// group of id.segment.*.
	svc, err := New(Config{Conn: testenv.Connect(b, ns), Prefix: "benchord", Segments: alloc, Logger: slog.New(slog.DiscardHandler),
		Owners: owners, OwnerSubject: "benchord.owner.bench", OwnerID: "benchowner"})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = svc.Stop(context.Background()) })
	nc := testenv.Connect(b, ns)
	for _, tag := range []string{"bench", "bench_ord"} { // the claim, the first segments
		if resp, err := nc.Request("benchord.segment."+tag, nil, 10*time.Second); err != nil {
			b.Fatal(err)
		} else if code := resp.Header.Get(micro.ErrorCodeHeader); code != "" {
			b.Fatalf("%s: %s %s", tag, code, resp.Header.Get(micro.ErrorHeader))
		}
	}
	if !owners.Owns("bench_ord") {
		b.Fatal("bench_ord is not owned after its first request")
	}
	ep := svc.bound.Load().seg
	for _, tag := range []string{"bench", "bench_ord"} {
		b.Run(tag, func(b *testing.B) {
			msg := &nats.Msg{Subject: "benchord.segment." + tag, Reply: "_INBOX.bench.nobody"}
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
