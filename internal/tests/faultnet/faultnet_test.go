package faultnet_test

import (
	"errors"
	"io"
	"net"
	"os"
	"syscall"
	"testing"
	"time"

	"github.com/dispenser-dev/dispenser/internal/tests/faultnet"
)

// quiet is how long a read waits to show that nothing arrives. It is not
// a timing assertion: a byte that arrives later than this would still
// fail a test below (the Heal step reads exactly what was sent).
const quiet = 300 * time.Millisecond

// pair dials l and returns the client's and the server's end of one
// connection through it.
func pair(t *testing.T, l *faultnet.Link, srv net.Listener) (client, server net.Conn) {
	t.Helper()
	client, err := net.Dial("tcp", l.Addr())
	if err != nil {
		t.Fatalf("dial %s: %v", l.Addr(), err)
	}
	t.Cleanup(func() { client.Close() })
	server, err = srv.Accept()
	if err != nil {
		t.Fatalf("accept: %v", err)
	}
	t.Cleanup(func() { server.Close() })
	return client, server
}

// upstream is a TCP listener on 127.0.0.1 behind a fresh link.
func upstream(t *testing.T) (*faultnet.Link, net.Listener) {
	t.Helper()
	srv, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close() })
	n := faultnet.New(t)
	return n.Link(t, t.Name(), srv.Addr().String()), srv
}

// send writes msg on from and reads it on to, failing if it does not
// arrive within 10 s.
func send(t *testing.T, from, to net.Conn, msg string) {
	t.Helper()
	if _, err := from.Write([]byte(msg)); err != nil {
		t.Fatalf("write %q: %v", msg, err)
	}
	expect(t, to, msg, 10*time.Second)
}

func expect(t *testing.T, to net.Conn, msg string, within time.Duration) {
	t.Helper()
	to.SetReadDeadline(time.Now().Add(within))
	buf := make([]byte, len(msg))
	if _, err := io.ReadFull(to, buf); err != nil {
		t.Fatalf("read %q: %v", msg, err)
	}
	if string(buf) != msg {
		t.Fatalf("read %q, want %q", buf, msg)
	}
}

// silent asserts that nothing arrives on c for quiet, and that the
// connection is neither closed nor reset.
func silent(t *testing.T, c net.Conn) {
	t.Helper()
	c.SetReadDeadline(time.Now().Add(quiet))
	buf := make([]byte, 1)
	n, err := c.Read(buf)
	if !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("read through a black hole: %d bytes %q, err %v; want nothing and a deadline, not a close or reset", n, buf[:n], err)
	}
}

func TestBlackHole(t *testing.T) {
	for _, tc := range []struct {
		name     string
		dir      faultnet.Direction
		up, down bool // whether that direction still flows
	}{
		{name: "both", dir: faultnet.Both},
		{name: "up", dir: faultnet.Up, down: true},
		{name: "down", dir: faultnet.Down, up: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l, srv := upstream(t)
			c, s := pair(t, l, srv)
			send(t, c, s, "before")
			send(t, s, c, "before")

			l.BlackHole(tc.dir)
			// A direction that flows still flows; one that does not holds
			// its bytes without closing the connection.
			if _, err := c.Write([]byte("up")); err != nil {
				t.Fatalf("client write in a black hole: %v; want it accepted", err)
			}
			if tc.up {
				expect(t, s, "up", 10*time.Second)
			} else {
				silent(t, s)
			}
			if _, err := s.Write([]byte("down")); err != nil {
				t.Fatalf("server write in a black hole: %v; want it accepted", err)
			}
			if tc.down {
				expect(t, c, "down", 10*time.Second)
			} else {
				silent(t, c)
			}

			// Heal: the held bytes arrive, in order, on the same connection.
			l.Heal()
			if !tc.up {
				expect(t, s, "up", 10*time.Second)
			}
			if !tc.down {
				expect(t, c, "down", 10*time.Second)
			}
			send(t, c, s, "after")
			send(t, s, c, "after")
		})
	}
}

func TestBlackHoleStallsNewConnections(t *testing.T) {
	l, srv := upstream(t)
	l.BlackHole(faultnet.Both)
	c, s := pair(t, l, srv)
	if _, err := c.Write([]byte("hello")); err != nil {
		t.Fatal(err)
	}
	silent(t, s)
	l.Heal()
	expect(t, s, "hello", 10*time.Second)
}

