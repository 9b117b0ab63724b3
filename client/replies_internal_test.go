package client

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/dispenser-dev/dispenser/protocol"
	"github.com/dispenser-dev/dispenser/testenv"
)

func TestParseReplySubject(t *testing.T) {
	const prefix = "_INBOX.abc."
	tests := []struct {
		name       string
		subject    string
		index, gen uint64
		ok         bool
	}{
		{"first", prefix + "0-1", 0, 1, true},
		{"large", prefix + "4294967295-9999999999999999999", 4294967295, 9999999999999999999, true},
		{"attempt zero", prefix + "3-0", 0, 0, false},
		{"no attempt", prefix + "3-", 0, 0, false},
		{"no dash", prefix + "31", 0, 0, false},
		{"no index", prefix + "-1", 0, 0, false},
		{"sign", prefix + "+3-1", 0, 0, false},
		{"trailing", prefix + "3-1x", 0, 0, false},
		{"another token", prefix + "3-1.x", 0, 0, false},
		{"twenty digits", prefix + "3-12345678901234567890", 0, 0, false},
		{"another prefix", "_INBOX.abd.3-1", 0, 0, false},
		{"prefix alone", prefix, 0, 0, false},
		{"empty", "", 0, 0, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			index, gen, ok := parseReplySubject(tt.subject, prefix)
			if ok != tt.ok || ok && (index != tt.index || gen != tt.gen) {
				t.Errorf("parseReplySubject(%q) = %d, %d, %v; want %d, %d, %v", tt.subject, index, gen, ok, tt.index, tt.gen, tt.ok)
			}
		})
	}
}

// requestsOn subscribes to subject and returns the requests it gets,
// unanswered.
func requestsOn(tb testing.TB, nc *nats.Conn, subject string) <-chan *nats.Msg {
	tb.Helper()
	ch := make(chan *nats.Msg, 16)
	if _, err := nc.ChanSubscribe(subject, ch); err != nil {
		tb.Fatal(err)
	}
	if err := nc.Flush(); err != nil {
		tb.Fatal(err)
	}
	return ch
}

// next returns the next message of ch, failing tb after a minute.
func next(tb testing.TB, ch <-chan *nats.Msg) *nats.Msg {
	tb.Helper()
	select {
	case m := <-ch:
		return m
	case <-time.After(time.Minute):
		tb.Fatal("no message within a minute")
		return nil
	}
}

// exchanged is the outcome of an exchange.
type exchanged struct {
	msg *nats.Msg
	err error
}

// startExchange runs r.exchange on a goroutine until stop is closed.
func startExchange(r *request, stop <-chan struct{}) <-chan exchanged {
	out := make(chan exchanged, 1)
	go func() {
		msg, err := r.exchange(stop, nil)
		out <- exchanged{msg, err}
	}()
	return out
}

// result is what an exchange started by startExchange returned; a test
// fails rather than hangs if a reply got lost (the deadline only bounds a
// hang: a reply here takes a round trip on one machine).
func result(tb testing.TB, out <-chan exchanged) exchanged {
	tb.Helper()
	select {
	case e := <-out:
		return e
	case <-time.After(10 * time.Second):
		tb.Fatal("the exchange returned nothing within 10s: its reply was lost")
		return exchanged{}
	}
}

// A reply to an attempt that gave up never reaches a later attempt of the
// same request object, whose reply subject is the same but for the attempt.
// Seen failing with deliver's CompareAndSwap replaced by a Load and
// exchange's subject comparison removed: the later attempt returned the
// late reply ("late").
func TestLateReplyNeverReachesALaterAttempt(t *testing.T) {
	ns := testenv.NATS(t)
	nc := testenv.Connect(t, ns)
	got := requestsOn(t, testenv.Connect(t, ns), "late.t")
	m, err := repliesOf(nc)
	if err != nil {
		t.Fatal(err)
	}
	r := m.get("late.t", 1)
	defer r.release()

	stop1 := make(chan struct{})
	first := startExchange(r, stop1)
	req1 := next(t, got)
	close(stop1) // the first attempt gives up
	if e := result(t, first); !errors.Is(e.err, errAttemptEnded) {
		t.Fatalf("first attempt: %v, %v; want errAttemptEnded", e.msg, e.err)
	}

	stop2 := make(chan struct{})
	defer close(stop2)
	second := startExchange(r, stop2)
	req2 := next(t, got)
	if req1.Reply == req2.Reply || req1.Reply[:strings.LastIndexByte(req1.Reply, '-')] != req2.Reply[:strings.LastIndexByte(req2.Reply, '-')] {
		t.Fatalf("reply subjects %q and %q: want one slot's, two attempts", req1.Reply, req2.Reply)
	}
	if err := req1.Respond([]byte("late")); err != nil {
		t.Fatal(err)
	}
	if err := req2.Respond([]byte("second")); err != nil {
		t.Fatal(err)
	}
	if e := result(t, second); e.err != nil || string(e.msg.Data) != "second" {
		t.Fatalf("second attempt: %v, %v; want the reply %q", e.msg, e.err, "second")
	}
}

