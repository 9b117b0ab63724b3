package model

import (
	"os"
	"testing"

	"github.com/dispenser-dev/dispenser/testenv"
)

func TestMain(m *testing.M) { os.Exit(testenv.Run(m)) }
