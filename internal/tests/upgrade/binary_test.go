package upgrade

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"

	"github.com/dispenser-dev/dispenser/internal/tests/procs"
)

// previous is the commit of this repository that the upgrade test runs
// beside the current code: main as it was before the session that wrote
// the test (2026-11-28, "ownership: Claim reads a key its cache says is
// settled ..."), the version operators run now. Move it forward when a
// release is cut: to the commit of the release before the one being
// prepared, so that the test always upgrades from what is deployed. It
// must be an ancestor of HEAD (checked): a commit off the history would
// test an upgrade nobody makes.
const previous = "e810de8da2fa1701496d6310ad5feeb7ef8b6fbf"

// git runs git in dir and returns its trimmed standard output.
func git(dir string, args ...string) (string, error) {
	cmd := exec.Command("git", args...)
	cmd.Dir = dir
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return "", fmt.Errorf("git %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(stderr.String()))
	}
	return strings.TrimSpace(string(out)), nil
}

// errNoHistory means the checkout lacks the git history the previous
// version is built from: the test is skipped, saying so.
var errNoHistory = errors.New("no git history to build the previous version from")

// checkHistory returns errNoHistory (wrapped, with the reason) if root is
// not a git checkout with commit in its history, and another error if
// commit is there but is not an ancestor of HEAD.
func checkHistory(root, commit string) error {
	if _, err := exec.LookPath("git"); err != nil {
		return fmt.Errorf("%w: git is not installed", errNoHistory)
	}
	if _, err := git(root, "rev-parse", "--git-dir"); err != nil {
		return fmt.Errorf("%w: %s is not a git checkout (%v)", errNoHistory, root, err)
	}
	if shallow, err := git(root, "rev-parse", "--is-shallow-repository"); err != nil {
		return err
	} else if shallow == "true" {
		return fmt.Errorf("%w: %s is a shallow clone (git fetch --unshallow, or clone without --depth)", errNoHistory, root)
	}
	if _, err := git(root, "cat-file", "-e", commit+"^{commit}"); err != nil {
		return fmt.Errorf("commit %s is not in the history of %s: %w", commit, root, err)
	}
	if _, err := git(root, "merge-base", "--is-ancestor", commit, "HEAD"); err != nil {
		return fmt.Errorf("commit %s is not an ancestor of HEAD: an upgrade from it is not one anybody makes from this branch (%w)", commit, err)
	}
	return nil
}

// binaries builds each version once per test binary.
var binaries = struct {
	mu    sync.Mutex
	paths map[string]string
	dir   string // of the current version's binary; removed by TestMain
}{paths: map[string]string{}}

// currentBinary builds cmd/dispenser of the working tree.
func currentBinary(tb testing.TB) string {
	tb.Helper()
	binaries.mu.Lock()
	defer binaries.mu.Unlock()
	if p, ok := binaries.paths["current"]; ok {
		return p
	}
	root, err := procs.ModuleRoot()
	if err != nil {
		tb.Fatal(err)
	}
	if binaries.dir == "" {
		if binaries.dir, err = os.MkdirTemp("", "dispenser-upgrade-"); err != nil {
			tb.Fatal(err)
		}
	}
	path := filepath.Join(binaries.dir, "dispenser")
	if err := procs.Build(root, path, false); err != nil {
		tb.Fatal(err)
	}
	procs.StatSources(root)
	binaries.paths["current"] = path
	return path
}

// previousBinary builds cmd/dispenser of commit, from an archive of it in
// a temporary directory, and keeps the binary in the user's cache
// directory, keyed by commit and Go version, so that later runs only
// check the history. Without the history (a shallow clone, an export) it
// skips the test, saying why.
func previousBinary(tb testing.TB, commit string) string {
	tb.Helper()
	binaries.mu.Lock()
	defer binaries.mu.Unlock()
	if p, ok := binaries.paths[commit]; ok {
		return p
	}
	root, err := procs.ModuleRoot()
	if err != nil {
		tb.Fatal(err)
	}
	if err := checkHistory(root, commit); errors.Is(err, errNoHistory) {
		tb.Skipf("upgrade test skipped: %v", err)
	} else if err != nil {
		tb.Fatal(err)
	}
	cache, err := os.UserCacheDir()
	if err != nil {
		cache = os.TempDir()
	}
	dir := filepath.Join(cache, "dispenser-test", "upgrade", commit+"-"+runtime.Version()+"-"+runtime.GOOS+"-"+runtime.GOARCH)
	path := filepath.Join(dir, "dispenser")
	if _, err := os.Stat(path); err == nil {
		binaries.paths[commit] = path
		return path
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		tb.Fatal(err)
	}
	src, err := os.MkdirTemp("", "dispenser-"+commit[:7]+"-")
	if err != nil {
		tb.Fatal(err)
	}
	defer os.RemoveAll(src)
	tar := filepath.Join(src, "src.tar")
	if _, err := git(root, "archive", "--format=tar", "-o", tar, commit); err != nil {
		tb.Fatal(err)
	}
	if out, err := exec.Command("tar", "-xf", tar, "-C", src).CombinedOutput(); err != nil {
		tb.Fatalf("unpacking %s: %v: %s", commit, err, out)
	}
	tmp := filepath.Join(dir, fmt.Sprintf("dispenser.%d.tmp", os.Getpid()))
	if err := procs.Build(src, tmp, false); err != nil {
		tb.Fatalf("building commit %s: %v", commit, err)
	}
	if err := os.Rename(tmp, path); err != nil { // atomic: a concurrent run sees all of it or nothing
		tb.Fatal(err)
	}
	binaries.paths[commit] = path
	return path
}
