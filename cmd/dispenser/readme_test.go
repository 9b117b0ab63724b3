package main

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/dispenser-dev/dispenser/snowflake"
	"github.com/dispenser-dev/dispenser/testenv"
)

// TestREADMEDocumentsEveryFlag keeps the documentation true: every flag a
// command takes must appear in the README or a page of docs/.
func TestREADMEDocumentsEveryFlag(t *testing.T) {
	readme := readDocs(t)
	flagName := regexp.MustCompile(`(?m)^  --([a-z0-9-]+)`)
	for _, cmd := range [][]string{
		{"serve"}, {"migrate"}, {"tags", "list"}, {"tags", "create"}, {"tags", "update"}, {"tags", "import"}, {"decode"}, {"bench"},
	} {
		out, _ := runCmd(t, append(cmd, "--help")...)
		names := flagName.FindAllStringSubmatch(out, -1)
		if len(names) == 0 {
			t.Fatalf("%v --help lists no flags:\n%s", cmd, out)
		}
		for _, m := range names {
			if !regexp.MustCompile(`--` + m[1] + `([^a-z0-9-]|$)`).Match(readme) {
				t.Errorf("neither README nor docs/ document %s's flag --%s", strings.Join(cmd, " "), m[1])
			}
		}
	}
}

// readDocs returns the README and every page of docs/, one after the other.
func readDocs(tb testing.TB) []byte {
	tb.Helper()
	pages, err := filepath.Glob("../../docs/*.md")
	if err != nil || len(pages) == 0 {
		tb.Fatalf("no pages in docs/: %v", err)
	}
	var all []byte
	for _, p := range append([]string{"../../README.md"}, pages...) {
		b, err := os.ReadFile(p)
		if err != nil {
			tb.Fatal(err)
		}
		all = append(append(all, b...), '\n')
	}
	return all
}

// TestREADMEExamples runs every shell example of README.md (every line of
// its ```sh blocks) against real workers, with the tools a reader types
// them into: the dispenser binary built with `go build` (for `go run
// ./cmd/dispenser …` and `dispenser …`) and the NATS CLI (`nats …`, at
// natscliVersion). A trailing `# comment` is what the line prints, and is
// checked (readmeOutput says how), so that the README cannot drift from
// the binary again.
//
// The blocks run in order as one reader's session. A line that runs a
// worker (serve: no command, or flags only) starts it in the background
// and waits until its micro service has its endpoints; the `nats` lines
// after it talk to that worker's NATS server. Substitutions, so that the
// test runs beside others: $PG is a throwaway PostgreSQL database, the
// README's nats://127.0.0.1:4222 a test nats-server of its own, and a
// zero-setup worker gets a free port (--nats-listen) and a temporary
// working directory for its data.
func TestREADMEExamples(t *testing.T) {
	readme, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	bin, natsBin := dispenserBinary(t), natsCLI(t)
	version, _, err := runBinary(t, nil, bin, "version")
	if err != nil {
		t.Fatal(err)
	}
	shapes := readmeShapes(strings.Fields(version)[1])
	home := t.TempDir() // the NATS CLI's contexts: none
	natsEnv := []string{"HOME=" + home, "XDG_CONFIG_HOME=" + home}
	var natsURL string // of the last worker started
	pg := ""
	ran := 0
	for i, line := range shellLines(string(readme)) {
		cmdline, comment, _ := strings.Cut(line, " #")
		cmdline, comment = strings.TrimSpace(cmdline), strings.TrimSpace(comment)
		background := strings.HasSuffix(cmdline, "&")
		args, err := shellWords(strings.TrimSuffix(cmdline, "&"))
		if err != nil {
			t.Fatalf("README example %q: %v", line, err)
		}
		name := fmt.Sprintf("%d %s", i, cmdline)
		for j, a := range args {
			switch {
			case a == "$PG":
				if pg == "" {
					pg = testenv.Postgres(t)
				}
				args[j] = pg
			case a == "nats://127.0.0.1:4222":
				ns := testenv.NATS(t)
				args[j] = ns.ClientURL()
			}
		}
		var tool string
		switch {
		case len(args) >= 3 && args[0] == "go" && args[1] == "run" && args[2] == "./cmd/dispenser":
			tool, args = bin, args[3:]
		case args[0] == "dispenser":
			tool, args = bin, args[1:]
		case args[0] == "nats":
			if natsURL == "" {
				t.Fatalf("README example %q: no worker started before it", line)
			}
			tool, args = natsBin, append([]string{"--server", natsURL}, args[1:]...)
		case args[0] == "./test.sh":
			continue // runs the tests, this one among them
		default:
			t.Errorf("README example %q: neither go run ./cmd/dispenser, dispenser nor nats: add it to this test", line)
			continue
		}
		ran++
		if tool == bin && (len(args) == 0 || strings.HasPrefix(args[0], "-")) { // serve: a worker
			dir := t.TempDir()
			url := ""
			for j, a := range args {
				if a == "--nats-url" && j+1 < len(args) {
					url = args[j+1]
				}
			}
			if url == "" {
				listen := freeAddr(t)
				args = append(args, "--nats-listen", listen)
				url = "nats://" + listen
			}
			if !background {
				t.Logf("README example %q: runs a worker, in the background here", line)
			}
			p := startBinary(t, dir, args...)
			p.serviceInfo(t, url, "segment", "snowflake")
			natsURL = url
			if comment != "" {
				t.Errorf("README example %q: a worker prints logs, not %q", line, comment)
			}
			continue
		}
		var env []string
		if tool == natsBin {
			env = natsEnv
		}
		out, errOut, err := runBinary(t, env, tool, args...)
		if err != nil {
			t.Errorf("README example %q: %v\n%s%s", line, err, out, errOut)
			continue
		}
		if problem := readmeOutput(comment, out, shapes); problem != "" {
			t.Errorf("README example %s\nprints:\n%s\n%s", name, strings.TrimRight(out, "\n"), problem)
		}
	}
	if ran < 10 {
		t.Errorf("ran %d README examples: are its ```sh blocks still found?", ran)
	}
}

