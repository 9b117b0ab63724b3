// Package buildinfo is the one version of a dispenser binary: what
// `dispenser version` and `--version` print, what the micro service
// reports ($SRV.INFO, `nats micro ls`) and what the status page shows.
//
// The version comes from, in this order: the linker flag
// `-ldflags "-X github.com/dispenser-dev/dispenser/internal/buildinfo.version=1.2.3"`
// (a release build; the Dockerfile's VERSION build argument names the
// same), the main module's version the Go toolchain recorded (v1.2.3 for
// `go install …@v1.2.3`, a pseudo-version such as
// v0.0.0-20261128061214-e810de8a0b1c+dirty for `go build` in a
// checkout), or 0.0.0-devel (a test binary, or a build without VCS
// information), with the VCS revision as build metadata when it is
// known. It is always a semantic version without the leading "v", as the
// micro service requires.
package buildinfo

import (
	"regexp"
	"runtime/debug"
	"strings"
	"sync"
)

// version is set at link time (-X) by a release build; empty otherwise.
var version string

// Info is what the build recorded.
type Info struct {
	// Version is a semantic version (no leading "v").
	Version string
	// Revision is the VCS revision built from; empty if unknown.
	Revision string
	// Time is the revision's commit time (RFC 3339); empty if unknown.
	Time string
	// Modified says whether the work tree had uncommitted changes.
	Modified bool
	// GoVersion is the Go toolchain that built the binary.
	GoVersion string
}

var (
	once sync.Once
	info Info
)

// Get returns the binary's build information.
func Get() Info {
	once.Do(func() {
		bi, ok := debug.ReadBuildInfo()
		if !ok {
			bi = &debug.BuildInfo{}
		}
		info = fromBuild(version, bi)
	})
	return info
}

// Version returns the binary's version (Get().Version).
func Version() string { return Get().Version }

// semVer is the semantic version grammar (semver.org), as the micro
// service checks it.
var semVer = regexp.MustCompile(`^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(?:-((?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(?:\.(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*))?(?:\+([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?$`)

// ValidVersion reports whether v is a semantic version without a leading
// "v".
func ValidVersion(v string) bool { return semVer.MatchString(v) }

// fromBuild works out the Info of a binary linked with the -X value
// linked and the build information bi.
func fromBuild(linked string, bi *debug.BuildInfo) Info {
	in := Info{GoVersion: bi.GoVersion}
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs.revision":
			in.Revision = s.Value
		case "vcs.time":
			in.Time = s.Value
		case "vcs.modified":
			in.Modified = s.Value == "true"
		}
	}
	for _, v := range []string{linked, bi.Main.Version} {
		if v = strings.TrimPrefix(v, "v"); ValidVersion(v) {
			in.Version = v
			return in
		}
	}
	// "(devel)", empty (a test binary) or a linked value that is no
	// semantic version.
	in.Version = "0.0.0-devel"
	if in.Revision != "" {
		in.Version += "+" + short(in.Revision)
		if in.Modified {
			in.Version += ".dirty"
		}
	}
	return in
}

// short is the first 12 characters of a revision.
func short(rev string) string {
	if len(rev) > 12 {
		return rev[:12]
	}
	return rev
}
