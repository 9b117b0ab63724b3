package kv_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/dispenser-dev/dispenser/segment/kv"
	"github.com/dispenser-dev/dispenser/segment/storetest"
	"github.com/dispenser-dev/dispenser/tagmodel"
	"github.com/dispenser-dev/dispenser/testenv"
)

var ctx = context.Background()

// newJS connects to srv and returns a JetStream context; the connection is
// closed in Cleanup.
func newJS(tb testing.TB, srv *server.Server) jetstream.JetStream {
	tb.Helper()
	js, err := jetstream.New(testenv.Connect(tb, srv))
	if err != nil {
		tb.Fatalf("jetstream.New: %v", err)
	}
	return js
}

// newStore opens a Store with settings s on srv over a connection of its own.
func newStore(tb testing.TB, srv *server.Server, s kv.Settings) *kv.Store {
	tb.Helper()
	st, err := kv.New(ctx, newJS(tb, srv), s)
	if err != nil {
		tb.Fatalf("kv.New(%+v): %v", s, err)
	}
	return st
}

// bucket returns the KeyValue of the bucket named name on srv.
func bucket(tb testing.TB, srv *server.Server, name string) jetstream.KeyValue {
	tb.Helper()
	b, err := newJS(tb, srv).KeyValue(ctx, name)
	if err != nil {
		tb.Fatalf("KeyValue(%q): %v", name, err)
	}
	return b
}

// put writes a raw value into the default bucket.
func put(tb testing.TB, b jetstream.KeyValue, key, value string) {
	tb.Helper()
	if _, err := b.PutString(ctx, key, value); err != nil {
		tb.Fatalf("Put(%q): %v", key, err)
	}
}

// rawValue returns the current value of key.
func rawValue(tb testing.TB, b jetstream.KeyValue, key string) string {
	tb.Helper()
	e, err := b.Get(ctx, key)
	if err != nil {
		tb.Fatalf("Get(%q): %v", key, err)
	}
	return string(e.Value())
}

// legacy adds the PutLegacyTag that the conformance suite needs.
type legacy struct {
	*kv.Store
	b jetstream.KeyValue
}

// PutLegacyTag creates the key with a value as dispenser wrote it before
// ordered tags: no "ordered" field.
func (s legacy) PutLegacyTag(ctx context.Context, name string, maxID, step int64) error {
	v := fmt.Sprintf(`{"max_id":%d,"step":%d,"description":"","update_time":%q}`, maxID, step, time.Now().UTC().Format(time.RFC3339Nano))
	_, err := s.b.Create(ctx, name, []byte(v))
	return err
}

func TestConformance(t *testing.T) {
	storetest.Run(t, storetest.Config{
		NewBackend: func(tb testing.TB) func(testing.TB) storetest.Store {
			tb.Helper()
			srv := testenv.NATS(tb)
			// Each Store has a connection of its own, as another process would.
			return func(tb testing.TB) storetest.Store {
				tb.Helper()
				return legacy{newStore(tb, srv, kv.Settings{}), bucket(tb, srv, kv.DefaultBucket)}
			}
		},
		Prefix: "kv: ",
	})
}

func TestSurvivesRestart(t *testing.T) {
	dir := t.TempDir()
	srv := testenv.StartNATS(t, testenv.NATSOptions(dir))
	s := newStore(t, srv, kv.Settings{})
	if err := s.CreateTag(ctx, tagmodel.Tag{Name: "orders", Step: 100, MaxID: 1, Description: "order numbers"}); err != nil {
		t.Fatal(err)
	}
	var last tagmodel.Allocation
	for range 3 {
		a, err := s.Fetch(ctx, "orders", 0)
		if err != nil {
			t.Fatal(err)
		}
		last = a
	}
	srv.Shutdown()
	srv.WaitForShutdown()

	// A new server on the same store directory, on another port.
	srv = testenv.StartNATS(t, testenv.NATSOptions(dir))
	t.Cleanup(func() {
		srv.Shutdown()
		srv.WaitForShutdown()
	})
	s = newStore(t, srv, kv.Settings{})
	a, err := s.Fetch(ctx, "orders", 0)
	if err != nil {
		t.Fatalf("Fetch after restart: %v", err)
	}
	if want := (tagmodel.Allocation{Start: last.End, End: last.End + 100, TagStep: 100}); a != want {
		t.Errorf("Fetch after restart = %+v, want %+v, continuing above %d", a, want, last.End)
	}
	if got, err := s.Tag(ctx, "orders"); err != nil || got.Description != "order numbers" || got.MaxID != a.End {
		t.Errorf("Tag after restart = %+v, %v, want description kept and max_id %d", got, err, a.End)
	}
}

