package main

import (
	"cmp"
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/dispenser-dev/dispenser/internal/tests/check"
	"github.com/dispenser-dev/dispenser/internal/tests/wait"
	"github.com/dispenser-dev/dispenser/testenv"
)

// TestOperatorMistakes runs two workers under load and makes one mistake an
// operator could make with the buckets the service uses, while they run:
// after it, no ID was handed out twice (every ID of every reply is
// collected), and the workers said in their logs what happened. Requests
// may fail meanwhile (what can no longer be served safely must fail); they
// must never be answered with an ID already handed out.
func TestOperatorMistakes(t *testing.T) {
	t.Parallel() // one of the package's slow tests: they run beside each other
	tests := []struct {
		name  string
		store string // "kv" or "postgres"
		// mistake is made once the load runs; it gets an admin
		// connection's JetStream context.
		mistake func(t *testing.T, ctx context.Context, js jetstream.JetStream)
		// logs: one of these appears in some worker's log afterwards.
		logs []string
		// after is how many replies of each subject the load waits for
		// after the mistake; default 40 (an ordered tag whose owner key
		// is gone answers 503 after 2 s for a margin).
		after int
	}{
		{
			name: "purge the segment bucket", store: "kv",
			mistake: func(t *testing.T, ctx context.Context, js jetstream.JetStream) {
				purgeStream(t, ctx, js, "KV_dispenser_segments")
			},
			logs: []string{"purged"},
		},
		{
			name: "delete a tag's key", store: "kv",
			mistake: func(t *testing.T, ctx context.Context, js jetstream.JetStream) {
				kvOp(t, ctx, js, "dispenser_segments", "plain", jetstream.KeyValueDelete)
			},
			logs: []string{"deleted", "removed"},
		},
		{
			name: "purge the witness bucket", store: "postgres",
			mistake: func(t *testing.T, ctx context.Context, js jetstream.JetStream) {
				purgeStream(t, ctx, js, "KV_dispenser_witness")
			},
			logs: []string{"purged", "witness"},
		},
		{
			name: "delete an ordered tag's owner key", store: "kv",
			mistake: func(t *testing.T, ctx context.Context, js jetstream.JetStream) {
				kvOp(t, ctx, js, "dispenser_owners", "orders", jetstream.KeyValueDelete)
			},
			logs: []string{"deleted"}, after: 4,
		},
		{
			name: "purge the owners bucket", store: "kv",
			mistake: func(t *testing.T, ctx context.Context, js jetstream.JetStream) {
				purgeStream(t, ctx, js, "KV_dispenser_owners")
			},
			logs: []string{"lost its values"}, after: 4,
		},
		{
			name: "delete the snowflake worker keys", store: "kv",
			mistake: func(t *testing.T, ctx context.Context, js jetstream.JetStream) {
				kv, err := js.KeyValue(ctx, "dispenser_workers")
				if err != nil {
					t.Fatal(err)
				}
				keys, err := kv.ListKeys(ctx)
				if err != nil {
					t.Fatal(err)
				}
				for k := range keys.Keys() {
					if strings.HasPrefix(k, "worker.") {
						if err := kv.Delete(ctx, k); err != nil {
							t.Fatal(err)
						}
					}
				}
			},
			logs: []string{"deleted"},
		},
		{
			name: "purge the snowflake lease bucket", store: "kv",
			mistake: func(t *testing.T, ctx context.Context, js jetstream.JetStream) {
				purgeStream(t, ctx, js, "KV_dispenser_workers")
			},
			logs: []string{"purged"},
		},
		{
			name: "add a max age to the segment bucket", store: "kv",
			mistake: func(t *testing.T, ctx context.Context, js jetstream.JetStream) {
				st, err := js.Stream(ctx, "KV_dispenser_segments")
				if err != nil {
					t.Fatal(err)
				}
				cfg := st.CachedInfo().Config
				cfg.MaxAge = time.Hour
				if _, err := js.UpdateStream(ctx, cfg); err != nil {
					t.Fatal(err)
				}
			},
			logs: []string{"age", "TTL"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			ns := testenv.NATS(t)
			url := ns.ClientURL()
			storeFlags := []string{"--nats-url", url}
			if tt.store == "postgres" {
				pg := testenv.Postgres(t)
				mustRun(t, "migrate", "--postgres-url", pg)
				storeFlags = []string{"--postgres-url", pg}
			}
			mustRun(t, append([]string{"tags", "create", "plain", "--step", "20"}, storeFlags...)...)
			mustRun(t, append([]string{"tags", "create", "orders", "--step", "20", "--ordered"}, storeFlags...)...)
			args := []string{"--nats-url", url, "--auto-create-tags", "--max-step", "20", "--refresh-interval", "200ms",
				"--ordered-lease", "500ms", "--snowflake-lease", "1s", "--max-wait", "500ms"}
			if tt.store == "postgres" {
				args = append(args, storeFlags...)
			}
			logs := []*syncBuffer{startServe(t, args...), startServe(t, args...)}
			nc := testenv.Connect(t, ns)
			for _, subject := range []string{"id.segment.plain", "id.segment.orders", "id.snowflake"} {
				waitForID(t, nc, subject, logs[0])
			}
			l := startLoad(t, ns, []string{"id.segment.plain", "id.segment.orders", "id.snowflake"})
			l.waitFor(t, 200) // IDs of each subject before the mistake
			js, err := jetstream.New(nc)
			if err != nil {
				t.Fatal(err)
			}
			tt.mistake(t, ctx, js)
			l.waitFor(t, cmp.Or(tt.after, 40)) // replies (IDs or errors) after it
			// Under load until a worker has said what happened.
			var all string
			found := false
			for deadline := time.Now().Add(15 * time.Second); !found && time.Now().Before(deadline); {
				all = logs[0].String() + logs[1].String()
				for _, want := range tt.logs {
					found = found || strings.Contains(all, want)
				}
				time.Sleep(20 * time.Millisecond)
			}
			l.stop(t)
			if !found {
				t.Errorf("no worker log says what happened (want one of %q); logs:\n%s", tt.logs, all)
			}
			t.Logf("%s", l.summary())
			if t.Failed() {
				for i, lg := range logs {
					t.Logf("log of worker %d:\n%s", i, lg.String())
				}
			}
		})
	}
}

