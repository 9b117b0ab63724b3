package witness_test

import (
	"context"
	"testing"
	"time"

	"github.com/dispenser-dev/dispenser/segment/witness"
	"github.com/dispenser-dev/dispenser/tagmodel"
)

// TestLostPeriodWritesAreCaught: a period's row (tag=KEY) that loses
// writes, lowered or lost altogether and created again from the tag's
// start, is caught as a tag's row is: its mark is kept under its period
// name, and no segment is served twice.
func TestLostPeriodWritesAreCaught(t *testing.T) {
	tests := []struct {
		name        string
		witness     bool
		lose        string // SQL on the period's row ($1)
		wantOverlap bool
	}{
		{name: "row lowered, without the witness", lose: "UPDATE leaf_alloc SET max_id = 11 WHERE biz_tag = $1", wantOverlap: true},
		{name: "row lowered, with the witness", witness: true, lose: "UPDATE leaf_alloc SET max_id = 11 WHERE biz_tag = $1"},
		{name: "row lost, without the witness", lose: "DELETE FROM leaf_alloc WHERE biz_tag = $1", wantOverlap: true},
		{name: "row lost, with the witness", witness: true, lose: "DELETE FROM leaf_alloc WHERE biz_tag = $1"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := newEnv(t)
			if err := e.pg.CreateTag(context.Background(), tagmodel.Tag{Name: "daily", Step: 10, MaxID: 1, Reset: tagmodel.ResetDay}); err != nil {
				t.Fatal(err)
			}
			period := tagmodel.PeriodName("daily", tagmodel.ResetDay.PeriodAt(time.Now(), time.UTC).Key)
			var store tagmodel.Store = e.pg
			var w *witness.Store
			if tt.witness {
				w = e.open(t, witness.Settings{})
				store = w
			}
			var served []tagmodel.Allocation
			for range 3 {
				served = append(served, fetch(t, store, period))
			}
			if _, err := e.pool.Exec(context.Background(), tt.lose, period); err != nil {
				t.Fatal(err)
			}
			next := fetch(t, store, period)
			overlap := false
			for _, s := range served {
				overlap = overlap || overlaps(s, next)
			}
			if overlap != tt.wantOverlap {
				t.Fatalf("segment %+v after %+v: overlap %v, want %v", next, served, overlap, tt.wantOverlap)
			}
			if w == nil {
				return
			}
			if next.Start != 31 {
				t.Errorf("next segment starts at %d, want 31 (the mark)", next.Start)
			}
			if w.Rollbacks() != 1 {
				t.Errorf("Rollbacks() = %d, want 1", w.Rollbacks())
			}
			if m, ok, err := w.Mark(context.Background(), period); err != nil || !ok || m != next.End {
				t.Errorf("Mark(%s) = %d, %v, %v, want %d", period, m, ok, err, next.End)
			}
		})
	}
}

// TestPrunePeriodsPassesThrough: the allocator finds PrunePeriods on the
// witness, which prunes the inner store's periods.
func TestPrunePeriodsPassesThrough(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	var w tagmodel.Store = e.open(t, witness.Settings{})
	pruner, ok := w.(tagmodel.PeriodPruner)
	if !ok {
		t.Fatalf("%T is not a tagmodel.PeriodPruner", w)
	}
	if err := e.pg.CreateTag(ctx, tagmodel.Tag{Name: "daily", Step: 10, MaxID: 1, Reset: tagmodel.ResetDay, RetentionDays: tagmodel.MaxRetentionDays}); err != nil {
		t.Fatal(err)
	}
	fetch(t, w, "daily=20200101")
	days := 7
	if err := e.pg.UpdateTag(ctx, "daily", tagmodel.Update{RetentionDays: &days}); err != nil {
		t.Fatal(err)
	}
	if n, err := pruner.PrunePeriods(ctx); err != nil || n != 1 {
		t.Errorf("PrunePeriods() = %d, %v, want 1", n, err)
	}
}
