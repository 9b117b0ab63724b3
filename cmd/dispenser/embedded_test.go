package main

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nats.go/micro"

	"github.com/dispenser-dev/dispenser/segment/kv"
	"github.com/dispenser-dev/dispenser/worker"
)

// imageArgs returns the image's default arguments: the Dockerfile's CMD,
// read from the Dockerfile itself so that the test and the image cannot
// drift apart.
func imageArgs(tb testing.TB) []string {
	tb.Helper()
	b, err := os.ReadFile("../../Dockerfile")
	if err != nil {
		tb.Fatal(err)
	}
	for line := range strings.SplitSeq(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, "CMD "); ok {
			var args []string
			if err := json.Unmarshal([]byte(rest), &args); err != nil {
				tb.Fatalf("Dockerfile: CMD %s: %v (want the JSON form)", rest, err)
			}
			return args
		}
	}
	tb.Fatal("Dockerfile: no CMD")
	return nil
}

// TestImageDefaultRefusesUnauthenticatedPeers runs the worker with the
// image's default arguments, but on a free loopback port and a temporary
// data directory, and checks what a peer without credentials can do
// (docs/deploy.md): ask for IDs, and nothing else: it cannot answer ID
// requests (join the queue group and hand out forged IDs) nor reach
// JetStream (delete or write the buckets).
func TestImageDefaultRefusesUnauthenticatedPeers(t *testing.T) {
	args := imageArgs(t)
	addr, dir := freeAddr(t), filepath.Join(t.TempDir(), "data")
	for flag, v := range map[string]string{"--nats-listen": addr, "--data-dir": dir} {
		i := slices.Index(args, flag)
		if i < 0 || i+1 >= len(args) {
			t.Fatalf("the image's arguments %q have no %s", args, flag)
		}
		args[i+1] = v
	}
	if slices.Contains(args, "--nats-url") {
		t.Fatalf("the image's arguments %q are not zero-setup mode", args)
	}
	logs := startServe(t, args...)
	checkUnauthenticatedPeer(t, addr, dir, logs)
}

