package main

import (
	"os"
	"regexp"
	"strings"
	"testing"
)

// TestREADMEDocumentsEveryFlag keeps the README true: every flag a command
// takes must appear in it.
func TestREADMEDocumentsEveryFlag(t *testing.T) {
	readme, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	flagName := regexp.MustCompile(`(?m)^  --([a-z0-9-]+)`)
	for _, cmd := range [][]string{
		{"serve"}, {"migrate"}, {"tags", "list"}, {"tags", "create"}, {"tags", "update"}, {"decode"}, {"bench"},
	} {
		out, _ := runCmd(t, append(cmd, "--help")...)
		names := flagName.FindAllStringSubmatch(out, -1)
		if len(names) == 0 {
			t.Fatalf("%v --help lists no flags:\n%s", cmd, out)
		}
		for _, m := range names {
			if !regexp.MustCompile(`--` + m[1] + `([^a-z0-9-]|$)`).Match(readme) {
				t.Errorf("README does not document %s's flag --%s", strings.Join(cmd, " "), m[1])
			}
		}
	}
}
