package postgres_test

import (
	"context"
	"fmt"
	"log"
	"os"

	"github.com/dispenser-dev/dispenser/segment/postgres"
	"github.com/dispenser-dev/dispenser/tagmodel"
)

// Open a store, bring the schema up to date, create a tag and fetch its
// first segment.
func Example() {
	ctx := context.Background()
	store, err := postgres.Open(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer store.Close()
	if _, err := postgres.Migrate(ctx, store.Pool()); err != nil {
		log.Fatal(err)
	}
	if err := store.CreateTag(ctx, tagmodel.Tag{Name: "orders", Step: 1000, MaxID: 1, Description: "order numbers"}); err != nil {
		log.Fatal(err)
	}
	a, err := store.Fetch(ctx, "orders", 0) // 0: the tag's own step
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(a.Start, a.End) // 1 1001: IDs 1..1000 are ours
}
