package kvbucket_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/dispenser-dev/dispenser/internal/kvbucket"
	"github.com/dispenser-dev/dispenser/internal/tests/faultnet"
	"github.com/dispenser-dev/dispenser/internal/tests/wait"
	"github.com/dispenser-dev/dispenser/testenv"
)

// waiting is what WaitReady logs before each wait.
const waiting = "JetStream not ready; waiting"

// result is what a start-up step returned.
type result struct{ err error }

// waitForRetry waits until logs holds a line of waiting that contains
// want, and fails if the step returns (on done) first.
func waitForRetry(tb testing.TB, logs *testenv.LogBuffer, done <-chan result, want string) {
	tb.Helper()
	wait.For(tb, 60*time.Second, "a logged wait for "+want, func() bool {
		select {
		case r := <-done:
			tb.Fatalf("returned before waiting for JetStream: %v", r.err)
		default:
		}
		for line := range strings.Lines(logs.String()) {
			if strings.Contains(line, waiting) && strings.Contains(line, want) {
				return true
			}
		}
		return false
	})
}

// finish waits for the step's result; a deadline only bounds a hang.
func finish(tb testing.TB, done <-chan result) error {
	tb.Helper()
	select {
	case r := <-done:
		return r.err
	case <-time.After(2 * kvbucket.StartWait):
		tb.Fatal("the step did not return")
		return nil
	}
}

// TestOpenWaitsForPlacement opens (creates) a bucket with 3 replicas in a
// 3-node cluster whose servers restarted without one, so that JetStream
// cannot place it ("no suitable peers for placement, miscellaneous issue":
// the meta leader has not heard of n2 since its start; a worker starting
// right after its cluster met "..., peer offline"): Open logs that it
// waits, and once the server is back it creates the bucket.
func TestOpenWaitsForPlacement(t *testing.T) {
	t.Parallel() // waits out JetStream request timeouts, on servers of its own
	c := faultnet.NewCluster(t, 3, faultnet.ClusterOptions{})
	// A stopped server stays selectable for placement until the meta
	// leader restarts: only a server it has never heard from since its
	// own start is "offline". So the whole cluster restarts without n2.
	for _, i := range []int{2, 0, 1} {
		c.Stop(i, false)
	}
	c.Start(t, 0, 1)
	nc := testenv.Connect(t, c.Servers[0])
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	logs := &testenv.LogBuffer{}
	done := make(chan result, 1)
	go func() {
		_, err := kvbucket.Open(context.Background(), js, jetstream.KeyValueConfig{Bucket: "placed", History: 1, Replicas: 3}, logs.Logger())
		done <- result{err}
	}()
	waitForRetry(t, logs, done, "no suitable peers for placement")
	c.Start(t, 2)
	if err := finish(t, done); err != nil {
		t.Fatalf("Open after the server came back: %v\nlog:\n%s", err, logs)
	}
	kv, err := js.KeyValue(context.Background(), "placed")
	if err != nil {
		t.Fatal(err)
	}
	info, err := kvbucket.StreamInfo(context.Background(), kv)
	if err != nil {
		t.Fatal(err)
	}
	if info.Config.Replicas != 3 {
		t.Fatalf("replicas = %d, want 3", info.Config.Replicas)
	}
}

// alone creates an R1 bucket in c, stops the servers other than the one
// holding it, so that JetStream has no meta leader while the bucket's own
// server still answers for it, and returns a connection to that server.
// Reading the stream works then; creating a consumer (a watch, a history
// read) does not.
func alone(t *testing.T, c *faultnet.Cluster, bucket string) (js jetstream.JetStream, others []int) {
	t.Helper()
	js0, err := jetstream.New(testenv.Connect(t, c.Servers[0]))
	if err != nil {
		t.Fatal(err)
	}
	// Open, not testenv.CreateKeyValue: right after the cluster formed, a
	// create may get no reply under load; Open waits for it.
	if _, err := kvbucket.Open(context.Background(), js0, jetstream.KeyValueConfig{Bucket: bucket, History: 1}, nil); err != nil {
		t.Fatal(err)
	}
	leader := -1
	wait.For(t, 30*time.Second, "a leader of the bucket's stream", func() bool {
		leader = c.StreamLeader("KV_" + bucket)
		return leader >= 0
	})
	for i := range c.Servers {
		if i != leader {
			others = append(others, i)
			c.Stop(i, false)
		}
	}
	js, err = jetstream.New(testenv.Connect(t, c.Servers[leader]))
	if err != nil {
		t.Fatal(err)
	}
	return js, others
}

