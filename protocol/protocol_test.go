package protocol

import (
	"errors"
	"fmt"
	"strings"
	"testing"
)

func TestParseCount(t *testing.T) {
	tests := []struct {
		name string
		body string
		want int
		err  error
	}{
		{"empty means one", "", 1, nil},
		{"one", "1", 1, nil},
		{"ten", "10", 10, nil},
		{"trailing newline", "10\n", 10, nil},
		{"surrounding space", " \t42\r\n", 42, nil},
		{"the maximum", "10000", 10000, nil},
		{"leading zeros", "007", 7, nil},
		{"only white space means one", " \n", 1, nil},
		{"zero", "0", 0, ErrBadCount},
		{"negative", "-1", 0, ErrBadCount},
		{"plus sign", "+5", 0, ErrBadCount},
		{"over the maximum", "10001", 0, ErrBadCount},
		{"huge", "99999999999999999999999999", 0, ErrBadCount},
		{"not a number", "ten", 0, ErrBadCount},
		{"hex", "0x10", 0, ErrBadCount},
		{"float", "1.5", 0, ErrBadCount},
		{"inner space", "1 0", 0, ErrBadCount},
		{"binary garbage", "\x00\xff\xfe", 0, ErrBadCount},
		{"megabyte body", strings.Repeat("9", 1<<20), 0, ErrBadCount},
		{"json", `{"n":5}`, 0, ErrBadCount},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := ParseCount([]byte(tt.body), 10000)
			if !errors.Is(err, tt.err) {
				t.Fatalf("err = %v, want %v", err, tt.err)
			}
			if got != tt.want {
				t.Fatalf("got %d, want %d", got, tt.want)
			}
			if err != nil && len(err.Error()) > 300 {
				t.Fatalf("error message of %d bytes echoes the body", len(err.Error()))
			}
		})
	}
}

func TestParseFormat(t *testing.T) {
	tests := []struct {
		name   string
		values []string
		want   Format
		err    error
	}{
		{"absent", nil, FormatList, nil},
		{"list", []string{"list"}, FormatList, nil},
		{"range", []string{"range"}, FormatRange, nil},
		{"case-insensitive", []string{"RANGE"}, FormatRange, nil},
		{"empty value", []string{""}, FormatList, nil},
		{"unknown", []string{"json"}, 0, ErrBadHeader},
		{"twice", []string{"range", "list"}, 0, ErrBadHeader},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := ParseFormat(tt.values)
			if !errors.Is(err, tt.err) || got != tt.want {
				t.Fatalf("got %v, %v; want %v, %v", got, err, tt.want, tt.err)
			}
		})
	}
}

func TestParseTag(t *testing.T) {
	tests := []struct {
		name    string
		subject string
		want    string
		err     error
	}{
		{"plain", "id.segment.orders", "orders", nil},
		{"dash and underscore", "id.segment.a-b_C9", "a-b_C9", nil},
		{"128 characters", "id.segment." + strings.Repeat("x", 128), strings.Repeat("x", 128), nil},
		{"129 characters", "id.segment." + strings.Repeat("x", 129), "", ErrBadSubject},
		{"empty tag", "id.segment.", "", ErrBadSubject},
		{"dot", "id.segment.a.b", "", ErrBadSubject},
		{"wildcard", "id.segment.*", "", ErrBadSubject},
		{"quote", `id.segment.a"b`, "", ErrBadSubject},
		{"sql", "id.segment.a';DROP", "", ErrBadSubject},
		{"unicode", "id.segment.zäh", "", ErrBadSubject},
		{"other prefix", "ids.segment.orders", "", ErrBadSubject},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := ParseTag(tt.subject, "id.segment.")
			if !errors.Is(err, tt.err) || got != tt.want {
				t.Fatalf("got %q, %v; want %q, %v", got, err, tt.want, tt.err)
			}
		})
	}
}

func TestAppendFormats(t *testing.T) {
	runs := []Run{{First: 1, Last: 3}, {First: 10, Last: 10}}
	if got, want := string(AppendList(nil, runs)), "1\n2\n3\n10"; got != want {
		t.Errorf("list = %q, want %q", got, want)
	}
	if got, want := string(AppendIDs(nil, []int64{7, 9, 8})), "7\n9\n8"; got != want {
		t.Errorf("IDs = %q, want %q", got, want)
	}
	if got, want := string(AppendRanges(nil, runs)), "1-3\n10-10"; got != want {
		t.Errorf("ranges = %q, want %q", got, want)
	}
	if got, want := Runs(nil, []int64{5, 6, 7, 9, 10, 12}), []Run{{First: 5, Last: 7}, {First: 9, Last: 10}, {First: 12, Last: 12}}; len(got) != len(want) || got[0] != want[0] || got[1] != want[1] || got[2] != want[2] {
		t.Errorf("Runs = %v, want %v", got, want)
	}
}