func TestNewSettings(t *testing.T) {
	srv := testenv.NATS(t)
	tests := []struct {
		name        string
		settings    kv.Settings
		wantBucket  string
		wantStorage jetstream.StorageType
	}{
		{name: "defaults", wantBucket: kv.DefaultBucket, wantStorage: jetstream.FileStorage},
		{name: "memory", settings: kv.Settings{Bucket: "mem", Storage: jetstream.MemoryStorage, Replicas: 1}, wantBucket: "mem", wantStorage: jetstream.MemoryStorage},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			newStore(t, srv, tt.settings)
			st, err := bucket(t, srv, tt.wantBucket).Status(ctx)
			if err != nil {
				t.Fatal(err)
			}
			info := st.(*jetstream.KeyValueBucketStatus).StreamInfo()
			if info.Config.Storage != tt.wantStorage || info.Config.Replicas != 1 || st.History() != 1 || st.TTL() != 0 {
				t.Errorf("bucket %s: storage %v, replicas %d, history %d, TTL %v; want %v, 1, 1, 0",
					tt.wantBucket, info.Config.Storage, info.Config.Replicas, st.History(), st.TTL(), tt.wantStorage)
			}
		})
	}
	if _, err := kv.New(ctx, newJS(t, srv), kv.Settings{Bucket: "no.dots"}); err == nil || !strings.HasPrefix(err.Error(), "kv: ") {
		t.Errorf("New with an invalid bucket name: got error %v, want a kv: error", err)
	}
}

func TestNewKeepsExistingBucket(t *testing.T) {
	srv := testenv.NATS(t)
	js := newJS(t, srv)
	// A bucket made by somebody else, with another configuration.
	b, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: kv.DefaultBucket, History: 5, Description: "theirs"})
	if err != nil {
		t.Fatal(err)
	}
	if err := newStore(t, srv, kv.Settings{}).CreateTag(ctx, tagmodel.Tag{Name: "orders", Step: 10, MaxID: 1}); err != nil {
		t.Fatal(err)
	}
	// Another Store, asking for memory storage, must neither change the
	// bucket nor lose its data.
	s := newStore(t, srv, kv.Settings{Storage: jetstream.MemoryStorage})
	if got, err := s.Fetch(ctx, "orders", 0); err != nil || got.Start != 1 {
		t.Errorf("Fetch on the existing bucket = %+v, %v, want start 1", got, err)
	}
	st, err := b.Status(ctx)
	if err != nil {
		t.Fatal(err)
	}
	info := st.(*jetstream.KeyValueBucketStatus).StreamInfo()
	if st.History() != 5 || info.Config.Description != "theirs" || info.Config.Storage != jetstream.FileStorage {
		t.Errorf("existing bucket after New: history %d, description %q, storage %v; want 5, theirs, file",
			st.History(), info.Config.Description, info.Config.Storage)
	}
}

