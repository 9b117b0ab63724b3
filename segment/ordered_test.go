package segment

import (
	"context"
	"errors"
	"testing"
)

// TestOrderedTagsOnlyForTheOwner: an ordered tag is refused by Take and
// TakeNow (known or looked up), served by TakeOwned, and Reset makes the
// next TakeOwned start from a segment fetched after it.
func TestOrderedTagsOnlyForTheOwner(t *testing.T) {
	ctx := context.Background()
	st := newMemStore(t, Tag{Name: "o", MaxID: 1, Step: 10, Ordered: true}, Tag{Name: "plain", MaxID: 1, Step: 10})
	a := newAllocator(t, Settings{Store: st, MaxStep: 10})
	_, p, err := a.TakeNow("o", 1, nil)
	if err == nil && p != nil {
		_, err = p.Wait(ctx)
	}
	if !errors.Is(err, ErrOrdered) {
		t.Fatalf("TakeNow of an unknown ordered tag: %v, want ErrOrdered", err)
	}
	if _, err := a.Take(ctx, "o", 1, nil); !errors.Is(err, ErrOrdered) {
		t.Fatalf("Take of a known ordered tag: %v, want ErrOrdered", err)
	}
	if _, _, err := a.TakeNow("o", 1, nil); !errors.Is(err, ErrOrdered) {
		t.Fatalf("TakeNow of a known ordered tag: %v, want ErrOrdered", err)
	}
	if !a.Ordered("o") || a.Ordered("plain") {
		t.Fatalf("Ordered: o %v, plain %v", a.Ordered("o"), a.Ordered("plain"))
	}
	if a.Plain("o") || a.Plain("plain") || a.Plain("never-asked") {
		t.Fatalf("Plain before the plain tag's first request: o %v, plain %v, never-asked %v; want all false",
			a.Plain("o"), a.Plain("plain"), a.Plain("never-asked"))
	}
	owned := func(n int) []int64 {
		t.Helper()
		runs, p, err := a.TakeOwned("o", n, nil)
		if err == nil && p != nil {
			runs, err = p.Wait(ctx)
		}
		if err != nil {
			t.Fatalf("TakeOwned: %v", err)
		}
		return expand(runs)
	}
	if got := owned(3); got[0] != 1 || got[2] != 3 {
		t.Fatalf("TakeOwned: %v, want 1..3", got)
	}
	// Another owner meanwhile took segments; this worker owns the tag
	// again and resets it: it must not serve 4..10 any more.
	st.Fetch(ctx, "o", 0)
	a.Reset("o")
	if got := owned(2); got[0] <= 10 {
		t.Fatalf("after Reset: %v, want IDs from a segment fetched after it (above 20)", got)
	}
	if got := take(t, a, "plain", 1); got[0] != 1 {
		t.Fatalf("plain tag: %v", got)
	}
	if a.Plain("o") || !a.Plain("plain") {
		t.Fatalf("Plain: o %v, plain %v; want false, true", a.Plain("o"), a.Plain("plain"))
	}
	a.Reset("o")
	if a.Plain("o") || a.Ordered("o") {
		t.Fatalf("after Reset: Plain %v, Ordered %v; want neither known", a.Plain("o"), a.Ordered("o"))
	}
}
