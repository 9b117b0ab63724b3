package mysqlstore_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"

	"github.com/dispenser-dev/dispenser/client"
	"github.com/dispenser-dev/dispenser/internal/leafsql"
	"github.com/dispenser-dev/dispenser/segment/mysql"
	"github.com/dispenser-dev/dispenser/tagmodel"
	"github.com/dispenser-dev/dispenser/testenv"
	"github.com/dispenser-dev/dispenser/worker"
	"github.com/dispenser-dev/dispenser/worker/mysqlstore"
)

func TestMain(m *testing.M) { os.Exit(testenv.Run(m)) }

// newDB returns the DSN of a new database with the tables and the tags,
// name → step, each starting at 1.
func newDB(tb testing.TB, tags map[string]int64) string {
	tb.Helper()
	dsn := testenv.MySQL(tb)
	db, err := mysql.OpenDB(dsn)
	if err != nil {
		tb.Fatal(err)
	}
	defer db.Close()
	ctx := context.Background()
	if _, err := mysql.Migrate(ctx, db); err != nil {
		tb.Fatal(err)
	}
	s := mysql.New(db)
	for name, step := range tags {
		if err := s.CreateTag(ctx, tagmodel.Tag{Name: name, Step: step, MaxID: 1}); err != nil {
			tb.Fatal(err)
		}
	}
	return dsn
}

// startWorker starts a worker on ns with the MySQL store at dsn; it is
// closed in Cleanup (closing it earlier is fine).
func startWorker(tb testing.TB, ns *server.Server, dsn string, noWitness bool) *worker.Worker {
	tb.Helper()
	w, err := worker.New(context.Background(), worker.Config{
		NATS:        worker.NATS{URL: ns.ClientURL()},
		Store:       mysqlstore.MySQL{DSN: dsn, NoWitness: noWitness},
		NoSnowflake: true,
		Logger:      slog.New(slog.DiscardHandler),
	})
	if err != nil {
		tb.Fatalf("worker.New: %v", err)
	}
	tb.Cleanup(func() { w.Close() })
	return w
}

// newClient returns a client on ns.
func newClient(tb testing.TB, ns *server.Server) *client.Client {
	tb.Helper()
	c, err := client.New(testenv.Connect(tb, ns), client.WithTimeout(10*time.Second))
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(c.Close)
	return c
}

// ids collects IDs per tag and reports any handed out twice.
type ids struct {
	mu   sync.Mutex // protects seen and dups
	seen map[string]map[int64]string
	dups []string
}

func (s *ids) add(tag string, who string, id ...int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.seen == nil {
		s.seen = map[string]map[int64]string{}
	}
	m := s.seen[tag]
	if m == nil {
		m = map[int64]string{}
		s.seen[tag] = m
	}
	for _, v := range id {
		if first, ok := m[v]; ok {
			s.dups = append(s.dups, fmt.Sprintf("%s ID %d to %s and to %s", tag, v, first, who))
			continue
		}
		m[v] = who
	}
}

func (s *ids) check(tb testing.TB) {
	tb.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	for i, d := range s.dups {
		if i == 10 {
			tb.Errorf("and %d more duplicates", len(s.dups)-i)
			break
		}
		tb.Errorf("duplicate: %s", d)
	}
}

// TestWorkersShareTableWithLeaf: two dispenser workers (worker.New with
// the MySQL store behind the witness, one of them restarted midway, which
// gives its unissued IDs back) serve clients while Leaf servers
// (goroutines running Leaf's own statements) take segments of the same
// tags of the same table. Every ID is collected: none twice.
func TestWorkersShareTableWithLeaf(t *testing.T) {
	ns := testenv.NATS(t)
	tags := []string{"orders", "users"}
	dsn := newDB(t, map[string]int64{"orders": 20, "users": 30})
	leafDB, err := sql.Open("mysql", dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { leafDB.Close() })
	startWorker(t, ns, dsn, false)
	second := startWorker(t, ns, dsn, false)

	var got ids
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var wg sync.WaitGroup
	errs := make(chan error, 16)
	stop := make(chan struct{})
	for l := range 2 {
		wg.Go(func() {
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				tag := tags[(l+i)%len(tags)]
				custom := int64(0)
				if i%2 == 1 {
					custom = int64(5 + i%40)
				}
				start, end, err := leafsql.Fetch(ctx, leafDB, tag, custom)
				if err != nil {
					errs <- err
					return
				}
				var seg []int64
				for id := start; id < end; id++ {
					seg = append(seg, id)
				}
				got.add(tag, fmt.Sprintf("leaf%d fetch %d", l, i), seg...)
			}
		})
	}
	var clients sync.WaitGroup
	for c := range 3 {
		cl := newClient(t, ns)
		clients.Go(func() {
			for i := range 150 {
				tag := tags[(c+i)%len(tags)]
				got1, err := cl.SegmentN(ctx, tag, 1+(c*11+i)%25)
				if err != nil {
					errs <- fmt.Errorf("client %d: SegmentN(%s): %w", c, tag, err)
					return
				}
				got.add(tag, fmt.Sprintf("client%d request %d", c, i), got1...)
				if c == 0 && i == 60 {
					second.Close() // gives back its unissued IDs while Leaf fetches
					startWorker(t, ns, dsn, false)
				}
			}
		})
	}
	clients.Wait()
	close(stop)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	got.check(t)
	for _, tag := range tags {
		leaf, disp := 0, 0
		for _, who := range got.seen[tag] {
			if who[0] == 'l' {
				leaf++
			} else {
				disp++
			}
		}
		t.Logf("%s: %d IDs to Leaf, %d to dispenser's clients", tag, leaf, disp)
		if leaf == 0 || disp == 0 {
			t.Errorf("%s: %d IDs to Leaf, %d to dispenser's clients: want both", tag, leaf, disp)
		}
	}
}