// load requests IDs of several subjects in a loop and checks every reply
// when it stops: no ID twice per subject, and for ordered tags no ID at or
// below one of a reply that completed before the request was sent.
type load struct {
	nc     *nats.Conn
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu      sync.Mutex                     // protects the fields below
	obs     map[string][]check.Observation // per subject, every reply with IDs
	replies map[string]int
	errs    map[string]map[string]int // subject: error code and description: count
}

func startLoad(t *testing.T, ns *server.Server, subjects []string) *load {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	l := &load{nc: testenv.Connect(t, ns), cancel: cancel, obs: map[string][]check.Observation{},
		replies: map[string]int{}, errs: map[string]map[string]int{}}
	for _, subject := range subjects {
		l.obs[subject] = nil
		l.errs[subject] = map[string]int{}
	}
	for _, subject := range subjects {
		for range 2 {
			l.wg.Go(func() { l.run(ctx, subject) })
		}
	}
	t.Cleanup(func() { l.cancel(); l.wg.Wait() })
	return l
}

func (l *load) run(ctx context.Context, subject string) {
	for ctx.Err() == nil {
		start := time.Now()
		ids, err := requestIDs(l.nc, subject, 3)
		end := time.Now()
		l.mu.Lock()
		l.replies[subject]++
		if err != nil {
			l.errs[subject][err.Error()]++
			l.mu.Unlock()
			time.Sleep(5 * time.Millisecond)
			continue
		}
		l.obs[subject] = append(l.obs[subject], check.Observation{Start: start, End: end, IDs: ids})
		l.mu.Unlock()
	}
}

// waitFor waits until every subject has had n more replies than now.
func (l *load) waitFor(t *testing.T, n int) {
	t.Helper()
	l.mu.Lock()
	want := map[string]int{}
	for s := range l.obs { // every subject, also one without replies yet
		want[s] = l.replies[s] + n
	}
	l.mu.Unlock()
	if err := wait.Until(time.Minute, func() error {
		l.mu.Lock()
		defer l.mu.Unlock()
		for s, w := range want {
			if l.replies[s] < w {
				return fmt.Errorf("fewer than %d replies within a minute", n)
			}
		}
		return nil
	}); err != nil {
		t.Fatalf("load: %v: %s", err, l.summary())
	}
}

// stop ends the load and fails the test on a duplicate or an order
// violation.
func (l *load) stop(t *testing.T) {
	t.Helper()
	l.cancel()
	l.wg.Wait()
	l.mu.Lock()
	defer l.mu.Unlock()
	var dups, order []string
	outOfOrder := 0
	for _, subject := range slices.Sorted(maps.Keys(l.obs)) {
		for _, d := range check.Unique(l.obs[subject]).Duplicates {
			dups = append(dups, fmt.Sprintf("%s: %d", subject, d.ID))
		}
		if !strings.HasSuffix(subject, ".orders") {
			continue
		}
		n, examples := check.Linearizable(l.obs[subject])
		outOfOrder += n
		for _, v := range examples {
			order = append(order, fmt.Sprintf("%s: %d after a reply with %d had completed", subject, v.Late.Min(), v.Early.Max()))
		}
	}
	if len(dups) > 0 {
		t.Errorf("%d IDs handed out twice, e.g. %v", len(dups), dups[:min(len(dups), 5)])
	}
	if outOfOrder > 0 {
		t.Errorf("%d ordered requests out of order, e.g. %v", outOfOrder, order[:min(len(order), 5)])
	}
}

func (l *load) summary() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var b strings.Builder
	for s, n := range l.replies {
		fmt.Fprintf(&b, "%s: %d replies, %d IDs, errors %v\n", s, n, check.Unique(l.obs[s]).Distinct, l.errs[s])
	}
	return b.String()
}

func purgeStream(t *testing.T, ctx context.Context, js jetstream.JetStream, name string) {
	t.Helper()
	st, err := js.Stream(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Purge(ctx); err != nil {
		t.Fatal(err)
	}
}

func kvOp(t *testing.T, ctx context.Context, js jetstream.JetStream, bucket, key string, op jetstream.KeyValueOp) {
	t.Helper()
	kv, err := js.KeyValue(ctx, bucket)
	if err != nil {
		t.Fatal(err)
	}
	switch op {
	case jetstream.KeyValueDelete:
		err = kv.Delete(ctx, key)
	case jetstream.KeyValuePurge:
		err = kv.Purge(ctx, key)
	}
	if err != nil {
		t.Fatal(err)
	}
}
