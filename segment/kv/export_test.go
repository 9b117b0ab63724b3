package kv

import "github.com/nats-io/nats.go/jetstream"

// WrapKeyValue replaces the bucket handle s writes tags through with
// wrap(handle), for tests that make requests go unanswered.
func WrapKeyValue(s *Store, wrap func(jetstream.KeyValue) jetstream.KeyValue) { s.kv = wrap(s.kv) }