// TestOpenGuardedWaitsForMetaLeader opens a guarded bucket that has no
// proof record yet while JetStream has no meta leader: reading the record
// needs a consumer, which cannot be created then. OpenGuarded logs that it
// waits, and once the servers are back it stores the record.
func TestOpenGuardedWaitsForMetaLeader(t *testing.T) {
	t.Parallel() // waits out JetStream request timeouts, on servers of its own
	c := faultnet.NewCluster(t, 3, faultnet.ClusterOptions{})
	js, others := alone(t, c, "guarded")
	logs := &testenv.LogBuffer{}
	done := make(chan result, 1)
	go func() {
		_, _, err := kvbucket.OpenGuarded(context.Background(), js, jetstream.KeyValueConfig{Bucket: "guarded", History: 1}, "test values", logs.Logger())
		done <- result{err}
	}()
	waitForRetry(t, logs, done, `bucket \"guarded\": check`)
	c.Start(t, others...)
	if err := finish(t, done); err != nil {
		t.Fatalf("OpenGuarded after the servers came back: %v\nlog:\n%s", err, logs)
	}
	kv, err := js.KeyValue(context.Background(), "guarded")
	if err != nil {
		t.Fatal(err)
	}
	if e, err := kvbucket.Latest(context.Background(), kv, kvbucket.ProofKey); err != nil || e == nil {
		t.Fatalf("proof record = %v, %v; want one", e, err)
	}
}

// TestWaitReadyGivesUp: a JetStream that stays unready ends the wait when
// the context ends, with ErrNotReady and the last error, saying what was
// waited for.
func TestWaitReadyGivesUp(t *testing.T) {
	t.Parallel() // waits out JetStream request timeouts, on servers of its own
	c := faultnet.NewCluster(t, 3, faultnet.ClusterOptions{})
	js, _ := alone(t, c, "unready")
	kv, err := js.KeyValue(context.Background(), "unready")
	if err != nil {
		t.Fatal(err)
	}
	logs := &testenv.LogBuffer{}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan result, 1)
	go func() {
		done <- result{kvbucket.WaitReady(ctx, js.Conn(), logs.Logger(), "the test's watch", func() error {
			w, err := kv.WatchAll(context.Background())
			if err == nil {
				w.Stop()
			}
			return err
		})}
	}()
	waitForRetry(t, logs, done, "the test's watch")
	cancel()
	err = finish(t, done)
	if !errors.Is(err, kvbucket.ErrNotReady) || !kvbucket.Transient(nil, err) {
		t.Fatalf("WaitReady = %v, want ErrNotReady and the last, transient, error", err)
	}
	if !strings.Contains(err.Error(), "the end of the start's context") {
		t.Fatalf("WaitReady = %v, want it to say why it stopped waiting", err)
	}
}

