package chaos

import (
	"os"
	"testing"

	"github.com/dispenser-dev/dispenser/testenv"
)

func TestMain(m *testing.M) {
	code := testenv.Run(m)
	if binary.dir != "" {
		os.RemoveAll(binary.dir)
	}
	os.Exit(code)
}