// TestNewRefusesForgetfulBucket: an existing bucket that can drop a tag's
// value on its own is refused with an error saying what to change.
func TestNewRefusesForgetfulBucket(t *testing.T) {
	srv := testenv.NATS(t)
	js := newJS(t, srv)
	tests := []struct {
		name     string
		cfg      jetstream.KeyValueConfig
		discard  bool // edit the stream to discard old values at its limits
		settings kv.Settings
		wantErr  error
	}{
		{name: "TTL", cfg: jetstream.KeyValueConfig{TTL: time.Hour}, wantErr: kv.ErrBucketTTL},
		{name: "limit markers", cfg: jetstream.KeyValueConfig{LimitMarkerTTL: time.Minute}, wantErr: kv.ErrBucketTTL},
		{name: "byte limit discarding old values", cfg: jetstream.KeyValueConfig{MaxBytes: 1 << 20}, discard: true, wantErr: kv.ErrBucketLimits},
		{name: "memory, file asked for", cfg: jetstream.KeyValueConfig{Storage: jetstream.MemoryStorage}, wantErr: kv.ErrBucketMemory},
		{name: "fewer replicas than asked for", settings: kv.Settings{Replicas: 3}, wantErr: kv.ErrBucketReplicas},
		{name: "byte limit discarding new writes", cfg: jetstream.KeyValueConfig{MaxBytes: 1 << 20}},
		{name: "memory, memory asked for", cfg: jetstream.KeyValueConfig{Storage: jetstream.MemoryStorage}, settings: kv.Settings{Storage: jetstream.MemoryStorage}},
	}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tt.cfg.Bucket = fmt.Sprintf("theirs_%d", i)
			if _, err := js.CreateKeyValue(ctx, tt.cfg); err != nil {
				t.Fatal(err)
			}
			if tt.discard {
				s, err := js.Stream(ctx, "KV_"+tt.cfg.Bucket)
				if err != nil {
					t.Fatal(err)
				}
				cfg := s.CachedInfo().Config
				cfg.Discard = jetstream.DiscardOld
				if _, err := js.UpdateStream(ctx, cfg); err != nil {
					t.Fatal(err)
				}
			}
			tt.settings.Bucket = tt.cfg.Bucket
			s, err := kv.New(ctx, js, tt.settings)
			if !errors.Is(err, tt.wantErr) || (err == nil) != (tt.wantErr == nil) || (s == nil) != (err != nil) {
				t.Fatalf("New = %v, %v, want error %v", s, err, tt.wantErr)
			}
			if err != nil && !strings.Contains(err.Error(), tt.cfg.Bucket) {
				t.Errorf("error %q does not name the bucket", err)
			}
		})
	}
}

func TestValueFormat(t *testing.T) {
	srv := testenv.NATS(t)
	s := newStore(t, srv, kv.Settings{})
	b := bucket(t, srv, kv.DefaultBucket)
	if err := s.CreateTag(ctx, tagmodel.Tag{Name: "orders", Step: 1000, MaxID: 1, Description: `say "hi"`}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Fetch(ctx, "orders", 0); err != nil {
		t.Fatal(err)
	}
	// "ordered" appears only while the tag is ordered, so that a plain
	// tag's value is the same as before ordered tags existed.
	plainKeys := []string{"description", "max_id", "step", "update_time"}
	orderedKeys := []string{"description", "max_id", "ordered", "step", "update_time"}
	tests := []struct {
		name     string
		update   *tagmodel.Update // applied first, if any
		wantKeys []string
	}{
		{name: "plain", wantKeys: plainKeys},
		{name: "made ordered", update: &tagmodel.Update{Ordered: ptr(true)}, wantKeys: orderedKeys},
		{name: "step changed, still ordered", update: &tagmodel.Update{Step: ptr[int64](1000)}, wantKeys: orderedKeys},
		{name: "made plain again", update: &tagmodel.Update{Ordered: ptr(false)}, wantKeys: plainKeys},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if tt.update != nil {
				if err := s.UpdateTag(ctx, "orders", *tt.update); err != nil {
					t.Fatal(err)
				}
			}
			raw := rawValue(t, b, "orders")
			var m map[string]any
			if err := json.Unmarshal([]byte(raw), &m); err != nil {
				t.Fatalf("value %s is not JSON: %v", raw, err)
			}
			keys := make([]string, 0, len(m))
			for k := range m {
				keys = append(keys, k)
			}
			slices.Sort(keys)
			if !slices.Equal(keys, tt.wantKeys) {
				t.Errorf("value %s has keys %q, want %q", raw, keys, tt.wantKeys)
			}
			if m["max_id"] != 1001.0 || m["step"] != 1000.0 || m["description"] != `say "hi"` {
				t.Errorf("value %s: want max_id 1001, step 1000, description %q", raw, `say "hi"`)
			}
			if o, ok := m["ordered"]; ok && o != true {
				t.Errorf("value %s: ordered is %v, want true or absent", raw, o)
			}
			ts, _ := m["update_time"].(string)
			if got, err := time.Parse(time.RFC3339Nano, ts); err != nil || got.IsZero() {
				t.Errorf("update_time %q is not an RFC 3339 time: %v", ts, err)
			}
		})
	}
	// A value that a Store before ordered tags wrote, and one with the
	// flag, as written by hand.
	put(t, b, "old", `{"max_id":5,"step":10,"description":"","update_time":"2025-01-02T03:04:05Z"}`)
	put(t, b, "new", `{"max_id":5,"step":10,"description":"","ordered":true,"update_time":"2025-01-02T03:04:05Z"}`)
	for name, want := range map[string]bool{"old": false, "new": true} {
		if got, err := s.Tag(ctx, name); err != nil || got.Ordered != want {
			t.Errorf("Tag(%s) = %+v, %v, want ordered %v", name, got, err, want)
		}
	}
}