// shellLines returns the command lines of the ```sh blocks of a Markdown
// text: not blank, not whole-line comments.
func shellLines(md string) []string {
	var lines []string
	in := false
	for _, l := range strings.Split(md, "\n") {
		switch t := strings.TrimSpace(l); {
		case strings.HasPrefix(t, "```"):
			in = !in && t == "```sh"
		case in && t != "" && !strings.HasPrefix(t, "#"):
			lines = append(lines, t)
		}
	}
	return lines
}

// shellWords splits a command line as the shell would, for the quoting the
// README uses: '…', "…" and words.
func shellWords(s string) ([]string, error) {
	var words []string
	var w strings.Builder
	inWord := false
	for i := 0; i < len(s); i++ {
		switch c := s[i]; c {
		case ' ', '\t':
			if inWord {
				words, inWord = append(words, w.String()), false
				w.Reset()
			}
		case '\'', '"':
			j := strings.IndexByte(s[i+1:], c)
			if j < 0 {
				return nil, fmt.Errorf("unclosed %c", c)
			}
			w.WriteString(s[i+1 : i+1+j])
			i += j + 1
			inWord = true
		default:
			w.WriteByte(c)
			inWord = true
		}
	}
	if inWord {
		words = append(words, w.String())
	}
	if len(words) == 0 {
		return nil, errors.New("empty command")
	}
	return words, nil
}