// TestOpenFailsAtOnce: errors that waiting cannot cure fail Open at its
// first attempt, without a logged wait.
func TestOpenFailsAtOnce(t *testing.T) {
	t.Parallel() // waits out JetStream request timeouts, on servers of its own
	ttlJS := newJetStream(t)
	testenv.CreateKeyValue(t, ttlJS, jetstream.KeyValueConfig{Bucket: "ttl", History: 1, TTL: time.Hour})

	denied := testenv.NATSOptions(t.TempDir())
	denied.Users = []*server.User{{Username: "u", Password: "p", Permissions: &server.Permissions{
		Publish: &server.SubjectPermission{Allow: []string{">"}, Deny: []string{"$JS.API.>"}},
	}}}
	deniedSrv := testenv.StartNATS(t, denied)
	t.Cleanup(deniedSrv.Shutdown)
	deniedJS, err := jetstream.New(testenv.Connect(t, deniedSrv, nats.UserInfo("u", "p")))
	if err != nil {
		t.Fatal(err)
	}

	plain := testenv.NATSOptions(t.TempDir())
	plain.JetStream = false
	plainSrv := testenv.StartNATS(t, plain)
	t.Cleanup(plainSrv.Shutdown)
	plainJS, err := jetstream.New(testenv.Connect(t, plainSrv))
	if err != nil {
		t.Fatal(err)
	}

	tests := []struct {
		name   string
		js     jetstream.JetStream
		bucket string
		want   error
	}{
		{name: "bucket that expires values", js: ttlJS, bucket: "ttl", want: kvbucket.ErrTTL},
		{name: "permissions violation", js: deniedJS, bucket: "denied", want: nats.ErrPermissionViolation},
		{name: "JetStream not enabled", js: plainJS, bucket: "plain", want: nats.ErrNoResponders},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			logs := &testenv.LogBuffer{}
			_, err := kvbucket.Open(context.Background(), tt.js, jetstream.KeyValueConfig{Bucket: tt.bucket, History: 1}, logs.Logger())
			if !errors.Is(err, tt.want) {
				t.Fatalf("Open = %v, want %v", err, tt.want)
			}
			if strings.Contains(logs.String(), waiting) {
				t.Fatalf("Open waited for JetStream:\n%s", logs)
			}
		})
	}
}

// TestTransient: which errors WaitReady waits out.
func TestTransient(t *testing.T) {
	apiErr := func(code jetstream.ErrorCode, desc string) error {
		return &jetstream.APIError{Code: 400, ErrorCode: code, Description: desc}
	}
	tests := []struct {
		name string
		err  error
		want bool
	}{
		{name: "placement, peer offline", err: apiErr(10005, "no suitable peers for placement, peer offline"), want: true},
		{name: "placement, peer not known yet", err: apiErr(10005, "no suitable peers for placement, miscellaneous issue"), want: true},
		{name: "placement, storage", err: apiErr(10005, "no suitable peers for placement, insufficient storage"), want: false},
		{name: "placement, tags", err: apiErr(10005, "no suitable peers for placement, tags not matched ['x']"), want: false},
		{name: "placement, no such cluster", err: apiErr(10005, "no suitable peers for placement"), want: false},
		{name: "temporarily unavailable", err: apiErr(10008, "JetStream system temporarily unavailable"), want: true},
		{name: "cannot handle request", err: apiErr(10009, "JetStream cluster can not handle request"), want: true},
		{name: "older API's temporarily unavailable", err: &nats.APIError{Code: 503, ErrorCode: 10008, Description: "JetStream system temporarily unavailable"}, want: true},
		{name: "older API's JetStream not enabled", err: nats.ErrJetStreamNotEnabled, want: false},
		{name: "wrapped", err: fmt.Errorf("open: %w", apiErr(10008, "JetStream system temporarily unavailable")), want: true},
		{name: "timeout", err: context.DeadlineExceeded, want: true},
		{name: "nats timeout", err: nats.ErrTimeout, want: true},
		{name: "no responders", err: nats.ErrNoResponders, want: true},
		{name: "JetStream not enabled", err: jetstream.ErrJetStreamNotEnabled, want: false},
		{name: "JetStream not enabled for the account", err: jetstream.ErrJetStreamNotEnabledForAccount, want: false},
		{name: "bucket check", err: fmt.Errorf("%w: bucket has a TTL", kvbucket.ErrTTL), want: false},
		{name: "stream name in use", err: jetstream.ErrStreamNameAlreadyInUse, want: false},
		{name: "canceled", err: context.Canceled, want: false},
		{name: "nil", err: nil, want: false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := kvbucket.Transient(nil, tt.err); got != tt.want {
				t.Fatalf("Transient(%v) = %v, want %v", tt.err, got, tt.want)
			}
		})
	}
}
