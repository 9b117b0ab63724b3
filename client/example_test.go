package client_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/dispenser-dev/dispenser/client"
	"github.com/dispenser-dev/dispenser/dispenser"
	"github.com/dispenser-dev/dispenser/segment"
	"github.com/dispenser-dev/dispenser/segment/kv"
	"github.com/dispenser-dev/dispenser/snowflake"
	"github.com/dispenser-dev/dispenser/testenv"
)

// natsURL is the embedded server the Examples talk to: a dispenser worker in
// zero-setup style (KV segment store, tags created on first use, snowflake).
var natsURL string

func TestMain(m *testing.M) {
	stop, err := startExampleWorker()
	if err != nil {
		fmt.Fprintln(os.Stderr, "example worker:", err)
		os.Exit(1)
	}
	code := testenv.Run(m)
	stop()
	os.Exit(code)
}

func startExampleWorker() (stop func(), err error) {
	dir, err := os.MkdirTemp("", "dispenser-client-example-")
	if err != nil {
		return nil, err
	}
	ns, err := server.NewServer(testenv.NATSOptions(dir))
	if err != nil {
		return nil, err
	}
	ns.Start()
	if !ns.ReadyForConnections(10 * time.Second) {
		return nil, errors.New("nats-server not ready")
	}
	natsURL = ns.ClientURL()
	nc, err := nats.Connect(natsURL)
	if err != nil {
		return nil, err
	}
	ctx := context.Background()
	js, _ := jetstream.New(nc)
	store, err := kv.New(ctx, js, kv.Settings{})
	if err != nil {
		return nil, err
	}
	quiet := slog.New(slog.DiscardHandler)
	// MaxWait far above the default 100ms: an Example's first request
	// waits for its tag to be created and fetched, which on a busy machine
	// takes longer (it printed a 503 otherwise).
	alloc, err := segment.New(segment.Settings{Store: store, AutoCreateStep: 1000, MaxWait: 10 * time.Second, Logger: quiet})
	if err != nil {
		return nil, err
	}
	sf, err := snowflake.Start(ctx, js, snowflake.NodeSettings{Instance: "example", Settings: snowflake.Settings{Logger: quiet}})
	if err != nil {
		return nil, err
	}
	svcConn, err := nats.Connect(natsURL)
	if err != nil {
		return nil, err
	}
	svc, err := dispenser.New(dispenser.Config{Conn: svcConn, Segments: alloc, Snowflake: sf, Logger: quiet})
	if err != nil {
		return nil, err
	}
	return func() {
		svc.Stop(ctx)
		alloc.Close(ctx)
		sf.Close(ctx)
		svcConn.Close()
		nc.Close()
		ns.Shutdown()
		os.RemoveAll(dir)
	}, nil
}

func ExampleClient_Segment() {
	nc, _ := nats.Connect(natsURL)
	defer nc.Close()
	c, _ := client.New(nc)
	id, err := c.Segment(context.Background(), "example_orders")
	fmt.Println(id, err)
	// Output: 1 <nil>
}

func ExampleClient_SegmentN() {
	nc, _ := nats.Connect(natsURL)
	defer nc.Close()
	c, _ := client.New(nc)
	ids, err := c.SegmentN(context.Background(), "example_invoices", 5)
	fmt.Println(ids, err)
	// Output: [1 2 3 4 5] <nil>
}

func ExampleClient_Snowflake() {
	nc, _ := nats.Connect(natsURL)
	defer nc.Close()
	c, _ := client.New(nc)
	id, err := c.Snowflake(context.Background())
	parts := snowflake.Decode(id, snowflake.DefaultEpoch)
	fmt.Println(id > 0, err, parts.Worker >= 0 && parts.Worker < 1024)
	// Output: true <nil> true
}

func ExampleClient_SnowflakeN() {
	nc, _ := nats.Connect(natsURL)
	defer nc.Close()
	c, _ := client.New(nc)
	ids, err := c.SnowflakeN(context.Background(), 3)
	fmt.Println(len(ids), err, ids[0] < ids[1] && ids[1] < ids[2])
	// Output: 3 <nil> true
}

func ExampleWithPrefetch() {
	nc, _ := nats.Connect(natsURL)
	defer nc.Close()
	// Keep up to 1000 IDs of each tag at hand; most calls never leave the
	// process.
	c, _ := client.New(nc, client.WithPrefetch(1000))
	defer c.Close()
	ctx := context.Background()
	a, _ := c.Segment(ctx, "example_prefetch")
	b, _ := c.Segment(ctx, "example_prefetch")
	fmt.Println(a, b)
	// Output: 1 2
}

func ExampleError() {
	nc, _ := nats.Connect(natsURL)
	defer nc.Close()
	c, _ := client.New(nc)
	_, err := c.SegmentN(context.Background(), "example_orders", 0)
	fmt.Println(errors.Is(err, client.ErrBadRequest))
	_, err = c.SegmentN(context.Background(), "example_orders", 1_000_000) // over --max-batch
	var e *client.Error
	fmt.Println(errors.As(err, &e), e.Code, errors.Is(err, client.ErrBadRequest))
	// Output:
	// true
	// true 400 true
}
