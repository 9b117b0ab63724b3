package testenv

import (
	"bytes"
	"log/slog"
	"sync"
)

// LogBuffer collects what is written to it, for a test to read while
// writers (a logger, a worker's output) go on; it is safe for concurrent
// use. The zero value is ready.
type LogBuffer struct {
	mu  sync.Mutex // protects buf
	buf bytes.Buffer
}

func (l *LogBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.Write(p)
}

// String returns everything written so far.
func (l *LogBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.String()
}

// Logger returns a text logger that writes to l.
func (l *LogBuffer) Logger() *slog.Logger { return slog.New(slog.NewTextHandler(l, nil)) }
