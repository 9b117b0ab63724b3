// Package procs is what the suites that run dispenser as real processes
// share (internal/tests/chaos, internal/tests/upgrade): building the binary
// from a module's sources, the environment of a worker process, and
// reading its JSON log.
package procs

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
)

// ModuleRoot returns the directory of the module the test runs in.
func ModuleRoot() (string, error) {
	out, err := exec.Command("go", "env", "GOMOD").Output()
	if err != nil {
		return "", fmt.Errorf("go env GOMOD: %w", err)
	}
	mod := strings.TrimSpace(string(out))
	if mod == "" || mod == os.DevNull {
		return "", errors.New("go env GOMOD: not in a module")
	}
	return filepath.Dir(mod), nil
}

// Build builds cmd/dispenser of the module in dir into out (with the race
// detector if race), from the shared module cache (no network needed once
// the current version built): GOWORK=off and GOFLAGS=-mod=readonly, so
// that a commit's own go.mod and go.sum decide its dependencies.
func Build(dir, out string, race bool) error {
	args := []string{"build", "-o", out}
	if race {
		args = append(args, "-race")
	}
	args = append(args, "./cmd/dispenser")
	cmd := exec.Command("go", args...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "GOWORK=off", "GOFLAGS=-mod=readonly")
	if b, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("go %s in %s: %v\n%s", strings.Join(args, " "), dir, err, b)
	}
	return nil
}

// StatSources stats the module's source files below root. go test caches
// a passing result keyed by the test binary and by the files the test
// looked at; a worker binary is built from sources the test binary does not
// contain (cmd/dispenser), so looking at them makes a change there run the
// tests again instead of reporting a stale "(cached)".
func StatSources(root string) {
	filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return nil
		}
		if d.IsDir() {
			if path != root && (strings.HasPrefix(d.Name(), ".") || d.Name() == "testdata") {
				return filepath.SkipDir
			}
			return nil
		}
		switch filepath.Ext(path) {
		case ".go", ".mod", ".sum", ".sql":
			os.Stat(path)
		}
		return nil
	})
}

// WorkerEnv is the environment of worker processes: ours without the
// DISPENSER_ variables, which would set flags behind the test's back.
func WorkerEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "DISPENSER_") {
			env = append(env, kv)
		}
	}
	return env
}

// LogLines returns the JSON lines of a worker log as maps; lines that are
// not JSON objects are passed over, and a missing log has none.
func LogLines(name string) []map[string]any {
	f, err := os.Open(name)
	if err != nil {
		return nil
	}
	defer f.Close()
	var lines []map[string]any
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		var m map[string]any
		if json.Unmarshal(sc.Bytes(), &m) == nil {
			lines = append(lines, m)
		}
	}
	return lines
}