func TestReset(t *testing.T) {
	l, srv := upstream(t)
	old, oldSrv := pair(t, l, srv)
	send(t, old, oldSrv, "before")

	l.Reset()
	// A new connection is reset at its first byte.
	c, _ := pair(t, l, srv)
	c.Write([]byte("x"))
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := c.Read(make([]byte, 1)); !errors.Is(err, syscall.ECONNRESET) {
		t.Fatalf("read on a new connection after Reset: %v; want %v", err, syscall.ECONNRESET)
	}
	// An open one is closed at its next byte (a FIN: see the package
	// comment).
	old.Write([]byte("x"))
	old.SetReadDeadline(time.Now().Add(10 * time.Second))
	if n, err := old.Read(make([]byte, 1)); err == nil || errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("read on an open connection after Reset: %d bytes, %v; want it closed or reset", n, err)
	}

	l.Heal()
	c, s := pair(t, l, srv)
	send(t, c, s, "after")
	send(t, s, c, "after")
}

func TestLatency(t *testing.T) {
	const delay, jitter = 200 * time.Millisecond, 50 * time.Millisecond
	for _, tc := range []struct {
		name string
		dir  faultnet.Direction
		up   bool // whether Up is delayed (else Down is, and Up is not)
	}{
		{name: "up", dir: faultnet.Up, up: true},
		{name: "down", dir: faultnet.Down},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l, srv := upstream(t)
			c, s := pair(t, l, srv)
			l.Latency(tc.dir, delay, jitter)
			from, to := s, c
			if tc.up {
				from, to = c, s
			}
			start := time.Now()
			send(t, from, to, "slow")
			if got := time.Since(start); got < delay-jitter {
				t.Fatalf("round took %v through latency %v±%v; want at least %v", got, delay, jitter, delay-jitter)
			}
			t.Logf("delayed direction: %v", time.Since(start))
			l.Heal()
			send(t, c, s, "after")
			send(t, s, c, "after")
		})
	}
}

func TestBandwidth(t *testing.T) {
	const rate = 10 // KB/s
	l, srv := upstream(t)
	c, s := pair(t, l, srv)
	l.Bandwidth(faultnet.Down, rate)
	msg := string(make([]byte, 5000))
	start := time.Now()
	send(t, s, c, msg)
	// 5,000 bytes at 10 KB/s: toxiproxy sleeps len/rate ms per chunk,
	// 500 ms in all.
	if got, want := time.Since(start), 500*time.Millisecond; got < want {
		t.Fatalf("5000 bytes at %d KB/s took %v; want at least %v", rate, got, want)
	}
	l.Heal()
	send(t, s, c, "after")
}

// TestRemoveOneKind removes one kind of fault from a link with two: the
// other stays.
func TestRemoveOneKind(t *testing.T) {
	const delay = 300 * time.Millisecond
	t.Run("black hole", func(t *testing.T) {
		l, srv := upstream(t)
		c, s := pair(t, l, srv)
		l.Latency(faultnet.Up, delay, 0)
		l.BlackHole(faultnet.Up)
		if _, err := c.Write([]byte("held")); err != nil {
			t.Fatal(err)
		}
		silent(t, s)
		l.Remove(faultnet.BlackHoleFault)
		expect(t, s, "held", 10*time.Second)
		// The latency stays: a new message takes at least the delay.
		start := time.Now()
		send(t, c, s, "slow")
		if got := time.Since(start); got < delay {
			t.Fatalf("a message after Remove(BlackHoleFault) took %v; want at least the latency %v, which must stay", got, delay)
		}
	})
	t.Run("latency", func(t *testing.T) {
		l, srv := upstream(t)
		c, s := pair(t, l, srv)
		l.Latency(faultnet.Both, delay, 0)
		l.BlackHole(faultnet.Down)
		l.Remove(faultnet.LatencyFault)
		// The black hole stays: nothing arrives downstream.
		if _, err := s.Write([]byte("held")); err != nil {
			t.Fatal(err)
		}
		silent(t, c)
		send(t, c, s, "up")
		l.Remove(faultnet.BlackHoleFault)
		expect(t, c, "held", 10*time.Second)
	})
}