func FuzzParseCount(f *testing.F) {
	for _, s := range []string{"", "1", "10000", "10001", "-1", "0", " 5\n", "\x00", "99999999999"} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		n, err := ParseCount(body, 10000)
		if err == nil && (n < 1 || n > 10000) {
			t.Fatalf("ParseCount(%q) = %d without error", body, n)
		}
		if err != nil && !errors.Is(err, ErrBadCount) {
			t.Fatalf("ParseCount(%q): error %v is not ErrBadCount", body, err)
		}
	})
}

func FuzzParseTag(f *testing.F) {
	for _, s := range []string{"id.segment.orders", "id.segment.", "id.segment.a.b", "id.segment.*", "x"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, subject string) {
		tag, err := ParseTag(subject, "id.segment.")
		if err != nil {
			return
		}
		if !ValidTag(tag) || "id.segment."+tag != subject {
			t.Fatalf("ParseTag(%q) = %q, not a valid tag of that subject", subject, tag)
		}
	})
}

func FuzzParseFormat(f *testing.F) {
	for _, s := range []string{"", "list", "range", "RANGE", "json", " range ", "\x00"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, v string) {
		format, err := ParseFormat([]string{v})
		if err != nil {
			if !errors.Is(err, ErrBadHeader) {
				t.Fatalf("ParseFormat(%q): %v is not ErrBadHeader", v, err)
			}
			return
		}
		if format != FormatList && format != FormatRange {
			t.Fatalf("ParseFormat(%q) = %v", v, format)
		}
	})
}

func TestCheckReply(t *testing.T) {
	tests := []struct {
		name  string
		reply string
		err   error
	}{
		{"inbox", "_INBOX.abc.def", nil},
		{"custom inbox prefix", "_MYAPP.replies.1", nil},
		{"service import reply", "_R_.xyz.abc", nil},
		{"a dollar inside a token", "_INBOX.$JS", nil},
		{"a name like the prefix", "idx.segment.a", nil},
		{"at the length limit", "_INBOX." + strings.Repeat("a", MaxReplyLen-7), nil},
		{"none", "", ErrNoReply},
		{"JetStream API", "$JS.API.STREAM.PURGE.KV_dispenser_segments", ErrBadReply},
		{"JetStream API of a domain", "$JS.hub.API.STREAM.DELETE.x", ErrBadReply},
		{"key-value put", "$KV.dispenser_owners.orders", ErrBadReply},
		{"object store", "$O.bucket.C.x", ErrBadReply},
		{"system account", "$SYS.REQ.SERVER.PING", ErrBadReply},
		{"micro discovery", "$SRV.PING", ErrBadReply},
		{"gateway", "$G", ErrBadReply},
		{"future system namespace", "$NEW.thing", ErrBadReply},
		{"the prefix itself", "id", ErrBadReply},
		{"a segment endpoint", "id.segment.orders", ErrBadReply},
		{"another worker's owner subject", "id.owner.abc.orders", ErrBadReply},
		{"the owner subject", "own.er", ErrBadReply},
		{"below the owner subject", "own.er.orders", ErrBadReply},
		{"too long", "_INBOX." + strings.Repeat("a", MaxReplyLen), ErrBadReply},
		{"empty token", "_INBOX..a", ErrBadReply},
		{"leading dot", ".a", ErrBadReply},
		{"trailing dot", "a.", ErrBadReply},
		{"star", "_INBOX.*", ErrBadReply},
		{"full wildcard", "_INBOX.>", ErrBadReply},
		{"space", "_INBOX.a b", ErrBadReply},
		{"tab", "_INBOX.a\tb", ErrBadReply},
		{"newline", "_INBOX.a\r\nPUB x 1", ErrBadReply},
		{"NUL", "_INBOX.a\x00", ErrBadReply},
		{"DEL", "_INBOX.a\x7f", ErrBadReply},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := CheckReply(tt.reply, "id", "own.er")
			if !errors.Is(err, tt.err) {
				t.Fatalf("CheckReply(%q) = %v, want %v", tt.reply, err, tt.err)
			}
			if err != nil && len(err.Error()) > 200 {
				t.Fatalf("error of %d bytes echoes the subject", len(err.Error()))
			}
		})
	}
}

