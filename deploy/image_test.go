package deploy

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"encoding/json"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// podman runs podman on storage of its own under a temporary directory
// (vfs: no overlay or fuse needed), so that tests share no state with the
// machine's images or with each other.
type podman struct {
	tb   testing.TB
	path string
	args []string
}

func newPodman(tb testing.TB) *podman {
	tb.Helper()
	path := tool(tb, "podman", "podman")
	dir := tb.TempDir()
	p := &podman{tb: tb, path: path, args: []string{
		"--root", filepath.Join(dir, "root"), "--runroot", filepath.Join(dir, "runroot"),
		"--storage-driver", "vfs", "--events-backend", "none",
	}}
	tb.Cleanup(func() {
		// Layers of vfs are plain directories; removing the images first
		// leaves nothing mounted in the temporary directory.
		exec.Command(path, append(p.args, "rmi", "--all", "--force")...).Run()
	})
	return p
}

func (p *podman) run(args ...string) string {
	p.tb.Helper()
	return run(p.tb, "", p.path, append(p.args, args...)...)
}

// TestImage builds the binary (CGO_ENABLED=0) and the image of the
// repository's Dockerfile, with its .containerignore, from a context that
// also holds files that must stay out, then checks the image: non-root
// user, entrypoint, ports, labels, size, and files: exactly the binary just
// built and /data owned by the user.
func TestImage(t *testing.T) {
	p := newPodman(t)
	ctx := t.TempDir()
	bin := filepath.Join(ctx, "bin", "dispenser")
	build := exec.Command("go", "build", "-o", bin, "./cmd/dispenser")
	build.Dir = ".."
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	for _, f := range []string{"Dockerfile", ".containerignore", "deploy/image/data/README", "go.mod"} {
		copyFile(t, filepath.Join("..", f), filepath.Join(ctx, f))
	}
	copyFile(t, "../go.mod", filepath.Join(ctx, "bin", "stray")) // must stay out
	// The build arguments the Dockerfile's comment gives: the version
	// the binary prints and the revision.
	version := strings.Fields(run(t, "", bin, "version"))[1]
	revision := strings.TrimSpace(run(t, "", "git", "rev-parse", "HEAD"))
	p.run("build", "--quiet", "-t", "localhost/dispenser-test", "--build-arg", "VERSION="+version, "--build-arg", "REVISION="+revision, ctx)

	var inspect []struct {
		Size   int64
		Config struct {
			User         string
			Entrypoint   []string
			Cmd          []string
			ExposedPorts map[string]struct{}
			Labels       map[string]string
		}
	}
	if err := json.Unmarshal([]byte(p.run("image", "inspect", "localhost/dispenser-test")), &inspect); err != nil || len(inspect) != 1 {
		t.Fatalf("podman image inspect: %v, %d images", err, len(inspect))
	}
	img := inspect[0]
	if u := img.Config.User; u == "" || u == "0" || strings.HasPrefix(u, "0:") || strings.HasPrefix(u, "root") {
		t.Errorf("user %q, want a non-root numeric user", u)
	}
	if img.Config.User != "65532:65532" {
		t.Errorf("user %q, want 65532:65532 (the owner of /data)", img.Config.User)
	}
	if !slices.Equal(img.Config.Entrypoint, []string{"/dispenser"}) {
		t.Errorf("entrypoint %q, want [/dispenser]", img.Config.Entrypoint)
	}
	if _, ok := img.Config.ExposedPorts["4222/tcp"]; !ok || len(img.Config.ExposedPorts) != 1 {
		t.Errorf("exposed ports %v, want 4222/tcp only", img.Config.ExposedPorts)
	}
	if !slices.Contains(img.Config.Cmd, "0.0.0.0:4222") {
		t.Errorf("cmd %q does not listen on 0.0.0.0:4222, the exposed port", img.Config.Cmd)
	}
	for _, l := range []string{"title", "source", "description"} {
		if img.Config.Labels["org.opencontainers.image."+l] == "" {
			t.Errorf("no label org.opencontainers.image.%s in %v", l, img.Config.Labels)
		}
	}
	for l, want := range map[string]string{"version": version, "revision": revision} {
		if got := img.Config.Labels["org.opencontainers.image."+l]; got != want {
			t.Errorf("label org.opencontainers.image.%s = %q, want %q", l, got, want)
		}
	}
	want, err := os.ReadFile(bin)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("image %d bytes (%.1f MiB), binary %d bytes", img.Size, float64(img.Size)/(1<<20), len(want))
	// The binary and a few KB of metadata: a megabyte more means something
	// else got in (the context, a base image).
	if limit := int64(len(want)) + 1<<20; img.Size > limit {
		t.Errorf("image is %d bytes, the binary %d: more than 1 MiB besides the binary", img.Size, len(want))
	}

	files := imageFiles(t, p)
	var names []string
	for n := range files {
		names = append(names, n)
	}
	slices.Sort(names)
	if !slices.Equal(names, []string{"data", "data/README", "dispenser"}) {
		t.Errorf("image files %q, want data, data/README, dispenser", names)
	}
	if f := files["dispenser"]; f == nil || !bytes.Equal(f.data, want) {
		t.Errorf("/dispenser in the image is not the binary just built")
	} else if f.hdr.Mode&0o111 == 0 {
		t.Errorf("/dispenser mode %o, not executable", f.hdr.Mode)
	}
	if d := files["data"]; d == nil || d.hdr.Typeflag != tar.TypeDir || d.hdr.Uid != 65532 || d.hdr.Gid != 65532 {
		t.Errorf("/data is not a directory owned by 65532:65532: %+v", d)
	}
}