// TestWitnessCatchesLoweredMaxID: max_id lowered behind the workers' back
// (a restored backup, a failover to a replica that missed writes) does not
// make a worker hand out IDs again: the witness remembers what was served
// and the next fetch starts above it, as with PostgreSQL.
func TestWitnessCatchesLoweredMaxID(t *testing.T) {
	ns := testenv.NATS(t)
	dsn := newDB(t, map[string]int64{"orders": 10})
	var got ids
	w := startWorker(t, ns, dsn, false)
	cl := newClient(t, ns)
	ctx := context.Background()
	first, err := cl.SegmentN(ctx, "orders", 25)
	if err != nil {
		t.Fatal(err)
	}
	got.add("orders", "before", first...)
	w.Close()
	db, err := mysql.OpenDB(dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	if _, err := db.ExecContext(ctx, "UPDATE leaf_alloc SET max_id = 1 WHERE biz_tag = 'orders'"); err != nil {
		t.Fatal(err)
	}
	startWorker(t, ns, dsn, false)
	after, err := cl.SegmentN(ctx, "orders", 25)
	if err != nil {
		t.Fatal(err)
	}
	got.add("orders", "after max_id was lowered", after...)
	got.check(t)
}

// TestMissingTablesRefused: a worker refuses a database without the
// tables, naming what to run, and creates them with Migrate.
func TestMissingTablesRefused(t *testing.T) {
	ns := testenv.NATS(t)
	dsn := testenv.MySQL(t)
	_, err := worker.New(context.Background(), worker.Config{
		NATS:        worker.NATS{URL: ns.ClientURL()},
		Store:       mysqlstore.MySQL{DSN: dsn},
		NoSnowflake: true,
		Logger:      slog.New(slog.DiscardHandler),
	})
	if err == nil || !errorContains(err, "dispenser migrate --mysql-url") {
		t.Fatalf("worker.New on an empty database: %v, want a refusal naming dispenser migrate --mysql-url", err)
	}
	w, err := worker.New(context.Background(), worker.Config{
		NATS:        worker.NATS{URL: ns.ClientURL()},
		Store:       mysqlstore.MySQL{DSN: dsn, Migrate: true},
		NoSnowflake: true,
		Logger:      slog.New(slog.DiscardHandler),
	})
	if err != nil {
		t.Fatalf("worker.New with Migrate: %v", err)
	}
	w.Close()
}

// TestValidate: bad settings are refused before anything starts.
func TestValidate(t *testing.T) {
	tests := []struct {
		name string
		m    mysqlstore.MySQL
		want error
	}{
		{name: "no DSN", m: mysqlstore.MySQL{}, want: mysqlstore.ErrNoDSN},
		{name: "a PostgreSQL URL", m: mysqlstore.MySQL{DSN: "postgres://u@h/db"}, want: worker.ErrConfig},
		{name: "no database", m: mysqlstore.MySQL{DSN: "u@tcp(127.0.0.1:3306)/"}, want: worker.ErrConfig},
		{name: "witness replicas", m: mysqlstore.MySQL{DSN: "u@tcp(127.0.0.1:3306)/db", WitnessReplicas: 6}, want: worker.ErrConfig},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if err := tt.m.Validate(); !errors.Is(err, tt.want) {
				t.Errorf("Validate() = %v, want %v", err, tt.want)
			}
		})
	}
	if err := (mysqlstore.MySQL{DSN: "u:p@tcp(127.0.0.1:3306)/db"}).Validate(); err != nil {
		t.Errorf("Validate() of a good DSN = %v, want nil", err)
	}
	if got, want := mysqlstore.Name("u:secret@tcp(db.example:3306)/leaf"), "mysql:tcp(db.example:3306)/leaf"; got != want {
		t.Errorf("Name = %q, want %q (without the password)", got, want)
	}
}

func errorContains(err error, s string) bool {
	return err != nil && strings.Contains(err.Error(), s)
}
