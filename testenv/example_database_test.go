package testenv_test

import (
	"context"
	"fmt"
	"log"

	"github.com/dispenser-dev/dispenser/testenv"
	"github.com/jackc/pgx/v5"
)

// An Example function has no testing.TB; it makes and drops its database
// with NewDatabase. The package's TestMain must call testenv.Run.
func ExampleNewDatabase() {
	ctx := context.Background()
	url, drop, err := testenv.NewDatabase(ctx)
	if err != nil {
		log.Fatal(err)
	}
	defer drop()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		log.Fatal(err)
	}
	defer conn.Close(ctx)
	var n int
	if err := conn.QueryRow(ctx, "SELECT count(*) FROM pg_tables WHERE schemaname = 'public'").Scan(&n); err != nil {
		log.Fatal(err)
	}
	fmt.Println("tables:", n)
	// Output: tables: 0
}