type imageFile struct {
	hdr  *tar.Header
	data []byte
}

// imageFiles saves the test image as an OCI archive and reads its layers:
// no container is run (none can be here), and this works without root.
func imageFiles(tb testing.TB, p *podman) map[string]*imageFile {
	tb.Helper()
	archive := filepath.Join(tb.TempDir(), "image.tar")
	p.run("save", "--format", "oci-archive", "-o", archive, "localhost/dispenser-test")
	blobs := map[string][]byte{}
	var index []byte
	forTar(tb, mustOpen(tb, archive), func(h *tar.Header, data []byte) {
		if d, ok := strings.CutPrefix(h.Name, "blobs/sha256/"); ok {
			blobs["sha256:"+d] = data
		} else if h.Name == "index.json" {
			index = data
		}
	})
	var idx struct{ Manifests []struct{ Digest string } }
	var man struct {
		Layers []struct{ MediaType, Digest string }
	}
	if err := json.Unmarshal(index, &idx); err != nil || len(idx.Manifests) != 1 {
		tb.Fatalf("index.json: %v: %s", err, index)
	}
	if err := json.Unmarshal(blobs[idx.Manifests[0].Digest], &man); err != nil {
		tb.Fatalf("manifest: %v", err)
	}
	files := map[string]*imageFile{}
	for _, l := range man.Layers {
		var r io.Reader = bytes.NewReader(blobs[l.Digest])
		if strings.HasSuffix(l.MediaType, "gzip") {
			zr, err := gzip.NewReader(r)
			if err != nil {
				tb.Fatal(err)
			}
			r = zr
		}
		forTar(tb, r, func(h *tar.Header, data []byte) {
			files[strings.Trim(strings.TrimPrefix(h.Name, "./"), "/")] = &imageFile{h, data}
		})
	}
	return files
}

func forTar(tb testing.TB, r io.Reader, f func(*tar.Header, []byte)) {
	tb.Helper()
	tr := tar.NewReader(r)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return
		}
		if err != nil {
			tb.Fatal(err)
		}
		data, err := io.ReadAll(tr)
		if err != nil {
			tb.Fatal(err)
		}
		f(h, data)
	}
}

func mustOpen(tb testing.TB, name string) io.Reader {
	tb.Helper()
	data, err := os.ReadFile(name)
	if err != nil {
		tb.Fatal(err)
	}
	return bytes.NewReader(data)
}

func copyFile(tb testing.TB, from, to string) {
	tb.Helper()
	data, err := os.ReadFile(from)
	if err != nil {
		tb.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Dir(to), 0o755); err != nil {
		tb.Fatal(err)
	}
	if err := os.WriteFile(to, data, 0o644); err != nil {
		tb.Fatal(err)
	}
}
