package mysql_test

import (
	"context"
	"fmt"
	"log"
	"os"

	"github.com/dispenser-dev/dispenser/segment/mysql"
	"github.com/dispenser-dev/dispenser/tagmodel"
)

// Open a store on Leaf's database, create the tables it lacks, create a
// tag and fetch its first segment.
func Example() {
	ctx := context.Background()
	store, err := mysql.Open(ctx, os.Getenv("MYSQL_DSN")) // e.g. leaf:secret@tcp(127.0.0.1:3306)/leaf
	if err != nil {
		log.Fatal(err)
	}
	defer store.Close()
	if _, err := mysql.Migrate(ctx, store.DB()); err != nil {
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
