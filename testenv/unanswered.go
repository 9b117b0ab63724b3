package testenv

import (
	"context"
	"sync"

	"github.com/nats-io/nats.go/jetstream"
)

// UnansweredKV passes every call to the bucket it wraps but makes the next
// Updates it is told to (Drop) get no reply: they wait until their context
// ends, as a request sent to a JetStream stream leader that is gone while
// a new one is elected. A landed drop is applied all the same (its reply
// is what is lost); another is not applied at all.
type UnansweredKV struct {
	jetstream.KeyValue
	mu    sync.Mutex // protects the fields below
	key   string     // only Updates of this key drop; "": any
	drops int
	land  bool
}

// Drop makes the next n Updates of key ("": of any key) go unanswered,
// applied (land) or not.
func (k *UnansweredKV) Drop(key string, n int, land bool) {
	k.mu.Lock()
	k.key, k.drops, k.land = key, n, land
	k.mu.Unlock()
}

// Update implements jetstream.KeyValue.
func (k *UnansweredKV) Update(ctx context.Context, key string, value []byte, last uint64) (uint64, error) {
	k.mu.Lock()
	drop := k.drops > 0 && (k.key == "" || k.key == key)
	if drop {
		k.drops--
	}
	land := k.land
	k.mu.Unlock()
	if !drop {
		return k.KeyValue.Update(ctx, key, value, last)
	}
	if land {
		if _, err := k.KeyValue.Update(ctx, key, value, last); err != nil {
			return 0, err
		}
	}
	<-ctx.Done()
	return 0, ctx.Err()
}