func ptr[T any](v T) *T { return &v }

// Values written by something else: the store must neither crash nor
// change them, nor serve what is no tag.
func TestForeignValues(t *testing.T) {
	srv := testenv.NATS(t)
	s := newStore(t, srv, kv.Settings{})
	b := bucket(t, srv, kv.DefaultBucket)
	put(t, b, "zero", `{"max_id":100,"step":0}`)
	put(t, b, "negative", `{"max_id":100,"step":-5}`)
	put(t, b, "garbage", `not json`)
	put(t, b, "leaf.segment", `{"max_id":1,"step":10}`)
	put(t, b, "gone", `{"max_id":1,"step":10}`)
	if err := b.Delete(ctx, "gone"); err != nil {
		t.Fatal(err)
	}

	tests := []struct {
		name string
		tag  string
		step int64
		want error // nil: an error wrapping none of the sentinels
	}{
		{name: "zero stored step", tag: "zero", want: tagmodel.ErrInvalidStep},
		{name: "negative stored step", tag: "negative", want: tagmodel.ErrInvalidStep},
		{name: "deleted", tag: "gone", want: tagmodel.ErrUnknownTag},
		{name: "malformed value", tag: "garbage"},
		{name: "malformed value explicit step", tag: "garbage", step: 5},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			before := rawValueOrDeleted(t, b, tt.tag)
			a, err := s.Fetch(ctx, tt.tag, tt.step)
			if err == nil || !strings.HasPrefix(err.Error(), "kv: ") {
				t.Fatalf("Fetch(%q, %d) = %+v, %v, want a kv: error", tt.tag, tt.step, a, err)
			}
			if tt.want != nil && !errors.Is(err, tt.want) {
				t.Errorf("got error %v, want %v", err, tt.want)
			}
			if tt.want == nil && (errors.Is(err, tagmodel.ErrUnknownTag) || errors.Is(err, tagmodel.ErrInvalidStep)) {
				t.Errorf("got error %v, want one that does not claim an unknown tag or a bad step", err)
			}
			if after := rawValueOrDeleted(t, b, tt.tag); after != before {
				t.Errorf("failed Fetch changed the value from %s to %s", before, after)
			}
		})
	}

	// An explicit step still works on a tag with a bad stored step.
	if a, err := s.Fetch(ctx, "zero", 5); err != nil || a != (tagmodel.Allocation{Start: 100, End: 105, TagStep: 0}) {
		t.Errorf("Fetch(zero, 5) = %+v, %v, want [100, 105) with TagStep 0", a, err)
	}
	// Only valid, live tags are listed.
	if got, err := s.Tags(ctx); err != nil || !slices.Equal(got, []string{"garbage", "negative", "zero"}) {
		t.Errorf("Tags() = %q, %v, want [garbage negative zero]", got, err)
	}
}

// rawValueOrDeleted returns the value of key, or "<deleted>".
func rawValueOrDeleted(tb testing.TB, b jetstream.KeyValue, key string) string {
	tb.Helper()
	e, err := b.Get(ctx, key)
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return "<deleted>"
	}
	if err != nil {
		tb.Fatalf("Get(%q): %v", key, err)
	}
	return string(e.Value())
}

