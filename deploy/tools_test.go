package deploy

import (
	"os"
	"os/exec"
	"testing"

	"github.com/dispenser-dev/dispenser/testenv"
)

func TestMain(m *testing.M) { os.Exit(testenv.Run(m)) }

// tool returns the path of program, or fails tb naming the Debian package
// that provides it: a missing tool fails, it never skips.
func tool(tb testing.TB, program, debianPackage string) string {
	tb.Helper()
	p, err := exec.LookPath(program)
	if err != nil {
		tb.Fatalf("%s not found on PATH: install the Debian package %s (apt-get install --no-install-recommends %s; ./test.sh does)", program, debianPackage, debianPackage)
	}
	return p
}

// run runs program with args in dir and returns its output, failing tb
// with the output if it fails.
func run(tb testing.TB, dir, program string, args ...string) string {
	tb.Helper()
	cmd := exec.Command(program, args...)
	cmd.Dir = dir
	out, err := cmd.CombinedOutput()
	if err != nil {
		tb.Fatalf("%s %v: %v\n%s", program, args, err, out)
	}
	return string(out)
}
