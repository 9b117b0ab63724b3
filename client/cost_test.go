package client_test

import (
	"context"
	"fmt"
	"runtime"
	"strconv"
	"sync/atomic"
	"testing"

	"github.com/nats-io/nats.go"

	"github.com/dispenser-dev/dispenser/client"
	"github.com/dispenser-dev/dispenser/protocol"
	"github.com/dispenser-dev/dispenser/testenv"
)

// bareResponder answers every request on subject with the next value of a
// counter in decimal: the least a responder can do. It echoes the
// request's token, without which the client refuses a reply, and answers
// a request without headers without headers.
func bareResponder(tb testing.TB, nc *nats.Conn, subject string) {
	tb.Helper()
	var n atomic.Int64
	var buf []byte // only the subscription's goroutine uses it
	_, err := nc.Subscribe(subject, func(m *nats.Msg) {
		token, inBody := protocol.RequestToken(m.Header, m.Data)
		buf = buf[:0]
		if inBody {
			buf = protocol.AppendTokenLine(buf, token, "")
		}
		buf = strconv.AppendInt(buf, n.Add(1), 10)
		if token != "" && !inBody {
			_ = nc.PublishMsg(&nats.Msg{Subject: m.Reply, Header: nats.Header{protocol.TokenHeader: {token}}, Data: buf})
			return
		}
		_ = nc.Publish(m.Reply, buf)
	})
	if err != nil {
		tb.Fatal(err)
	}
	if err := nc.Flush(); err != nil {
		tb.Fatal(err)
	}
}

// BenchmarkClientCost is the client's own cost: a raw
// nc.RequestWithContext and Client.Segment, each to the same bare
// responder, on the same connection, with 256 concurrent callers (like
// `dispenser bench --modes client`, which alternates them in one run and
// reports the ratio). Profile with -cpuprofile and -memprofile.
func BenchmarkClientCost(b *testing.B) {
	ns := testenv.NATS(b)
	bareResponder(b, testenv.Connect(b, ns), "bare.segment.*")
	nc := testenv.Connect(b, ns)
	c := newClient(b, nc, client.WithPrefix("bare"))
	ctx := context.Background()
	calls := []struct {
		name string
		call func() error
	}{
		{"raw", func() error { _, err := nc.RequestWithContext(ctx, "bare.segment.t", nil); return err }},
		{"raw-token", func() error {
			// The token alone, as the client sends and checks it: the
			// protocol's share of the client's cost.
			tok := client.NewTokenForTest()
			m, err := nc.RequestWithContext(ctx, "bare.segment.t", []byte("1 "+tok))
			if err != nil {
				return err
			}
			if got, _, _, _ := protocol.CutTokenLine(m.Data); string(got) != tok {
				return fmt.Errorf("token %q, want %q", got, tok)
			}
			return nil
		}},
		{"client", func() error { _, err := c.Segment(ctx, "t"); return err }},
	}
	for _, cc := range calls {
		b.Run(cc.name, func(b *testing.B) {
			b.ReportAllocs()
			b.SetParallelism(max(1, 256/runtime.GOMAXPROCS(0))) // 256 callers
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					if err := cc.call(); err != nil {
						b.Error(err)
						return
					}
				}
			})
		})
	}
}
