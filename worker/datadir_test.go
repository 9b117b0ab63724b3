package worker

import (
	"errors"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
)

// TestDataDirHeldByOneWorker: a second embedded server on a data directory
// another one holds, in the same process, is refused with
// ErrDataDirInUse, naming the directory and the holder; once the first is
// closed the directory can be taken again. flock belongs to the open file
// description, so this holds between two starts of one process as between
// two processes (cmd/dispenser's TestDataDirOneProcess runs those).
func TestDataDirHeldByOneWorker(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "data")
	first, err := StartEmbedded(Embedded{Listen: "127.0.0.1:-1", DataDir: dir}, "")
	if err != nil {
		t.Fatal(err)
	}
	defer first.Close()
	second, err := StartEmbedded(Embedded{Listen: "127.0.0.1:-1", DataDir: dir}, "")
	if err == nil {
		second.Close()
		t.Fatal("a second embedded server started on a held data directory")
	}
	if !errors.Is(err, ErrDataDirInUse) {
		t.Fatalf("err = %v, want %v", err, ErrDataDirInUse)
	}
	for _, want := range []string{dir, "pid " + strconv.Itoa(os.Getpid()), "--data-dir"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not say %q", err, want)
		}
	}
	// The refused start left the holder's lock and key file alone.
	if _, err := os.Stat(first.KeyFile()); err != nil {
		t.Fatalf("the holder's key file after a refused start: %v", err)
	}
	first.Close()
	if _, err := os.Stat(filepath.Join(dir, KeyFile)); !os.IsNotExist(err) {
		t.Errorf("key file after Close: %v, want it removed", err)
	}
	third, err := StartEmbedded(Embedded{Listen: "127.0.0.1:-1", DataDir: dir}, "")
	if err != nil {
		t.Fatalf("start after the holder closed: %v", err)
	}
	third.Close()
}

// TestNewRefusesAHeldDataDir: worker.New on a data directory held by
// another worker fails before it serves.
func TestNewRefusesAHeldDataDir(t *testing.T) {
	dir := t.TempDir()
	first, err := StartEmbedded(Embedded{Listen: "127.0.0.1:-1", DataDir: dir}, "")
	if err != nil {
		t.Fatal(err)
	}
	defer first.Close()
	w, err := New(t.Context(), Config{Embedded: Embedded{Listen: "127.0.0.1:-1", DataDir: dir}})
	if err == nil {
		w.Close()
	}
	if !errors.Is(err, ErrDataDirInUse) {
		t.Fatalf("New on a held data directory: %v, want %v", err, ErrDataDirInUse)
	}
}

// TestDataDirOnNetworkFileSystem: a data directory on a network file
// system is refused: its lock may not keep out a worker on another
// machine.
func TestDataDirOnNetworkFileSystem(t *testing.T) {
	if _, ok := networkFS(t.TempDir()); ok {
		t.Fatal("the test's temporary directory counts as a network file system")
	}
	was := statfsType
	t.Cleanup(func() { statfsType = was })
	statfsType = func(string) (int64, error) { return 0x6969, nil } // NFS
	dir := filepath.Join(t.TempDir(), "data")
	es, err := StartEmbedded(Embedded{Listen: "127.0.0.1:-1", DataDir: dir}, "")
	if err == nil {
		es.Close()
	}
	if !errors.Is(err, ErrNetworkDataDir) || !strings.Contains(err.Error(), "NFS") || !strings.Contains(err.Error(), dir) {
		t.Fatalf("err = %v, want %v naming NFS and %s", err, ErrNetworkDataDir, dir)
	}
	if _, err := os.Stat(filepath.Join(dir, "jetstream")); !os.IsNotExist(err) {
		t.Fatalf("JetStream store after the refusal: %v, want none", err)
	}
}

// TestListenAddressInUse: an address another process listens on fails at
// once with "address already in use", naming it and the way out, and the
// refused start releases the data directory.
func TestListenAddressInUse(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	addr := ln.Addr().String()
	dir := t.TempDir()
	es, err := StartEmbedded(Embedded{Listen: addr, DataDir: dir}, "")
	if err == nil {
		es.Close()
		t.Fatalf("started on %s, which another listener holds", addr)
	}
	if !errors.Is(err, syscall.EADDRINUSE) {
		t.Errorf("err = %v, want %v", err, syscall.EADDRINUSE)
	}
	for _, want := range []string{addr, "address already in use", "--nats-listen", "--nats-url nats://" + addr} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not say %q", err, want)
		}
	}
	es, err = StartEmbedded(Embedded{Listen: "127.0.0.1:-1", DataDir: dir}, "")
	if err != nil {
		t.Fatalf("the data directory after a refused start: %v", err)
	}
	es.Close()
}
