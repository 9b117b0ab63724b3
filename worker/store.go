package worker

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/dispenser-dev/dispenser/segment/kv"
	"github.com/dispenser-dev/dispenser/segment/witness"
	"github.com/dispenser-dev/dispenser/tagmodel"
)

// A StoreOpener opens the segment store a worker allocates from: KV (the
// default) or pgstore.Postgres. `dispenser serve`, the admin commands and
// the bench open their stores through these two.
type StoreOpener interface {
	// Validate reports settings that cannot work. New calls it before it
	// starts anything.
	Validate() error
	// OpenStore opens the store on the worker's JetStream connection.
	OpenStore(ctx context.Context, js jetstream.JetStream, env StoreEnv) (*Store, error)
}

// StoreEnv is what a worker gives its StoreOpener.
type StoreEnv struct {
	// Logger is the worker's logger; never nil.
	Logger *slog.Logger
	// Registerer, if not nil, registers the store's metrics.
	Registerer prometheus.Registerer
	// Region is the worker's region: a store per region (and the witness
	// of any region-aware worker) uses region-local buckets, named by
	// Region.Name and created in Cluster, the cluster of the worker's
	// JetStream connection ("" without regions).
	Region  Region
	Cluster string
}

// Store is an open segment store.
type Store struct {
	// Store is what the allocator fetches from.
	tagmodel.Store
	// Admin creates and changes tags; nil if the store cannot.
	Admin tagmodel.Admin
	// Name identifies the store among the stores a queue group of workers
	// could use (dispenser.Config.Store): workers of one queue group and
	// prefix must share it.
	Name string
	// ID identifies the store's data whichever addresses reach it
	// (dispenser.Config.StoreID); empty if unknown.
	ID string
	// Close releases what OpenStore opened besides the worker's
	// connection; nil if nothing.
	Close func()
}

// KV opens the JetStream KV segment store: a tag's sequence in one key of
// a bucket, on the NATS server the worker uses.
type KV struct {
	// Bucket is the bucket's name. Default kv.DefaultBucket.
	Bucket string
	// Replicas of the bucket when it is created, and the fewest an
	// existing bucket may have. Default 1.
	Replicas int
}

// Validate implements StoreOpener.
func (k KV) Validate() error {
	if k.Replicas < 0 || k.Replicas > 5 {
		return fmt.Errorf("%w: --segment-replicas %d: want 1..5", ErrConfig, k.Replicas)
	}
	return nil
}

// OpenStore implements StoreOpener: it creates the bucket if missing.
func (k KV) OpenStore(ctx context.Context, js jetstream.JetStream, env StoreEnv) (*Store, error) {
	k.Bucket = env.Region.Name(k.Bucket, kv.DefaultBucket, env.Region.PerRegionStores())
	var cluster string
	if env.Region.PerRegionStores() {
		cluster = env.Cluster
	}
	st, err := kv.New(ctx, js, kv.Settings{Bucket: k.Bucket, Replicas: k.Replicas, Logger: env.Logger, Cluster: cluster})
	if err != nil {
		return nil, err
	}
	name, err := BucketIdentity(ctx, js, k.bucket())
	if err != nil {
		return nil, err
	}
	return &Store{Store: st, Admin: st, Name: "kv:" + name, ID: "kv:" + name}, nil
}

func (k KV) bucket() string {
	if k.Bucket == "" {
		return kv.DefaultBucket
	}
	return k.Bucket
}

// BucketIdentity names a JetStream KV bucket by its name and its stream's
// creation time, so that two buckets of one name (in two JetStream domains,
// or deleted and made again) tell apart.
func BucketIdentity(ctx context.Context, js jetstream.JetStream, bucket string) (string, error) {
	kvb, err := js.KeyValue(ctx, bucket)
	if err != nil {
		return "", fmt.Errorf("bucket %q: %w", bucket, err)
	}
	st, err := kvb.Status(ctx)
	if err != nil {
		return "", fmt.Errorf("bucket %q: status: %w", bucket, err)
	}
	if bs, ok := st.(*jetstream.KeyValueBucketStatus); ok {
		return bucket + "@" + bs.StreamInfo().Created.UTC().Format(time.RFC3339Nano), nil
	}
	return bucket, nil
}

// Witness puts the failover witness (package segment/witness) in front of
// st, a database's store whose Store is inner, as a StoreOpener of a
// database does: it registers the rollback counter, opens the witness
// bucket and adds the bucket's identity to st's Name and ID. bucket and
// replicas are the --witness-bucket and --witness-replicas flags.
//
// One store has one witness, in every mode (docs/regions.md): the witness
// keeps a rolled-back store from repeating a segment only if it saw every
// segment the store handed out. So a store per region (per-region mode)
// has the region's own bucket (`dispenser_witness_rN`, in the region's
// cluster), and a store shared by all regions (shared mode, and no
// regions) one bucket for all of them, created where the first worker
// opens it: a region that fetches from the shared store waits on that
// bucket as it waits on the store itself, across the WAN. A witness of a
// region's own in front of a shared store would let region B serve again
// what region A served before a rollback, since B's witness never saw it
// (worker/pgstore TestSharedModeRollbackCaughtInEveryRegion); the peer
// check refuses a worker whose witness is not its peers' in shared mode
// (TestSharedModeRegionWitnessRefused).
func (env StoreEnv) Witness(ctx context.Context, js jetstream.JetStream, st *Store, inner witness.Raiser, bucket string, replicas int) error {
	rollbacks := prometheus.NewCounter(prometheus.CounterOpts{
		Name: "dispenser_segment_rollbacks_total",
		Help: "Fetches that found the segment store behind the witness (lost writes: failover, restored backup, max_id lowered by hand).",
	})
	if env.Registerer != nil {
		env.Registerer.MustRegister(rollbacks)
	}
	var cluster string
	if env.Region.PerRegionStores() {
		cluster = env.Cluster
	}
	w, err := witness.Open(ctx, js, inner, witness.Settings{
		Bucket:     env.Region.Name(bucket, witness.DefaultBucket, env.Region.PerRegionStores()),
		Cluster:    cluster,
		Replicas:   replicas,
		Logger:     env.Logger,
		OnRollback: func(string, int64, int64) { rollbacks.Inc() },
	})
	if err != nil {
		return err
	}
	name, err := BucketIdentity(ctx, js, w.Bucket())
	if err != nil {
		return err
	}
	st.Store, st.Name = w, st.Name+" witness:"+name
	if st.ID != "" {
		st.ID += " witness:" + name
	}
	return nil
}
