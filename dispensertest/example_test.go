package dispensertest_test

import (
	"context"
	"fmt"
	"log"

	"github.com/dispenser-dev/dispenser/client"
	"github.com/dispenser-dev/dispenser/dispensertest"
)

// A worker with the tag "orders" starting at 1000; in a test, New(t, …)
// starts it and stops it when the test ends.
func Example() {
	s, err := dispensertest.Start(dispensertest.Options{
		Tags: []dispensertest.Tag{{Name: "orders", Start: 1000}},
	})
	if err != nil {
		log.Fatal(err)
	}
	defer s.Close()
	c, err := client.New(s.Conn())
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()
	ctx := context.Background()
	first, err := c.Segment(ctx, "orders")
	if err != nil {
		log.Fatal(err)
	}
	next, err := c.SegmentN(ctx, "orders", 3)
	if err != nil {
		log.Fatal(err)
	}
	demo, err := c.Segment(ctx, "demo") // created on first use
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(first, next, demo)
	// Output: 1000 [1001 1002 1003] 1
}
