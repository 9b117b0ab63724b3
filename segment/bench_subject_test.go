package segment

import (
	"context"
	"github.com/dispenser-dev/dispenser/tagmodel"
	"strings"
	"testing"
)

// BenchmarkTakeOneSubject is BenchmarkTakeOne with the tag cut from a
// request subject, as the NATS handler has it: a string of its own, not
// the map key.
func BenchmarkTakeOneSubject(b *testing.B) {
	st := newMemStore(b, tagmodel.Tag{Name: "orders", MaxID: 1, Step: 1_000_000})
	a := newAllocator(b, Settings{Store: st})
	take(b, a, "orders", 1)
	subject := strings.Clone("id.segment.orders")
	tag := subject[len("id.segment."):]
	ctx := context.Background()
	var runs [2]Run
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		if _, err := a.Take(ctx, tag, 1, runs[:0]); err != nil {
			b.Fatal(err)
		}
	}
}
