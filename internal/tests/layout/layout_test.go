// Package layout checks the module's structure (issue 36): the layers of
// the README's layout table, read from the imports as `go list` reports
// them, and the size limits that keep each file within a reader's head.
package layout

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"testing"
)

const module = "github.com/dispenser-dev/dispenser"

// layers ranks every package of the product and its core libraries: a
// package imports only packages of lower rank. Test-only infrastructure
// (internal/tests/...) is above them all and no product code imports it.
var layers = map[string]int{
	// The bottom: the wire protocol, migrations, core libraries.
	"protocol":           0,
	"schema":             0,
	"deploy":             0,
	"internal/buildinfo": 0,
	"internal/redact":    0,
	"internal/htmlpage":  0,
	"internal/leafsql":   0,
	"internal/kvbucket":  0,
	// What a tag is, the lease core, the Go client.
	"tagmodel": 1,
	"lease":    1,
	"client":   1,
	// The engines: segment allocator and stores, ownership, snowflake.
	"segment":          2,
	"segment/kv":       2,
	"segment/mysql":    2,
	"segment/postgres": 2,
	"segment/witness":  2,
	"ownership":        2,
	"snowflake":        2,
	// The transports: the NATS service, Leaf's HTTP API.
	"dispenser": 3,
	"leafhttp":  3,
	// One worker in a process, its store openers, users' test worker.
	"worker":            4,
	"worker/pgstore":    5,
	"worker/mysqlstore": 5,
	"dispensertest":     5,
	"worker/adminstore": 6,
	// The bench command's harness and the binary.
	"bench":         6,
	"cmd/dispenser": 7,
}

type pkg struct {
	ImportPath string
	Dir        string
	GoFiles    []string
	Imports    []string
	Deps       []string
}

func list(tb testing.TB) (root string, pkgs []pkg) {
	tb.Helper()
	out, err := exec.Command("go", "env", "GOMOD").Output()
	if err != nil {
		tb.Fatalf("go env GOMOD: %v", err)
	}
	root = filepath.Dir(strings.TrimSpace(string(out)))
	cmd := exec.Command("go", "list", "-json", "./...")
	cmd.Dir = root
	out, err = cmd.Output()
	if err != nil {
		tb.Fatalf("go list: %v", err)
	}
	dec := json.NewDecoder(bytes.NewReader(out))
	for dec.More() {
		var p pkg
		if err := dec.Decode(&p); err != nil {
			tb.Fatalf("go list output: %v", err)
		}
		pkgs = append(pkgs, p)
	}
	return root, pkgs
}

func rel(path string) (string, bool) {
	if path == module {
		return ".", true
	}
	r, ok := strings.CutPrefix(path, module+"/")
	return r, ok
}

// testOnly reports whether p is test-only infrastructure: testenv, the
// store conformance suite and internal/tests/....
func testOnly(p string) bool {
	return p == "testenv" || p == "segment/storetest" || strings.HasPrefix(p, "internal/tests/")
}

func TestLayers(t *testing.T) {
	_, pkgs := list(t)
	for _, p := range pkgs {
		name, _ := rel(p.ImportPath)
		if testOnly(name) {
			continue
		}
		rank, ok := layers[name]
		if !ok {
			t.Errorf("package %s is in no layer: add it to the table in this file and to the README's layout table", name)
			continue
		}
		for _, imp := range p.Imports {
			dep, ours := rel(imp)
			if !ours {
				continue
			}
			switch r, ok := layers[dep]; {
			case testOnly(dep):
				t.Errorf("%s imports the test-only package %s", name, dep)
			case ok && r >= rank:
				t.Errorf("%s (layer %d) imports %s (layer %d): a package imports only lower layers", name, rank, dep, r)
			}
		}
	}
}

// drivers are the database drivers, and the packages that must not link
// them: a user of one store does not carry the other's driver, and the
// worker carries neither (worker/pgstore and worker/mysqlstore open them).
var drivers = map[string][]string{
	"github.com/jackc/pgx/":          {"schema", "worker", "segment/mysql", "tagmodel", "segment"},
	"github.com/go-sql-driver/mysql": {"schema", "worker", "segment/postgres", "tagmodel", "segment"},
}

func TestDrivers(t *testing.T) {
	_, pkgs := list(t)
	for _, p := range pkgs {
		name, _ := rel(p.ImportPath)
		for driver, without := range drivers {
			if !slices.Contains(without, name) {
				continue
			}
			for _, d := range p.Deps {
				if strings.HasPrefix(d, driver) {
					t.Errorf("%s depends on %s: it must not link that database driver", name, d)
					break
				}
			}
		}
	}
}

// TestSizes keeps every non-test file within 600 lines (the store
// conformance suite, a catalogue of cases, excepted) and the command line
// (cmd/) within 1,000.
func TestSizes(t *testing.T) {
	_, pkgs := list(t)
	cmdLines := 0
	var big []string
	for _, p := range pkgs {
		name, _ := rel(p.ImportPath)
		for _, f := range p.GoFiles {
			n := lines(t, filepath.Join(p.Dir, f))
			if strings.HasPrefix(name, "cmd/") {
				cmdLines += n
			}
			if n > 600 && name != "segment/storetest" {
				big = append(big, fmt.Sprintf("%s/%s: %d lines", name, f, n))
			}
		}
	}
	sort.Strings(big)
	for _, b := range big {
		t.Errorf("%s, want at most 600: split it by job", b)
	}
	if cmdLines >= 1000 {
		t.Errorf("cmd/ has %d lines of non-test code, want fewer than 1,000: move what is not the command line's job to the package that owns it", cmdLines)
	}
}

func lines(tb testing.TB, path string) int {
	f, err := os.Open(path)
	if err != nil {
		tb.Fatal(err)
	}
	defer f.Close()
	n := 0
	s := bufio.NewScanner(f)
	s.Buffer(make([]byte, 1<<20), 1<<20)
	for s.Scan() {
		n++
	}
	return n
}
