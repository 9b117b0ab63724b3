package bench

import (
	"bytes"
	"context"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/dispenser-dev/dispenser/segment/kv"
	"github.com/dispenser-dev/dispenser/tagmodel"
	"github.com/dispenser-dev/dispenser/testenv"
)

// TestBlockRates checks the rate by block: completion times in any order,
// each block timed from the end of the one before, a short last block.
func TestBlockRates(t *testing.T) {
	ms := func(v ...int) []time.Duration {
		var d []time.Duration
		for _, x := range v {
			d = append(d, time.Duration(x)*time.Millisecond)
		}
		return d
	}
	tests := []struct {
		done  []time.Duration
		block int
		want  []float64
	}{
		// 2 in 100ms, 2 in 400ms (from 100 to 500), 1 in 500ms.
		{ms(500, 100, 50, 300, 1000), 2, []float64{20, 5, 2}},
		{ms(10, 20), 2, []float64{100}},
		{nil, 2, nil},
		{ms(10), 0, nil},
	}
	for _, tt := range tests {
		if got := blockRates(tt.done, tt.block); !reflect.DeepEqual(got, tt.want) {
			t.Errorf("blockRates(%v, %d) = %v, want %v", tt.done, tt.block, got, tt.want)
		}
	}
}

func TestCountSamples(t *testing.T) {
	page := []byte("# HELP a A.\n# TYPE a counter\na 1\nb{tag=\"x\"} 2\ngo_memstats_heap_inuse_bytes 1.2345e+06\n\n")
	if n := countSamples(page); n != 3 {
		t.Errorf("countSamples = %d, want 3", n)
	}
	if v := sampleValue(page, "go_memstats_heap_inuse_bytes"); v != 1234500 {
		t.Errorf("heap in use = %d, want 1234500", v)
	}
	if v := sampleValue(page, "missing"); v != 0 {
		t.Errorf("missing sample = %d, want 0", v)
	}
}

// TestOrderedAndTagsReport checks the ordered run's summary, the targets of
// the ordered and tags runs, and that every run is compared with the
// baseline loaded in turn with it (the same label), not another of its
// mode.
func TestOrderedAndTagsReport(t *testing.T) {
	run := func(mode, ep, label string, rps, p50 float64) *Result {
		return &Result{Mode: mode, Endpoint: ep, Label: label,
			LoadResult: LoadResult{Subject: ep, RPS: rps, Latency: LatencyStats{P50: p50}, Inflight: 256}}
	}
	rep := &Report{Local: true, Store: "kv",
		Runs: []*Result{
			run("ordered_alone", "baseline", "1 worker", 2000, 500),
			run("ordered_alone", "ordered", "1 worker", 1600, 500),
			run("ordered_alone", "plain", "1 worker", 1800, 500),
			run("ordered", "baseline", "3 workers", 1000, 500),
			run("ordered", "ordered", "3 workers", 800, 700),
			run("ordered", "plain", "3 workers", 900, 600),
			run("tags_refresh", "baseline", "refresh, 1 in flight", 100, 100),
			run("tags_refresh", "refreshing", "refresh, 1 in flight", 50, 150),
			run("tags_refresh", "baseline", "refresh, 256 in flight", 2000, 100),
			run("tags_refresh", "refreshing", "refresh, 256 in flight", 1000, 150),
		},
		Tags: &TagsResult{Store: "kv", NewTags: 100_000, Block: 5000, LastOverFirst: 0.4, RSSPerTagBytes: 900,
			RSSWarmBytes: 150 << 20, ScrapeBytes: 2 << 20},
	}
	rep.finish()
	want := &OrderedResult{Workers: 3, Inflight: 256, VsBaseline: 0.8, PlainVsBaseline: 0.9, VsPlain: 0.889, ForwardP50US: 100,
		AloneVsBaseline: 0.8, VsAlone: 1}
	if !reflect.DeepEqual(rep.Ordered, want) {
		t.Errorf("ordered summary %+v, want %+v", rep.Ordered, want)
	}
	if r := rep.Runs[7]; r.VsBaseline != 0.5 {
		t.Errorf("refreshing at 1 in flight: %.3f× baseline, want 0.5 (its own baseline)", r.VsBaseline)
	}
	if r := rep.Runs[9]; r.VsBaseline != 0.5 {
		t.Errorf("refreshing at 256 in flight: %.3f× baseline, want 0.5 (its own baseline)", r.VsBaseline)
	}
	got := map[string]bool{}
	for _, tg := range rep.Targets {
		got[strings.SplitN(tg.Name, ",", 2)[0]+" "+tg.Want] = tg.OK
	}
	for name, ok := range map[string]bool{
		"ordered tag ≥ 0.8× baseline":                true,
		"new tags ≥ 0.5×":                            false,
		"RSS per warm tag (100000 warm) < 1 KB":      true,
		"worker with 100000 warm tags: RSS < 160 MB": true,
		"/metrics with 100000 warm tags < 1 MB":      false,
	} {
		if g, found := got[name]; !found || g != ok {
			t.Errorf("target %q: found %v, ok %v; want ok %v (targets %+v)", name, found, g, ok, rep.Targets)
		}
	}
	var b bytes.Buffer
	if err := rep.Print(&b); err != nil {
		t.Fatal(err)
	}
	for _, s := range []string{"ordered over plain 0.889×", "the owner alone 0.800× baseline, 3 workers 1.000× of that", "created on first use", "per warm tag"} {
		if !strings.Contains(b.String(), s) {
			t.Errorf("report lacks %q:\n%s", s, b.String())
		}
	}
}

// TestMeasureRefreshAndChurn times refreshes on a KV store and checks that
// the changes the tags run makes reach the store.
func TestMeasureRefreshAndChurn(t *testing.T) {
	ns := testenv.NATS(t)
	js, err := jetstream.New(testenv.Connect(t, ns))
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	st, err := kv.New(ctx, js, kv.Settings{Bucket: tagsBucket})
	if err != nil {
		t.Fatal(err)
	}
	const n = 20
	for i := range n {
		if err := st.CreateTag(ctx, tagmodel.Tag{Name: tagName(i), Step: 10, MaxID: 1}); err != nil {
			t.Fatal(err)
		}
	}
	r := &TagsResult{NewTags: n, StoreTags: n}
	if err := measureRefresh(ctx, st, r); err != nil {
		t.Fatal(err)
	}
	if r.RefreshChanged != n || r.FullListTags != n || r.RefreshMS <= 0 || r.FullListMS <= 0 {
		t.Errorf("refresh result %+v: want %d changed and listed, times measured", r, n)
	}
	changed := 0
	for i := range n {
		tg, err := st.Tag(ctx, tagName(i))
		if err != nil {
			t.Fatal(err)
		}
		if strings.HasPrefix(tg.Description, "dispenser bench refresh") {
			changed++
		}
	}
	if changed != n {
		t.Errorf("%d tags changed, want %d", changed, n)
	}

	cctx, cancel := context.WithTimeout(ctx, 3*tagsRefresh)
	defer cancel()
	got, err := churn(cctx, st, n)
	if err != nil {
		t.Fatal(err)
	}
	if got%n != 0 {
		t.Errorf("churn changed %d tags, want a multiple of %d", got, n)
	}
}
