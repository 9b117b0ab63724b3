package main

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"

	"github.com/dispenser-dev/dispenser/testenv"
)

// TestPostgresFailoverWithoutDuplicates is the failover of issue 10 with
// real parts: two workers reach a PostgreSQL primary and its asynchronous
// streaming replica through one multi-host URL; replication stops, the
// workers go on fetching from the primary, the primary is lost and the
// replica, whose max_id values are behind, is promoted. Without the witness
// IDs are handed out twice (the scenario can fail); with it none is, and the
// rollback is logged.
func TestPostgresFailoverWithoutDuplicates(t *testing.T) {
	tests := []struct {
		name     string
		witness  bool
		wantDups bool
	}{
		{"without the witness IDs repeat", false, true},
		{"with the witness no ID repeats", true, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
			defer cancel()
			primary, replica := testenv.PostgresPair(t)
			url := testenv.MultiHostURL("postgres", primary, replica)
			if out, err := runCmd(t, "migrate", "--postgres-url", url); err != nil {
				t.Fatalf("migrate over the multi-host URL: %v\n%s", err, out)
			}
			if out, err := runCmd(t, "tags", "create", "orders", "--step", "50", "--postgres-url", url); err != nil {
				t.Fatalf("tags create: %v\n%s", err, out)
			}
			if err := replica.WaitReplayed(ctx, primary); err != nil {
				t.Fatal(err)
			}
			ns := testenv.NATS(t)
			args := []string{"serve", "--nats-url", ns.ClientURL(), "--postgres-url", url, "--max-step", "50",
				"--max-wait", "2s", "--fetch-timeout", "1s", "--snowflake=false", fmt.Sprintf("--witness=%v", tt.witness)}
			logs := []*syncBuffer{startServe(t, args...), startServe(t, args...)}
			nc := testenv.Connect(t, ns)
			waitForID(t, nc, "id.segment.orders", logs[0])

			seen := map[int64]int{}
			dups := 0
			take := func(n int) {
				t.Helper()
				for got := 0; got < n; {
					if ctx.Err() != nil {
						t.Fatalf("took %d of %d IDs before the deadline", got, n)
					}
					ids, err := requestIDs(nc, "id.segment.orders", 7)
					if err != nil {
						time.Sleep(50 * time.Millisecond) // store failing over: retry
						continue
					}
					for _, id := range ids {
						if seen[id]++; seen[id] > 1 {
							dups++
						}
					}
					got += len(ids)
				}
			}
			take(500)
			if err := replica.CutReplication(ctx); err != nil {
				t.Fatal(err)
			}
			take(1000) // segments fetched now are lost with the primary
			if err := primary.Stop("immediate"); err != nil {
				t.Fatal(err)
			}
			if err := replica.Promote(ctx); err != nil {
				t.Fatal(err)
			}
			take(2000)
			if got := dups > 0; got != tt.wantDups {
				t.Fatalf("%d IDs handed out twice among %d, want duplicates %v", dups, len(seen), tt.wantDups)
			}
			if tt.witness {
				const msg = "the segment store lost writes"
				if !strings.Contains(logs[0].String()+logs[1].String(), msg) {
					t.Errorf("no worker logged %q", msg)
				}
			}
		})
	}
}

// requestIDs asks subject for n IDs and parses the reply.
func requestIDs(nc *nats.Conn, subject string, n int) ([]int64, error) {
	resp, err := nc.Request(subject, []byte(fmt.Sprint(n)), 5*time.Second)
	if err != nil {
		return nil, err
	}
	if code := resp.Header.Get(micro.ErrorCodeHeader); code != "" {
		return nil, errors.New(code + " " + resp.Header.Get(micro.ErrorHeader))
	}
	var ids []int64
	for _, line := range strings.Split(string(resp.Data), "\n") {
		var id int64
		if _, err := fmt.Sscan(line, &id); err != nil {
			return nil, fmt.Errorf("bad reply %q", resp.Data)
		}
		ids = append(ids, id)
	}
	return ids, nil
}
