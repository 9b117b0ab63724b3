package bench

import (
	"bytes"
	"strings"
	"testing"
)

// TestWriteTable checks the columns: the first left aligned, the others
// right, two spaces apart, padded by characters ("µs", "×"), not bytes,
// and no trailing spaces.
func TestWriteTable(t *testing.T) {
	rows := [][]string{
		{"run", "endpoint", "req/s", "p50", "vs base"},
		{"256 in flight, 1 ID", "baseline", "373,049", "559µs", "1.00×"},
		{"", "snowflake", "5,751", "61.7ms", "0.02×"},
	}
	var b bytes.Buffer
	writeTable(&b, rows, 2)
	want := strings.Join([]string{
		"run                  endpoint     req/s     p50  vs base",
		"256 in flight, 1 ID  baseline   373,049   559µs    1.00×",
		"                     snowflake    5,751  61.7ms    0.02×",
		"",
	}, "\n")
	if b.String() != want {
		t.Errorf("table:\n%s\nwant:\n%s", b.String(), want)
	}

	b.Reset()
	writeTable(&b, [][]string{{"", "target", "got"}, {"ok", "p50", "+3.0µs"}, {"MISS", "start-up to serving", "2s"}}, 3)
	want = strings.Join([]string{
		"      target               got",
		"ok    p50                  +3.0µs",
		"MISS  start-up to serving  2s",
		"",
	}, "\n")
	if b.String() != want {
		t.Errorf("all left aligned:\n%s\nwant:\n%s", b.String(), want)
	}
}

// TestPrint checks that the report names what ran and how many errors,
// lost requests and duplicates there were.
func TestPrint(t *testing.T) {
	rep := &Report{Go: "go1.x", OS: "linux/amd64", CPUs: 2, Local: true, Sync: "always", Store: "kv", Warmup: "1s", Duration: "3s",
		Runs: []*Result{
			{Mode: "pipelined", Endpoint: "baseline", Label: "256 in flight, 1 ID", LoadResult: LoadResult{Subject: "bench.baseline", RPS: 1000, IDsPerSec: 1000}},
			{Mode: "pipelined", Endpoint: "segment", Label: "256 in flight, 1 ID", LoadResult: LoadResult{Subject: "id.segment.bench", RPS: 950, IDsPerSec: 950}},
		}}
	rep.finish()
	var b bytes.Buffer
	if err := rep.Print(&b); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"store kv", "256 in flight, 1 ID  baseline", "0.95×", "ok  segment, 256 in flight, 1 ID: requests/s", "errors 0, lost 0, duplicates 0"} {
		if !strings.Contains(b.String(), want) {
			t.Errorf("report lacks %q:\n%s", want, b.String())
		}
	}
	for line := range strings.SplitSeq(b.String(), "\n") {
		if strings.HasSuffix(line, " ") {
			t.Errorf("trailing space in %q", line)
		}
	}
}
