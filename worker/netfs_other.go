//go:build !linux

package worker

// networkFS says whether dir is on a network file system: not known on
// this platform (docs/operations.md: keep the data directory on a local
// disk).
func networkFS(string) (string, bool) { return "", false }
