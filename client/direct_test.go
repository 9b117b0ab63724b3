package client_test

import (
	"context"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/dispenser-dev/dispenser/client"
	"github.com/dispenser-dev/dispenser/protocol"
	"github.com/dispenser-dev/dispenser/testenv"
)

// fakeOrdered stands in for the workers of one ordered tag: the queue
// group's subject answers with IDs and, in protocol.DirectHeader, header;
// the direct subject direct answers with IDs, or with code if set. IDs
// count up over both, and it records which subject each request came on.
type fakeOrdered struct {
	mu   sync.Mutex // protects next, code and seen
	next int64
	code string
	seen []string
}

func (f *fakeOrdered) handle(header string, direct bool) nats.MsgHandler {
	return func(m *nats.Msg) {
		f.mu.Lock()
		f.seen = append(f.seen, m.Subject)
		var resp *nats.Msg
		if direct && f.code != "" {
			resp = failure(m, f.code, "not the owner")
		} else {
			f.next++
			d := ""
			if !direct {
				d = header
			}
			resp = answer(m, strconv.AppendInt(nil, f.next, 10), d)
		}
		f.mu.Unlock()
		_ = m.RespondMsg(resp)
	}
}

func (f *fakeOrdered) subjects() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	seen := f.seen
	f.seen = nil
	return seen
}

// TestDirectSubjects: the client sends an ordered tag's requests to the
// direct subject its replies name, if it is one of the tag's; when the
// direct subject answers 421 or nobody answers there, it goes back to the
// queue group at once and the caller sees no error. Seen failing with the
// client ignoring the header (no request went direct), with CheckDirect
// skipped (a reply's header sent the next request to another tag's subject)
// and with 421 returned to the caller.
func TestDirectSubjects(t *testing.T) {
	const segment, direct = "id.segment.seq", "id.direct.seq.w1"
	tests := []struct {
		name   string
		header string // the queue group's replies' DirectHeader
		opts   []client.Option
		code   string // the direct subject's answer, if not IDs
		gone   bool   // nobody subscribes to the direct subject
		want   []string
	}{
		{name: "follows the header", header: direct, want: []string{segment, direct, direct}},
		{name: "without direct", header: direct, opts: []client.Option{client.WithoutDirect()}, want: []string{segment, segment, segment}},
		{name: "421 goes back to the queue group", header: direct, code: protocol.CodeMisdirected,
			want: []string{segment, direct, segment, direct, segment}},
		{name: "421 without retries", header: direct, code: protocol.CodeMisdirected, opts: []client.Option{client.WithoutRetries()},
			want: []string{segment, direct, segment, direct, segment}},
		{name: "no responders", header: direct, gone: true, want: []string{segment, segment, segment}},
		{name: "another tag's direct subject", header: "id.direct.other.w1", want: []string{segment, segment, segment}},
		{name: "another prefix", header: "ix.direct.seq.w1", want: []string{segment, segment, segment}},
		{name: "the segment subject", header: segment, want: []string{segment, segment, segment}},
		{name: "a wildcard owner", header: "id.direct.seq.*", want: []string{segment, segment, segment}},
		{name: "a longer subject", header: "id.direct.seq.w1.x", want: []string{segment, segment, segment}},
		{name: "the owners' subject", header: "id.owner.w1.seq", want: []string{segment, segment, segment}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ns := testenv.NATS(t)
			nc := testenv.Connect(t, ns)
			f := &fakeOrdered{code: tt.code}
			subs := []string{segment}
			subscribeFunc(t, nc, segment, f.handle(tt.header, false))
			if !tt.gone {
				// Where a rogue header would send a request, too.
				for _, s := range []string{direct, "id.direct.other.w1", "ix.direct.seq.w1", "id.direct.seq.w1.x", "id.owner.w1.seq"} {
					subscribeFunc(t, nc, s, f.handle("", true))
					subs = append(subs, s)
				}
			}
			if err := nc.Flush(); err != nil {
				t.Fatal(err)
			}
			c := newClient(t, testenv.Connect(t, ns), tt.opts...)
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			for i := range 3 {
				id, err := c.Segment(ctx, "seq")
				if err != nil {
					t.Fatalf("request %d: %v, want no error (subscribed: %v)", i+1, err, subs)
				}
				if id < 1 {
					t.Fatalf("request %d: ID %d", i+1, id)
				}
			}
			if got := f.subjects(); !slices.Equal(got, tt.want) {
				t.Fatalf("requests went to %v, want %v", got, tt.want)
			}
		})
	}
}

// subscribeFunc subscribes h to subject on nc until the test ends.
func subscribeFunc(tb testing.TB, nc *nats.Conn, subject string, h nats.MsgHandler) {
	tb.Helper()
	sub, err := nc.Subscribe(subject, h)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { _ = sub.Unsubscribe() })
}
