package buildinfo

import (
	"runtime/debug"
	"testing"
)

func TestFromBuild(t *testing.T) {
	rev := []debug.BuildSetting{{Key: "vcs.revision", Value: "e810de8a0b1c2d3e4f5a6b7c8d9e0f1a2b3c4d5e"}, {Key: "vcs.time", Value: "2026-11-28T06:00:00Z"}}
	dirty := append(rev[:2:2], debug.BuildSetting{Key: "vcs.modified", Value: "true"})
	for _, tc := range []struct {
		name     string
		linked   string
		main     string
		settings []debug.BuildSetting
		want     string
	}{
		{"test binary", "", "", nil, "0.0.0-devel"},
		{"devel without VCS", "", "(devel)", nil, "0.0.0-devel"},
		{"devel with VCS", "", "(devel)", rev, "0.0.0-devel+e810de8a0b1c"},
		{"devel modified", "", "(devel)", dirty, "0.0.0-devel+e810de8a0b1c.dirty"},
		{"go install of a tag", "", "v1.2.3", rev, "1.2.3"},
		{"pseudo-version of a checkout", "", "v0.0.0-20261128060000-e810de8a0b1c+dirty", dirty, "0.0.0-20261128060000-e810de8a0b1c+dirty"},
		{"linked wins", "v1.4.0", "(devel)", rev, "1.4.0"},
		{"linked without v", "1.4.0-rc.1", "v0.0.0-20261128060000-e810de8a0b1c", rev, "1.4.0-rc.1"},
		{"linked not semver", "latest", "(devel)", rev, "0.0.0-devel+e810de8a0b1c"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := fromBuild(tc.linked, &debug.BuildInfo{Main: debug.Module{Version: tc.main}, Settings: tc.settings})
			if got.Version != tc.want {
				t.Errorf("version = %q, want %q", got.Version, tc.want)
			}
			if !ValidVersion(got.Version) {
				t.Errorf("version %q is no semantic version: the micro service would refuse it", got.Version)
			}
		})
	}
}
