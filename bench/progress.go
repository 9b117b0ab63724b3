package bench

import (
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"time"
)

// progress shows what runs: on a terminal one line, rewritten as the load
// generator reports; elsewhere one line per finished endpoint.
type progress struct {
	w     io.Writer
	tty   bool
	label string
	runs  []*Result
	width int
}

func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}

func (p *progress) show(s string) {
	if !p.tty {
		return
	}
	pad := max(p.width-len(s), 0)
	p.width = len(s)
	fmt.Fprintf(p.w, "\r%s%s", s, strings.Repeat(" ", pad))
}

func (p *progress) clear() {
	if p.tty && p.width > 0 {
		fmt.Fprintf(p.w, "\r%s\r", strings.Repeat(" ", p.width))
		p.width = 0
	}
}

// note shows a step that is not a load run.
func (p *progress) note(s string) {
	if p.tty {
		p.show(s + " ...")
		return
	}
	fmt.Fprintln(p.w, s)
}

// start begins a load run of runs.
func (p *progress) start(label string, runs []*Result) {
	p.label, p.runs = label, runs
	p.show(label + " ...")
}

// update shows a progress line of a load child and reports whether line
// was one.
func (p *progress) update(line string) bool {
	rest, ok := strings.CutPrefix(line, progressPrefix)
	if !ok {
		return false
	}
	f := strings.Fields(rest)
	if len(f) != 6 {
		return false
	}
	var v [5]int64
	for i, s := range append(f[:1:1], f[2:]...) {
		n, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			return false
		}
		v[i] = n
	}
	idx, at, total, errs := v[0], time.Duration(v[1]), time.Duration(v[2]), v[4]
	if idx < 0 || int(idx) >= len(p.runs) {
		return false
	}
	phase := "warm-up "
	if f[1] == "measure" {
		phase = ""
	}
	p.show(fmt.Sprintf("%s  %s: %s%.1f/%.1fs, %d errors", p.label, p.runs[idx].Endpoint, phase, at.Seconds(), total.Seconds(), errs))
	return true
}

// done shows the results of the finished load run.
func (p *progress) done() {
	for _, r := range p.runs {
		s := fmt.Sprintf("%s  %-14s %s req/s  p50 %s  p999 %s", p.label, r.Endpoint, fmtCount(r.RPS), fmtLatency(r.Latency.P50), fmtLatency(r.Latency.P999))
		if r.Errors+r.Lost+r.Duplicates > 0 {
			s += fmt.Sprintf("  %d errors, %d lost, %d duplicates (%s)", r.Errors, r.Lost, r.Duplicates, r.FirstError)
		}
		if p.tty {
			p.show(s)
			fmt.Fprintln(p.w)
			p.width = 0
			continue
		}
		fmt.Fprintln(p.w, s)
	}
}
