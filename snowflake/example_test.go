package snowflake_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log"
	"time"

	"github.com/dispenser-dev/dispenser/snowflake"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

func Example() {
	// A fixed clock makes the output reproducible; leave Now nil in real use.
	now := time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)
	g, err := snowflake.New(snowflake.Settings{WorkerID: 42, Now: func() time.Time { return now }})
	if err != nil {
		log.Fatal(err)
	}
	ids, err := g.NextN(3)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(ids)
	b, err := json.Marshal(snowflake.Decode(ids[2], g.Epoch()))
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(string(b))
	// Output:
	// [21562078003372032 21562078003372033 21562078003372034]
	// {"id":"21562078003372034","time":"2026-03-01T12:00:00.000Z","timestamp":5140800000,"worker":42,"sequence":2}
}

// A service leases its worker ID from JetStream and maps errors to statuses.
func ExampleStart() {
	nc, err := nats.Connect(nats.DefaultURL)
	if err != nil {
		log.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		log.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	w, err := snowflake.Start(ctx, js, snowflake.NodeSettings{Instance: "dispenser-1"})
	if err != nil {
		log.Fatal(err) // epoch mismatch, all worker IDs taken, bad settings, NATS down
	}
	defer func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := w.Close(ctx); err != nil {
			log.Print(err)
		}
	}()

	ids, err := w.AppendIDs(make([]int64, 0, 100), 100)
	switch {
	case errors.Is(err, snowflake.ErrInvalidCount):
		fmt.Println(400)
	case errors.Is(err, snowflake.ErrUnavailable): // fenced, clock backwards, overloaded, closed
		fmt.Println(503)
	case err != nil:
		fmt.Println(500)
	default:
		fmt.Println(len(ids), "IDs from worker", snowflake.Decode(ids[0], w.Epoch()).Worker)
	}
}