// TestCheckDirect: a reply's DirectHeader is untrusted: only the direct
// subject of the tag asked for, under the client's prefix, with one valid
// owner token, is accepted. Seen failing with CheckDirect accepting any
// subject under <prefix>.direct.
func TestCheckDirect(t *testing.T) {
	tests := []struct {
		name, subject string
		wantErr       error
	}{
		{"the tag's", DirectSubject("id", "orders", "w1"), nil},
		{"an owner of every character", DirectSubject("id", "orders", "x_2-Z"), nil},
		{"another tag's", DirectSubject("id", "payments", "w1"), ErrBadDirect},
		{"a tag that starts alike", DirectSubject("id", "orders2", "w1"), ErrBadDirect},
		{"another prefix", DirectSubject("ix", "orders", "w1"), ErrBadDirect},
		{"no owner", "id.direct.orders.", ErrBadDirect},
		{"no owner token", "id.direct.orders", ErrBadDirect},
		{"a wildcard owner", "id.direct.orders.*", ErrBadDirect},
		{"a full wildcard", "id.direct.orders.>", ErrBadDirect},
		{"two owner tokens", "id.direct.orders.w1.w2", ErrBadDirect},
		{"white space", "id.direct.orders.w 1", ErrBadDirect},
		{"the segment subject", SegmentSubject("id", "orders"), ErrBadDirect},
		{"the owners' subject", "id.owner.w1.orders", ErrBadDirect},
		{"an owner too long", DirectSubject("id", "orders", strings.Repeat("w", MaxTagLen+1)), ErrBadDirect},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if err := CheckDirect(tt.subject, "id", "orders"); !errors.Is(err, tt.wantErr) {
				t.Fatalf("CheckDirect(%q) = %v, want %v", tt.subject, err, tt.wantErr)
			}
		})
	}
}

func TestParseToken(t *testing.T) {
	tests := []struct {
		name   string
		values []string
		want   string
		err    error
	}{
		{"none", nil, "", nil},
		{"base64url of 16 bytes", []string{"q83vEjRWeJCrze8SNFZ4kA"}, "q83vEjRWeJCrze8SNFZ4kA", nil},
		{"longest", []string{strings.Repeat("a", MaxTokenLen)}, strings.Repeat("a", MaxTokenLen), nil},
		{"twice", []string{"a", "a"}, "", ErrBadHeader},
		{"empty", []string{""}, "", ErrBadHeader},
		{"too long", []string{strings.Repeat("a", MaxTokenLen+1)}, "", ErrBadHeader},
		{"space", []string{"a b"}, "", ErrBadHeader},
		{"colon", []string{"a:b"}, "", ErrBadHeader},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := ParseToken(tt.values)
			if got != tt.want || !errors.Is(err, tt.err) {
				t.Fatalf("ParseToken(%q) = %q, %v; want %q, %v", tt.values, got, err, tt.want, tt.err)
			}
		})
	}
}

// checkReplyBefore is CheckReply's byte loop as it was written first, one
// switch per byte: FuzzCheckReplySame holds the faster loop to it.
func checkReplyBefore(reply string, own ...string) error {
	if reply == "" {
		return ErrNoReply
	}
	if len(reply) > MaxReplyLen {
		return fmt.Errorf("%w: %d bytes, longer than %d", ErrBadReply, len(reply), MaxReplyLen)
	}
	if reply[0] == '$' {
		return fmt.Errorf("%w %q: a system namespace ($...)", ErrBadReply, truncate(reply, 64))
	}
	tokenStart := 0
	for i := 0; i <= len(reply); i++ {
		if i < len(reply) {
			c := reply[i]
			if c <= ' ' || c == 0x7f {
				return fmt.Errorf("%w %q: white space or a control character", ErrBadReply, truncate(reply, 64))
			}
			if c != '.' {
				continue
			}
		}
		switch tok := reply[tokenStart:i]; tok {
		case "":
			return fmt.Errorf("%w %q: an empty token", ErrBadReply, truncate(reply, 64))
		case "*", ">":
			return fmt.Errorf("%w %q: a wildcard", ErrBadReply, truncate(reply, 64))
		}
		tokenStart = i + 1
	}
	for _, p := range own {
		if p != "" && (reply == p || strings.HasPrefix(reply, p) && reply[len(p)] == '.') {
			return fmt.Errorf("%w %q: the service's own subjects (%s.>)", ErrBadReply, truncate(reply, 64), p)
		}
	}
	return nil
}

// FuzzCheckReplySame: CheckReply refuses exactly what it refused before
// its faster loop, with the same error.
func FuzzCheckReplySame(f *testing.F) {
	for _, s := range []string{"_INBOX.abc.def", "a..b", "a.*.b", "a.>", ">", "*", "a b", "a\x7fb", "$JS.x", "id.x", "id", "a.", ".a", "a.**", "a.>>", "é.ü", "a\tb"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, reply string) {
		got, want := CheckReply(reply, "id"), checkReplyBefore(reply, "id")
		if fmt.Sprint(got) != fmt.Sprint(want) {
			t.Fatalf("CheckReply(%q) = %v, want %v", reply, got, want)
		}
	})
}

// BenchmarkCheckReply: a request's reply subject as nats.go makes it,
// checked by CheckReply and by the loop it replaced (checkReplyBefore).
func BenchmarkCheckReply(b *testing.B) {
	const reply = "_INBOX.kZ3Qe9YxJ0mW2bT7vR4nLp.aB3dE5gH"
	for _, bb := range []struct {
		name string
		f    func(string, ...string) error
	}{{"now", CheckReply}, {"before", checkReplyBefore}} {
		b.Run(bb.name, func(b *testing.B) {
			for b.Loop() {
				if err := bb.f(reply, "id"); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
