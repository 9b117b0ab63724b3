package main

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// TestREADMEDocumentsEveryFlag keeps the documentation true: every flag a
// command takes must appear in the README or a page of docs/.
func TestREADMEDocumentsEveryFlag(t *testing.T) {
	readme := readDocs(t)
	flagName := regexp.MustCompile(`(?m)^  --([a-z0-9-]+)`)
	for _, cmd := range [][]string{
		{"serve"}, {"migrate"}, {"tags", "list"}, {"tags", "create"}, {"tags", "update"}, {"tags", "import"}, {"decode"}, {"bench"},
	} {
		out, _ := runCmd(t, append(cmd, "--help")...)
		names := flagName.FindAllStringSubmatch(out, -1)
		if len(names) == 0 {
			t.Fatalf("%v --help lists no flags:\n%s", cmd, out)
		}
		for _, m := range names {
			if !regexp.MustCompile(`--` + m[1] + `([^a-z0-9-]|$)`).Match(readme) {
				t.Errorf("neither README nor docs/ document %s's flag --%s", strings.Join(cmd, " "), m[1])
			}
		}
	}
}

// readDocs returns the README and every page of docs/, one after the other.
func readDocs(tb testing.TB) []byte {
	tb.Helper()
	pages, err := filepath.Glob("../../docs/*.md")
	if err != nil || len(pages) == 0 {
		tb.Fatalf("no pages in docs/: %v", err)
	}
	var all []byte
	for _, p := range append([]string{"../../README.md"}, pages...) {
		b, err := os.ReadFile(p)
		if err != nil {
			tb.Fatal(err)
		}
		all = append(append(all, b...), '\n')
	}
	return all
}
