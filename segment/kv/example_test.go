package kv_test

import (
	"context"
	"fmt"
	"log"
	"os"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/dispenser-dev/dispenser/segment/kv"
	"github.com/dispenser-dev/dispenser/tagmodel"
	"github.com/dispenser-dev/dispenser/testenv"
)

// Keep the tags in an embedded NATS server's JetStream: no database needed.
func Example() {
	dir, err := os.MkdirTemp("", "dispenser-kv-example-")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)
	srv, err := server.NewServer(testenv.NATSOptions(dir))
	if err != nil {
		log.Fatal(err)
	}
	srv.Start()
	defer srv.Shutdown()
	if !srv.ReadyForConnections(10 * time.Second) {
		log.Fatal("nats-server not ready")
	}
	nc, err := nats.Connect(srv.ClientURL())
	if err != nil {
		log.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		log.Fatal(err)
	}

	ctx := context.Background()
	store, err := kv.New(ctx, js, kv.Settings{}) // bucket dispenser_segments, file storage
	if err != nil {
		log.Fatal(err)
	}
	if err := store.CreateTag(ctx, tagmodel.Tag{Name: "orders", Step: 1000, MaxID: 1, Description: "order numbers"}); err != nil {
		log.Fatal(err)
	}
	a, err := store.Fetch(ctx, "orders", 0) // 0: the tag's own step
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(a.Start, a.End) // IDs 1..1000 are ours
	// Output: 1 1001
}
