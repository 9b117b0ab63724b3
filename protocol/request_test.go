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
		{name: "body token", body: "1 tok-1_A", want: Request{N: 1, Token: "tok-1_A", BodyToken: true, Direct: true}},
		{name: "body token, white space", body: " \t7 \t tok\r\n", h: map[string][]string{FormatHeader: {"range"}},
			want: Request{N: 7, Format: FormatRange, Token: "tok", BodyToken: true, Direct: true}},
		{name: "body token before a bad format", body: "1 t2", h: map[string][]string{FormatHeader: {"csv"}},
			want: Request{Token: "t2", BodyToken: true, Direct: true}, wantErr: ErrBadHeader, errHas: FormatHeader},
		{name: "body token, bad count", body: "0 t3", want: Request{Token: "t3", BodyToken: true, Direct: true}, wantErr: ErrBadCount, errHas: "want 1..10000"},
		{name: "body token, no count", body: "t3", wantErr: ErrBadCount},
		{name: "body token, does not fit", body: "200 t4", want: Request{Token: "t4", BodyToken: true, Direct: true}, wantErr: ErrBadCount, errHas: "max payload"},
		{name: "body token with a dot", body: "1 a.b", wantErr: ErrBadToken, errHas: "body token"},
		{name: "body token with a space", body: "1 a b", wantErr: ErrBadToken, errHas: "body token"},
		{name: "body token too long", body: "1 " + strings.Repeat("a", MaxTokenLen+1), wantErr: ErrBadToken, errHas: "body token"},
		{name: "tokens in the header and the body", body: "1 a", h: map[string][]string{TokenHeader: {"b"}, WorkerHeader: {""}},
			want: Request{Worker: true}, wantErr: ErrBadToken, errHas: "both"},
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

// TestReadRequestAllocatesNothing: the hot path's one call per request
// allocates nothing, with a token in the header or in the body (which
// the token shares) and a count of several digits.
func TestReadRequestAllocatesNothing(t *testing.T) {
	l := Limits{MaxBatch: 10_000, MaxPayload: func() int64 { return 1 << 20 }}
	for _, tt := range []struct {
		name string
		h    map[string][]string
		body string
	}{
		{"headers", map[string][]string{"id-format": {"range"}, TokenHeader: {"abc"}, WorkerHeader: {""}}, "10"},
		{"body token", nil, "10 AAAAAAAAAAAAAAAAAAAAAA"},
		{"count", nil, " 123 "},
	} {
		body := []byte(tt.body)
		if got := testing.AllocsPerRun(100, func() {
			if _, err := ReadRequest(tt.h, body, l); err != nil {
				t.Fatal(err)
			}
		}); got != 0 {
			t.Errorf("%s: %v allocations a call, want 0", tt.name, got)
		}
	}
}

// BenchmarkReadRequest: the hot path's one call per request allocates
// nothing (TestReadRequestAllocatesNothing).
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

// TestTokenLine: what AppendTokenLine writes, CutTokenLine reads back, and
// a body without a newline has no token line.
func TestTokenLine(t *testing.T) {
	tests := []struct {
		name, token, direct, ids string
	}{
		{"token", "tok", "", "1"},
		{"token and direct subject", "tok", "id.direct.seq.w1", "1-3"},
		{"no IDs", "t", "", ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			body := append(AppendTokenLine(nil, tt.token, tt.direct), tt.ids...)
			tok, direct, rest, ok := CutTokenLine(body)
			if !ok || string(tok) != tt.token || string(direct) != tt.direct || string(rest) != tt.ids {
				t.Fatalf("CutTokenLine(%q) = %q, %q, %q, %v; want %q, %q, %q", body, tok, direct, rest, ok, tt.token, tt.direct, tt.ids)
			}
		})
	}
	if _, _, _, ok := CutTokenLine([]byte("123")); ok {
		t.Error("a body without a newline has a token line")
	}
}

// TestRequestToken: a responder finds the token where the requester put
// it.
func TestRequestToken(t *testing.T) {
	tests := []struct {
		name       string
		h          map[string][]string
		body       string
		want       string
		wantInBody bool
	}{
		{"none", nil, "3", "", false},
		{"header", map[string][]string{TokenHeader: {"h"}}, "3", "h", false},
		{"body", nil, "3 b", "b", true},
		{"body first", map[string][]string{TokenHeader: {"h"}}, "3 b", "b", true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, inBody := RequestToken(tt.h, []byte(tt.body))
			if got != tt.want || inBody != tt.wantInBody {
				t.Fatalf("RequestToken = %q, %v; want %q, %v", got, inBody, tt.want, tt.wantInBody)
			}
		})
	}
}

// FuzzReadRequestBody: whatever the body, ReadRequest either fails with a
// 400's error or reads a count in 1..max and, with a body token, a valid
// one.
func FuzzReadRequestBody(f *testing.F) {
	for _, s := range []string{"", "1", "1 tok", " 2\ttok \n", "1 a b", "x y", "1 ", " tok"} {
		f.Add(s)
	}
	l := Limits{MaxBatch: 100, MaxPayload: func() int64 { return 1 << 20 }}
	f.Fuzz(func(t *testing.T, body string) {
		r, err := ReadRequest(nil, []byte(body), l)
		if err != nil {
			if !errors.Is(err, ErrBadCount) && !errors.Is(err, ErrBadToken) {
				t.Fatalf("ReadRequest(%q): %v is no 400", body, err)
			}
			return
		}
		if r.N < 1 || r.N > 100 || r.BodyToken != (r.Token != "") || r.BodyToken && !ValidToken(r.Token) {
			t.Fatalf("ReadRequest(%q) = %+v", body, r)
		}
	})
}
