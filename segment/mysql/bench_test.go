package mysql_test

import (
	"database/sql"
	"testing"
	"time"

	"github.com/dispenser-dev/dispenser/internal/leafsql"
	"github.com/dispenser-dev/dispenser/segment/mysql"
	"github.com/dispenser-dev/dispenser/tagmodel"
)

// BenchmarkFetch measures a dispenser fetch against Leaf's own (its two
// statements in one transaction, the baseline) on the same server in the
// same run, one after the other on one connection each, and reports the
// ratio: what dispenser's version bump and exact-name check cost a fetch.
// Fetches are off the request path (segments are refilled in the
// background), so this bounds how often a store can be asked, not a
// request's latency.
func BenchmarkFetch(b *testing.B) {
	dsn := newDB(b)
	leafDB, err := sql.Open("mysql", dsn)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { leafDB.Close() })
	leafDB.SetMaxOpenConns(1)
	db := openDB(b, dsn)
	db.SetMaxOpenConns(1)
	s := mysql.New(db)
	for _, tag := range []string{"leaf", "dispenser"} {
		if err := s.CreateTag(ctx, tagmodel.Tag{Name: tag, Step: 1000, MaxID: 1}); err != nil {
			b.Fatal(err)
		}
	}
	var leafTime, dispTime time.Duration
	b.ResetTimer()
	for range b.N {
		t0 := time.Now()
		if _, _, err := leafsql.Fetch(ctx, leafDB, "leaf", 0); err != nil {
			b.Fatal(err)
		}
		t1 := time.Now()
		if _, err := s.Fetch(ctx, "dispenser", 0); err != nil {
			b.Fatal(err)
		}
		leafTime, dispTime = leafTime+t1.Sub(t0), dispTime+time.Since(t1)
	}
	b.ReportMetric(float64(leafTime.Microseconds())/float64(b.N), "leaf-µs/fetch")
	b.ReportMetric(float64(dispTime.Microseconds())/float64(b.N), "dispenser-µs/fetch")
	b.ReportMetric(float64(dispTime)/float64(leafTime), "dispenser/leaf")
}
