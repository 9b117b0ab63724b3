package upgrade

import (
	"os"
	"testing"

	"github.com/dispenser-dev/dispenser/testenv"
)

func TestMain(m *testing.M) {
	code := testenv.Run(m)
	if binaries.dir != "" {
		os.RemoveAll(binaries.dir)
	}
	os.Exit(code)
}
