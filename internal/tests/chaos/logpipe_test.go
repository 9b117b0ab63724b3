package chaos

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"
	"unsafe"

	"github.com/dispenser-dev/dispenser/internal/tests/wait"
)

// A stalled log is a fault of the worker's surroundings, not of the
// worker: its stdout and stderr are a pipe whose reader stops reading (a
// log collector that hangs, a container runtime's blocking log driver
// behind a full disk). Once the pipe is full, every goroutine of the
// worker that writes a log line blocks in write(2) until the reader reads
// again; the others run on. Whatever the worker does between two steps
// with a log line in between then takes as long as the stall: the fault
// widens every such window without a line of test code in the worker.

// Linux fcntl commands for a pipe's capacity (not in package syscall).
const (
	fSetPipeSize = 1031 // F_SETPIPE_SZ
	fGetPipeSize = 1032 // F_GETPIPE_SZ
)

// logPipeSize is the capacity asked for: one page, the least there is, so
// that the test fills it quickly.
const logPipeSize = 4096

// logPipe is a worker's stdout and stderr: a pipe whose read end a
// goroutine copies into the log file unless the pipe is stalled.
type logPipe struct {
	r, w     *os.File // w is the worker's; the test keeps it open to fill the pipe
	out      *os.File // the log file
	capacity int      // bytes the pipe holds
	drained  chan struct{}

	mu   sync.Mutex // protects stalled
	cond *sync.Cond // signalled when stalled turns false
	// stalled: the copier does not read, and a filler writes NUL bytes
	// until the pipe is full.
	stalled bool
}

// newLogPipe returns a pipe of logPipeSize bytes whose contents go to out,
// which it closes when finished.
func newLogPipe(out *os.File) (*logPipe, error) {
	r, w, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	p := &logPipe{r: r, w: w, out: out, drained: make(chan struct{})}
	p.cond = sync.NewCond(&p.mu)
	// Fd puts both ends in blocking mode: the copier and the filler block
	// in read(2) and write(2), which is what the worker sees too.
	fd := p.w.Fd()
	if _, _, e := syscall.Syscall(syscall.SYS_FCNTL, fd, fSetPipeSize, logPipeSize); e != 0 {
		r.Close()
		w.Close()
		return nil, fmt.Errorf("F_SETPIPE_SZ: %w", e)
	}
	n, _, e := syscall.Syscall(syscall.SYS_FCNTL, fd, fGetPipeSize, 0)
	if e != 0 {
		r.Close()
		w.Close()
		return nil, fmt.Errorf("F_GETPIPE_SZ: %w", e)
	}
	p.capacity = int(n)
	p.r.Fd()
	go p.copy()
	return p, nil
}

// copy copies the pipe into the log file, without the filler's NUL bytes
// (a JSON log line has none), until every write end is closed.
func (p *logPipe) copy() {
	defer close(p.drained)
	defer p.out.Close()
	buf := make([]byte, 64<<10)
	for {
		p.mu.Lock()
		for p.stalled {
			p.cond.Wait()
		}
		p.mu.Unlock()
		n, err := p.r.Read(buf)
		if n > 0 {
			p.out.Write(bytes.ReplaceAll(buf[:n], []byte{0}, nil))
		}
		if err != nil {
			p.r.Close()
			return
		}
	}
}

// buffered returns the bytes in the pipe (FIONREAD).
func (p *logPipe) buffered() (int, error) {
	var n int32
	if _, _, e := syscall.Syscall(syscall.SYS_IOCTL, p.r.Fd(), syscall.TIOCINQ, uintptr(unsafe.Pointer(&n))); e != 0 {
		return 0, fmt.Errorf("FIONREAD: %w", e)
	}
	return int(n), nil
}

// stall stops reading and fills the pipe; it returns once the pipe holds
// its capacity, so that the worker's next log line blocks, or with an
// error after d.
func (p *logPipe) stall(d time.Duration) error {
	p.mu.Lock()
	if p.stalled {
		p.mu.Unlock()
		return errors.New("log pipe already stalled")
	}
	p.stalled = true
	p.mu.Unlock()
	go p.fill()
	return wait.Until(d, func() error {
		n, err := p.buffered()
		switch {
		case err != nil:
			return err
		case n < p.capacity:
			return fmt.Errorf("log pipe holds %d of %d bytes", n, p.capacity)
		}
		return nil
	})
}

// fill writes NUL bytes one at a time while the pipe is stalled: single
// bytes, so that the pipe ends up full to the last byte. Its last write
// blocks until the stall ends.
func (p *logPipe) fill() {
	nul := []byte{0}
	for {
		p.mu.Lock()
		stalled := p.stalled
		p.mu.Unlock()
		if !stalled {
			return
		}
		if _, err := p.w.Write(nul); err != nil {
			return
		}
	}
}

// resume reads again.
func (p *logPipe) resume() {
	p.mu.Lock()
	p.stalled = false
	p.cond.Broadcast()
	p.mu.Unlock()
}

// finish, once the worker has exited, ends any stall, closes the test's
// write end and waits until the copier has written everything to the log
// file.
func (p *logPipe) finish() {
	p.resume()
	p.w.Close()
	<-p.drained
}

// blockedWriting returns the number of threads of process pid that sleep in
// a write to a pipe (their /proc wchan names pipe_write): with a stalled
// log, the goroutines stuck in a log line.
func blockedWriting(pid int) int {
	names, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/wchan", pid))
	n := 0
	for _, name := range names {
		if b, err := os.ReadFile(name); err == nil && strings.Contains(string(b), "pipe_write") {
			n++
		}
	}
	return n
}
