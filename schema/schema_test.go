package schema

import (
	"sort"
	"strings"
	"testing"
)

func TestVersions(t *testing.T) {
	got := Versions()
	if len(got) == 0 || got[0] != "001_leaf_alloc" {
		t.Fatalf("Versions() = %q, want it to start with 001_leaf_alloc", got)
	}
	if !sort.StringsAreSorted(got) {
		t.Errorf("Versions() = %q, not sorted", got)
	}
	for _, v := range got {
		if strings.HasSuffix(v, ".sql") {
			t.Errorf("version %q has the .sql suffix", v)
		}
	}
}
