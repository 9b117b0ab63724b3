package helm

import (
	"os"
	"reflect"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"
)

// TestDocsValues: the dispenser values docs/deploy.md shows next to the
// NATS chart are those of the value set the chart is tested with.
func TestDocsValues(t *testing.T) {
	const name, marker = "postgres, credentials, TLS, ServiceMonitor", "# values-dispenser.yaml\n"
	page, err := os.ReadFile("../../docs/deploy.md")
	if err != nil {
		t.Fatal(err)
	}
	_, block, ok := strings.Cut(string(page), "```yaml\n"+marker)
	block, _, closed := strings.Cut(block, "```")
	if !ok || !closed {
		t.Fatalf("docs/deploy.md has no yaml block starting %q", marker)
	}
	var want string
	for _, vs := range valueSets {
		if vs.name == name {
			want = vs.values
		}
	}
	var got, tested map[string]any
	if err := yaml.Unmarshal([]byte(block), &got); err != nil {
		t.Fatalf("docs/deploy.md's values: %v", err)
	}
	if err := yaml.Unmarshal([]byte(want), &tested); err != nil || len(tested) == 0 {
		t.Fatalf("value set %q: %v", name, err)
	}
	if !reflect.DeepEqual(got, tested) {
		t.Errorf("docs/deploy.md shows\n%s\nthe tests render value set %q:\n%s", block, name, want)
	}
}