// checkUnauthenticatedPeer checks the embedded nats-server at addr,
// holding dir, with a peer that has no credentials.
func checkUnauthenticatedPeer(t *testing.T, addr, dir string, logs *syncBuffer) {
	requester := connect(t, addr)
	// (c) Requests work without credentials.
	waitForID(t, requester, "id.snowflake", logs)
	if got := waitForID(t, requester, "id.segment.peer", logs); got != "1" {
		t.Fatalf("id.segment.peer = %s, want 1", got)
	}

	// A requester reads its own replies on _INBOX.>, but none of the
	// worker's: its JetStream replies (KV entries, acks) go to a private
	// inbox prefix. Tags created on first use make the worker write the
	// segment bucket and read the acks.
	spy := connect(t, addr)
	spied, err := spy.SubscribeSync("_INBOX.>")
	if err != nil {
		t.Fatal(err)
	}
	if err := spy.Flush(); err != nil {
		t.Fatal(err)
	}
	for _, tag := range []string{"spied1", "spied2", "spied3"} {
		waitForID(t, requester, "id.segment."+tag, logs)
	}
	// Every message to the spy went out before its PONG: after Flush they
	// are all pending.
	if err := spy.Flush(); err != nil {
		t.Fatal(err)
	}
	own := requester.NewRespInbox()
	own = own[:strings.LastIndexByte(own, '.')+1]
	n, _, _ := spied.Pending()
	for range n {
		m, err := spied.NextMsg(time.Second)
		if err != nil {
			t.Fatal(err)
		}
		if !strings.HasPrefix(m.Subject, own) {
			t.Errorf("a requester read %s: %q", m.Subject, m.Data)
		}
	}

	// refused subscribes (or publishes) on a connection of its own, and
	// wants the server to refuse it.
	refused := func(what string, act func(nc *nats.Conn) error) {
		t.Helper()
		nc := connect(t, addr)
		if err := act(nc); err != nil && !errors.Is(err, nats.ErrPermissionViolation) && !errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, nats.ErrTimeout) {
			t.Errorf("%s: %v", what, err)
		}
		// The server answers the PING after it handled (and refused) what
		// came before it: by then nats.go has recorded the violation.
		if err := nc.Flush(); err != nil {
			t.Fatalf("%s: flush: %v", what, err)
		}
		if last := nc.LastError(); !errors.Is(last, nats.ErrPermissionViolation) {
			t.Errorf("%s: allowed to a peer without credentials (last error %v), want a permissions violation", what, last)
		}
	}

	// (a) Answering: the queue group, all of the service's subjects, $SRV.
	var forged atomic.Int64
	answer := func(m *nats.Msg) {
		forged.Add(1)
		m.Respond([]byte("999999999"))
	}
	refused("join queue group dispenser on id.segment.>", func(nc *nats.Conn) error {
		_, err := nc.QueueSubscribe("id.segment.>", worker.DefaultQueueGroup, answer)
		return err
	})
	refused("subscribe id.>", func(nc *nats.Conn) error {
		_, err := nc.Subscribe("id.>", answer)
		return err
	})
	refused("subscribe $SRV.>", func(nc *nats.Conn) error {
		_, err := nc.Subscribe("$SRV.>", answer)
		return err
	})
	// Every ID comes from the worker: the tag goes on from 2, one by one.
	for want := 2; want < 42; want++ {
		resp, err := requester.Request("id.segment.peer", nil, 10*time.Second)
		if err != nil {
			t.Fatalf("request %d: %v, want ID %d from the worker (%d forged answers)", want, err, want, forged.Load())
		}
		if resp.Header.Get(micro.ErrorCodeHeader) != "" || string(resp.Data) != strconv.Itoa(want) {
			t.Fatalf("request %d: %q %v, want ID %d from the worker (%d forged answers)", want, resp.Data, resp.Header, want, forged.Load())
		}
	}
	if n := forged.Load(); n != 0 {
		t.Fatalf("the peer answered %d requests", n)
	}

	// (b) JetStream: no API, no KV subjects, no $SRV questions (micro
	// answers them on any reply subject, with the worker's rights).
	refused("$JS.API.INFO", func(nc *nats.Conn) error {
		js, err := jetstream.New(nc)
		if err != nil {
			return err
		}
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		if _, err := js.AccountInfo(ctx); err == nil {
			t.Error("$JS.API.INFO answered a peer without credentials")
		}
		return nil
	})
	refused("delete the segment bucket", func(nc *nats.Conn) error {
		js, err := jetstream.New(nc)
		if err != nil {
			return err
		}
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		if err := js.DeleteKeyValue(ctx, kv.DefaultBucket); err == nil {
			t.Error("a peer without credentials deleted the segment bucket")
		}
		return nil
	})
	refused("write a KV key", func(nc *nats.Conn) error {
		return nc.Publish("$KV."+kv.DefaultBucket+".forged", []byte("1"))
	})
	refused("$SRV.PING with a JetStream reply subject", func(nc *nats.Conn) error {
		return nc.PublishRequest("$SRV.PING", "$JS.API.STREAM.PURGE.KV_"+kv.DefaultBucket, nil)
	})
	refused("forward to an owner", func(nc *nats.Conn) error {
		return nc.Publish("id.owner.x.peer", nil)
	})

	// The worker's key (for admin commands) has the rights, and finds the
	// bucket whole.
	key, err := nats.NkeyOptionFromSeed(filepath.Join(dir, worker.KeyFile))
	if err != nil {
		t.Fatal(err)
	}
	admin, err := nats.Connect("nats://"+addr, key)
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close()
	js, err := jetstream.New(admin)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	b, err := js.KeyValue(ctx, kv.DefaultBucket)
	if err != nil {
		t.Fatalf("segment bucket with the worker's key: %v", err)
	}
	if _, err := b.Get(ctx, "forged"); !errors.Is(err, jetstream.ErrKeyNotFound) {
		t.Fatalf("key written by the peer: %v, want %v", err, jetstream.ErrKeyNotFound)
	}
	if got := waitForID(t, requester, "id.segment.peer", logs); got != "42" {
		t.Fatalf("id.segment.peer after the peer's attempts = %s, want 42", got)
	}
}
