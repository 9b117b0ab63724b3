package upgrade

import (
	"errors"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/dispenser-dev/dispenser/internal/tests/procs"
)

// TestCheckHistory: the upgrade test is skipped only where the history is
// missing (not a checkout, a shallow clone), and refuses a commit that is
// not an ancestor of HEAD.
func TestCheckHistory(t *testing.T) {
	root, err := procs.ModuleRoot()
	if err != nil {
		t.Fatal(err)
	}
	if err := checkHistory(root, previous); errors.Is(err, errNoHistory) {
		t.Skipf("this checkout has no history: %v", err)
	} else if err != nil {
		t.Fatalf("checkHistory(%s) = %v, want nil: previous must be an ancestor of HEAD", previous, err)
	}
	head, err := git(root, "rev-parse", "HEAD")
	if err != nil {
		t.Fatal(err)
	}
	// A shallow clone of HEAD, and a commit that is not HEAD's ancestor
	// (a child of HEAD made in a full clone).
	shallow := filepath.Join(t.TempDir(), "shallow")
	if out, err := exec.Command("git", "clone", "--quiet", "--depth", "1", "file://"+root, shallow).CombinedOutput(); err != nil {
		t.Fatalf("git clone --depth 1: %v: %s", err, out)
	}
	full := filepath.Join(t.TempDir(), "full")
	if out, err := exec.Command("git", "clone", "--quiet", "--no-checkout", root, full).CombinedOutput(); err != nil {
		t.Fatalf("git clone: %v: %s", err, out)
	}
	if _, err := git(full, "checkout", "--quiet", "--detach", head); err != nil {
		t.Fatal(err)
	}
	child, err := git(full, "-c", "user.name=t", "-c", "user.email=t@example.com", "commit-tree", "-p", head, "-m", "child", head+"^{tree}")
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name      string
		dir       string
		commit    string
		noHistory bool // errNoHistory: skip
		ok        bool
	}{
		{name: "previous in a full clone", dir: full, commit: previous, ok: true},
		{name: "shallow clone", dir: shallow, commit: previous, noHistory: true},
		{name: "not a checkout", dir: t.TempDir(), commit: previous, noHistory: true},
		{name: "a commit after HEAD", dir: full, commit: child},
		{name: "a commit that does not exist", dir: full, commit: "0123456789abcdef0123456789abcdef01234567"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := checkHistory(tc.dir, tc.commit)
			switch {
			case tc.ok && err != nil:
				t.Errorf("checkHistory = %v, want nil", err)
			case !tc.ok && err == nil:
				t.Errorf("checkHistory = nil, want an error")
			case errors.Is(err, errNoHistory) != tc.noHistory:
				t.Errorf("checkHistory = %v: errors.Is(err, errNoHistory) = %v, want %v", err, !tc.noHistory, tc.noHistory)
			}
		})
	}
}
