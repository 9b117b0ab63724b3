package procs

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestLogLines: every JSON object line of a log, nothing else. Seen
// failing with the JSON check removed ("LogLines = [map[level:INFO
// msg:serving] map[] map[...]], want the 2 JSON lines").
func TestLogLines(t *testing.T) {
	name := filepath.Join(t.TempDir(), "worker.log")
	log := `{"level":"INFO","msg":"serving"}` + "\n" + "panic: not JSON\n" + `{"level":"WARN","msg":"fenced","n":2}` + "\n"
	if err := os.WriteFile(name, []byte(log), 0o644); err != nil {
		t.Fatal(err)
	}
	got := LogLines(name)
	if len(got) != 2 || got[0]["msg"] != "serving" || got[1]["msg"] != "fenced" {
		t.Fatalf("LogLines = %v, want the 2 JSON lines", got)
	}
	if got := LogLines(filepath.Join(t.TempDir(), "missing")); got != nil {
		t.Fatalf("LogLines of a missing log = %v, want none", got)
	}
}

// TestWorkerEnv: no DISPENSER_ variable reaches a worker, everything else
// does.
func TestWorkerEnv(t *testing.T) {
	t.Setenv("DISPENSER_MAX_WAIT", "1s")
	t.Setenv("PROCS_TEST_KEEP", "1")
	env := strings.Join(WorkerEnv(), "\n")
	if strings.Contains(env, "DISPENSER_MAX_WAIT") || !strings.Contains(env, "PROCS_TEST_KEEP=1") {
		t.Fatalf("WorkerEnv = ...%q..., want PROCS_TEST_KEEP and no DISPENSER_ variable", env[max(0, len(env)-200):])
	}
}