// readmeOutput checks a command's output against the comment the README
// gives it, and returns what is wrong ("" if nothing). A comment is, in
// the order tried:
//
//   - the output itself (its lines joined by spaces), e.g. `# created tag
//     orders: first ID 1, step 1000, ordered no`;
//   - a JSON object, with … for a value that varies;
//   - the output with … for lines left out (`# applied 001_leaf_alloc …
//     applied 005_periodic_tags`);
//   - IDs and ranges (`1`, `2 3 4`, `5-1000 1001-1004`), one per line of
//     output, then optionally a colon or parenthesis and prose;
//   - a description of output that varies (snowflake IDs, tables), one of
//     readmeShapes, checked by shape.
//
// A command without a comment must print nothing.
func readmeOutput(comment, out string, shapes map[string]func(string) string) string {
	lines := strings.Fields(strings.TrimSpace(strings.ReplaceAll(out, "\n", " \n ")))
	joined := strings.Join(strings.Fields(out), " ")
	if comment == "" {
		if strings.TrimSpace(out) != "" {
			return "want no output (the README shows none)"
		}
		return ""
	}
	if comment == joined {
		return ""
	}
	if strings.HasPrefix(comment, "{") {
		pat := regexp.QuoteMeta(comment)
		pat = strings.ReplaceAll(pat, `"…"`, `"[^"]*"`)
		pat = strings.ReplaceAll(pat, `…`, `[^,}]*`)
		if !regexp.MustCompile(`^` + pat + `$`).MatchString(strings.TrimSpace(out)) {
			return "want JSON of the shape " + comment
		}
		return ""
	}
	if strings.Contains(comment, "…") {
		pat := strings.ReplaceAll(regexp.QuoteMeta(comment), "…", ".*")
		if !regexp.MustCompile(`^` + pat + `$`).MatchString(joined) {
			return "want " + comment + ", … standing for lines left out"
		}
		return ""
	}
	if m := readmeIDs.FindStringSubmatch(comment); m != nil {
		want := strings.Fields(m[1])
		var got []string
		for _, l := range lines {
			if l != "\n" {
				got = append(got, l)
			}
		}
		if !slices.Equal(got, want) {
			return fmt.Sprintf("want %q, one per line", want)
		}
		return ""
	}
	check, ok := shapes[comment]
	if !ok {
		return fmt.Sprintf("the comment %q is neither the output, JSON, IDs nor a description this test knows (readmeShapes)", comment)
	}
	return check(out)
}

// readmeIDs is a comment that lists IDs and ranges, then maybe prose.
var readmeIDs = regexp.MustCompile(`^((?:\d+(?:-\d+)? ?)+)(?:$|[:(,] ?)`)

// readmeShapes are the README's descriptions of output that varies from
// run to run, each with a check of the output's shape; version is what
// the binary's `version` prints.
func readmeShapes(version string) map[string]func(out string) string {
	return map[string]func(out string) string{
		"a snowflake ID":      snowflakeIDs(1),
		"three snowflake IDs": snowflakeIDs(3),
		"the dispenser service and its workers": func(out string) string {
			if !regexp.MustCompile(`│ dispenser +│ ` + regexp.QuoteMeta(version) + ` +│ \w+ +│ Unique 64-bit IDs`).MatchString(out) {
				return "want a table with a row: dispenser, version " + version + ", the worker's ID, the description"
			}
			return ""
		},
		"requests, errors and times per endpoint": func(out string) string {
			for _, want := range []string{"Requests", "Errors", "Processing Time", "segment", "snowflake"} {
				if !strings.Contains(out, want) {
					return "want a table with " + want
				}
			}
			return ""
		},
		"and per tag its buffers, step and fetches": func(out string) string {
			for _, want := range []string{`"tag": "orders"`, `"step"`, `"fetches"`, `"current"`} {
				if !strings.Contains(out, want) {
					return "want the endpoints' data with " + want
				}
			}
			return ""
		},
	}
}

// snowflakeIDs checks n snowflake IDs of the default layout and epoch,
// increasing, issued within the last hour.
func snowflakeIDs(n int) func(string) string {
	return func(out string) string {
		f := strings.Fields(out)
		if len(f) != n {
			return fmt.Sprintf("want %d snowflake IDs, one per line", n)
		}
		var last int64 = -1
		for _, s := range f {
			id, err := strconv.ParseInt(s, 10, 64)
			if err != nil || id <= last {
				return fmt.Sprintf("%q: want increasing decimal IDs", s)
			}
			last = id
			if at := snowflake.Decode(id, time.Time{}).Time; time.Since(at) > time.Hour || time.Until(at) > time.Second {
				return fmt.Sprintf("%d was issued at %v, not now", id, at)
			}
		}
		return ""
	}
}