func TestCanceledContext(t *testing.T) {
	srv := testenv.NATS(t)
	s := newStore(t, srv, kv.Settings{})
	if err := s.CreateTag(ctx, tagmodel.Tag{Name: "orders", Step: 10, MaxID: 1}); err != nil {
		t.Fatal(err)
	}
	canceled, cancel := context.WithCancel(ctx)
	cancel()
	if _, err := s.Fetch(canceled, "orders", 0); !errors.Is(err, context.Canceled) {
		t.Errorf("Fetch with a canceled context: got error %v, want context.Canceled", err)
	}
	if _, err := s.Tags(canceled); !errors.Is(err, context.Canceled) {
		t.Errorf("Tags with a canceled context: got error %v, want context.Canceled", err)
	}
	if got, err := s.Tag(ctx, "orders"); err != nil || got.MaxID != 1 {
		t.Errorf("Tag after canceled calls = %+v, %v, want max_id 1", got, err)
	}
}

// TestUnansweredWriteRetried: a fetch whose writes get no reply (a leader
// election) is tried again on a fresh read and completes once a write is
// answered; a write that landed unanswered is skipped as a gap, never
// handed out. Before, the fetch failed at its first unanswered write.
func TestUnansweredWriteRetried(t *testing.T) {
	for _, land := range []bool{false, true} {
		t.Run(fmt.Sprintf("landed=%v", land), func(t *testing.T) {
			st, err := kv.New(ctx, newJS(t, testenv.NATS(t)), kv.Settings{})
			if err != nil {
				t.Fatal(err)
			}
			if err := st.CreateTag(ctx, tagmodel.Tag{Name: "t", Step: 10, MaxID: 1}); err != nil {
				t.Fatal(err)
			}
			lossy := &testenv.UnansweredKV{}
			kv.WrapKeyValue(st, func(k jetstream.KeyValue) jetstream.KeyValue { lossy.KeyValue = k; return lossy })
			first, err := st.Fetch(ctx, "t", 0)
			if err != nil {
				t.Fatal(err)
			}
			lossy.Drop("", 2, land)
			fctx, cancel := context.WithTimeout(ctx, 10*time.Second)
			defer cancel()
			a, err := st.Fetch(fctx, "t", 0)
			if err != nil {
				t.Fatalf("Fetch with two unanswered writes: %v", err)
			}
			want := first.End
			if land {
				want += 20 // the two landed writes are gaps
			}
			if a.Start != want {
				t.Errorf("segment %d..%d after %d..%d: want it to start at %d", a.Start, a.End, first.Start, first.End, want)
			}
		})
	}
}

// laggingKV answers every Get "not found", as a replica that is behind
// (after a partition, or catching up) may answer a direct get.
type laggingKV struct{ jetstream.KeyValue }

func (laggingKV) Get(context.Context, string) (jetstream.KeyValueEntry, error) {
	return nil, jetstream.ErrKeyNotFound
}

// TestLaggingReplicaIsNotUnknownTag: a "not found" from a replica that is
// behind does not make a tag unknown (404): the stream leader is asked.
// Before, the lookup and the fetch failed with tagmodel.ErrUnknownTag.
func TestLaggingReplicaIsNotUnknownTag(t *testing.T) {
	st, err := kv.New(ctx, newJS(t, testenv.NATS(t)), kv.Settings{})
	if err != nil {
		t.Fatal(err)
	}
	if err := st.CreateTag(ctx, tagmodel.Tag{Name: "t", Step: 10, MaxID: 1}); err != nil {
		t.Fatal(err)
	}
	kv.WrapKeyValue(st, func(k jetstream.KeyValue) jetstream.KeyValue { return laggingKV{k} })
	if tag, err := st.Tag(ctx, "t"); err != nil || tag.MaxID != 1 {
		t.Fatalf("Tag with a lagging replica: %+v, %v; want max_id 1", tag, err)
	}
	if a, err := st.Fetch(ctx, "t", 0); err != nil || a.Start != 1 {
		t.Fatalf("Fetch with a lagging replica: %+v, %v; want 1..10", a, err)
	}
	if _, err := st.Tag(ctx, "missing"); !errors.Is(err, tagmodel.ErrUnknownTag) {
		t.Fatalf("Tag(missing) = %v, want %v", err, tagmodel.ErrUnknownTag)
	}
}
