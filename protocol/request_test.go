package protocol

import (
	"errors"
	"strings"
	"testing"
)

func TestFits(t *testing.T) {
	tests := []struct {
		name       string
		maxPayload int64
		format     Format
		want       int
	}{
		{"default server, list", 1 << 20, FormatList, (1<<20 - ReplyHeaderRoom) / 20},
		{"default server, range", 1 << 20, FormatRange, (1<<20 - ReplyHeaderRoom) / 40},
		{"tiny server", 512, FormatList, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := Fits(tt.maxPayload, tt.format); got != tt.want {
				t.Fatalf("Fits(%d, %v) = %d, want %d", tt.maxPayload, tt.format, got, tt.want)
			}
			// The worst reply of that many IDs, with its headers, fits.
			n := Fits(tt.maxPayload, tt.format)
			worst := 0
			for i := range n {
				id := int64(1<<63-1) - int64(i)
				if tt.format == FormatRange {
					worst += len(AppendRanges(nil, []Run{{First: id, Last: id}})) + 1
				} else {
					worst += len(AppendIDs(nil, []int64{id})) + 1
				}
			}
			if worst+ReplyHeaderRoom > int(tt.maxPayload) && n > 0 {
				t.Fatalf("the worst reply of %d IDs is %d bytes: does not fit in %d with headers", n, worst, tt.maxPayload)
			}
		})
	}
}

// TestReadRequest: headers (the format and the token matched without
// regard to case), count and fit in one call, and the 400s in order.
func TestReadRequest(t *testing.T) {
	small := Limits{MaxBatch: 10_000, MaxPayload: func() int64 { return 4096 }}
	tests := []struct {
		name    string
		h       map[string][]string
		body    string
		want    Request
		wantErr error
		errHas  string
	}{
		{name: "none", want: Request{N: 1}},
		{name: "all", h: map[string][]string{"id-format": {"Range"}, "id-token": {"t1"}, WorkerHeader: {""}, DirectHeader: {"1"}}, body: " 7\n",
			want: Request{N: 7, Format: FormatRange, Worker: true, Direct: true, Token: "t1"}},
		{name: "bad token first", h: map[string][]string{TokenHeader: {"a b"}, FormatHeader: {"csv"}, WorkerHeader: {""}}, body: "x",
			want: Request{Worker: true}, wantErr: ErrBadToken, errHas: TokenHeader},
		{name: "bad format", h: map[string][]string{FormatHeader: {"csv"}, TokenHeader: {"t"}}, body: "x",
			want: Request{Token: "t"}, wantErr: ErrBadHeader, errHas: FormatHeader},
		{name: "bad count", body: "0", wantErr: ErrBadCount, errHas: "want 1..10000"},
		{name: "does not fit", body: "200", wantErr: ErrBadCount, errHas: "(max payload 4096 bytes); at most 153 (list)"},
		{name: "fits", body: "153", want: Request{N: 153}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := ReadRequest(tt.h, []byte(tt.body), small)
			if !errors.Is(err, tt.wantErr) || err != nil && !strings.Contains(err.Error(), tt.errHas) {
				t.Fatalf("error %v, want %v with %q", err, tt.wantErr, tt.errHas)
			}
			if got != tt.want {
				t.Fatalf("got %+v, want %+v", got, tt.want)
			}
		})
	}
}

// BenchmarkReadRequest: the hot path's one call per request allocates
// nothing but what ParseCount did before it (the body as a string).
func BenchmarkReadRequest(b *testing.B) {
	h := map[string][]string{"id-format": {"range"}, TokenHeader: {"abc"}, WorkerHeader: {""}}
	body := []byte("10")
	l := Limits{MaxBatch: 10_000, MaxPayload: func() int64 { return 1 << 20 }}
	b.ReportAllocs()
	for b.Loop() {
		r, err := ReadRequest(h, body, l)
		if err != nil || r.N != 10 || r.Format != FormatRange || r.Token != "abc" || !r.Worker {
			b.Fatal(r, err)
		}
	}
}