// A reply that deliver handed over for an attempt that has since given up
// may land in the slot after the next attempt began (deliver takes the
// attempt, then sends): the next attempt skips it. Seen failing with
// exchange's subject comparison removed: it returned "stale".
func TestStaleReplyInTheSlotIsSkipped(t *testing.T) {
	ns := testenv.NATS(t)
	nc := testenv.Connect(t, ns)
	got := requestsOn(t, testenv.Connect(t, ns), "stale.t")
	m, err := repliesOf(nc)
	if err != nil {
		t.Fatal(err)
	}
	r := m.get("stale.t", 1)
	defer r.release()
	stop := make(chan struct{})
	defer close(stop)
	out := startExchange(r, stop)
	req := next(t, got)
	index, gen, ok := parseReplySubject(req.Reply, m.prefix)
	if !ok || index != uint64(r.slot.index) || gen < 1 {
		t.Fatalf("reply subject %q: want slot %d's", req.Reply, r.slot.index)
	}
	stale := fmt.Sprintf("%s%d-%d", m.prefix, index, gen-1) // an earlier attempt's subject
	r.slot.ch <- &nats.Msg{Subject: stale, Data: []byte("stale")}
	if err := req.Respond([]byte("fresh")); err != nil {
		t.Fatal(err)
	}
	e := result(t, out)
	if e.err != nil || string(e.msg.Data) != "fresh" {
		t.Fatalf("attempt: %v, %v; want the reply %q", e.msg, e.err, "fresh")
	}
}

// The slots of request objects that the garbage collector took are used
// again: the slots stay as many as the request objects in use at once.
// Seen failing with freeSlot's cleanup not registered: no slot was ever
// freed ("after a minute, 0 of 8 slots free").
func TestSlotsOfCollectedRequestsAreReused(t *testing.T) {
	ns := testenv.NATS(t)
	m, err := repliesOf(testenv.Connect(t, ns))
	if err != nil {
		t.Fatal(err)
	}
	const inUse = 8
	for range 20 {
		var rs []*request
		for range inUse {
			rs = append(rs, m.get("x", 1))
		}
		for _, r := range rs {
			r.release()
		}
		rs = nil
		// Two collections empty a sync.Pool (its victim cache, then the
		// rest); the cleanups then free the slots.
		deadline := time.Now().Add(time.Minute)
		for {
			runtime.GC()
			m.mu.Lock()
			free, all := len(m.free), len(*m.slots.Load())
			m.mu.Unlock()
			if free == all {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("after a minute, %d of %d slots free", free, all)
			}
			time.Sleep(time.Millisecond)
		}
	}
	if all := len(*m.slots.Load()); all > inUse {
		t.Errorf("%d slots for %d request objects in use at once", all, inUse)
	}
}

// A tenant that may publish into a client's inbox but reads nothing (the
// case the token is for) cannot pre-empt a reply by guessing its subject:
// an attempt's number is random, so a spray of <inbox>.<slot>-<n>
// reaches no attempt, and the real reply does. Seen failing with attempt
// numbers counted from 1: "client: bad reply from bare.segment.t: token
// line \"forged\"...".
func TestBlindForgerCannotPreemptAReply(t *testing.T) {
	ns := testenv.NATS(t)
	nc := testenv.Connect(t, ns)
	c, err := New(nc, WithPrefix("bare"), WithoutRetries())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	m, err := c.replies()
	if err != nil {
		t.Fatal(err)
	}
	forger := testenv.Connect(t, ns)
	worker := testenv.Connect(t, ns)
	var n atomic.Int64
	if _, err := worker.Subscribe("bare.segment.*", func(req *nats.Msg) {
		// Before each answer, the forger sprays every slot's first
		// attempts with a reply of its own.
		for slot := range len(*m.slots.Load()) {
			for gen := 1; gen <= 64; gen++ {
				_ = forger.Publish(fmt.Sprintf("%s%d-%d", m.prefix, slot, gen), []byte("forged\n1"))
			}
		}
		if err := forger.Flush(); err != nil {
			t.Error(err)
		}
		tok, _ := protocol.RequestToken(req.Header, req.Data)
		_ = req.Respond(strconv.AppendInt(protocol.AppendTokenLine(nil, tok, ""), n.Add(1), 10))
	}); err != nil {
		t.Fatal(err)
	}
	if err := worker.Flush(); err != nil {
		t.Fatal(err)
	}
	for range 20 {
		if _, err := c.Segment(context.Background(), "t"); err != nil {
			t.Fatal(err)
		}
	}
}
