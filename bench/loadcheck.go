package bench

import (
	"bytes"
	"fmt"
	"math"
	"slices"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"
)

// slotOf returns the slot number at the end of a reply subject.
func slotOf(subject string) (int, bool) {
	i := len(subject)
	for i > 0 && subject[i-1] >= '0' && subject[i-1] <= '9' {
		i--
	}
	if i == len(subject) || len(subject)-i > 9 {
		return 0, false
	}
	n := 0
	for _, c := range []byte(subject[i:]) {
		n = n*10 + int(c-'0')
	}
	return n, true
}

// check checks a reply and returns how many IDs it holds. Every reply is
// checked for error headers and for the number of IDs asked for. Range
// replies and single IDs are parsed completely; a long list is parsed
// completely only with Verify, else its lines are counted and its first and
// last ID parsed, so that the load generator keeps up with tens of millions
// of IDs a second.
func (l *loader) check(m *nats.Msg) (int, error) {
	if len(m.Header) > 0 {
		if code := m.Header.Get(micro.ErrorCodeHeader); code != "" {
			return 0, fmt.Errorf("%w %s: %s", errErrorReply, code, m.Header.Get(micro.ErrorHeader))
		}
		if st := m.Header.Get("Status"); st != "" { // 503: no responders
			return 0, fmt.Errorf("%w: status %s %s", errErrorReply, st, m.Header.Get("Description"))
		}
	}
	body, want := m.Data, l.cfg.Batch
	if l.cfg.Format == "range" {
		got := 0
		for line := range bytes.SplitSeq(body, []byte{'\n'}) {
			a, b, ok := bytes.Cut(line, []byte{'-'})
			first, ok1 := parseID(a)
			last, ok2 := parseID(b)
			if !ok || !ok1 || !ok2 || last < first || last-first >= int64(want) {
				return 0, fmt.Errorf("%w: %q is not a range", errBadReply, truncateBytes(line))
			}
			got += int(last - first + 1)
			l.saw(first, last)
		}
		if got != want {
			return 0, fmt.Errorf("%w: %d IDs in ranges, want %d", errBadReply, got, want)
		}
		return got, nil
	}
	if !l.cfg.Verify && want > 2 {
		if n := bytes.Count(body, []byte{'\n'}) + 1; n != want {
			return 0, fmt.Errorf("%w: %d lines, want %d", errBadReply, n, want)
		}
		i, j := bytes.IndexByte(body, '\n'), bytes.LastIndexByte(body, '\n')
		first, ok1 := parseID(body[:i])
		last, ok2 := parseID(body[j+1:])
		if !ok1 || !ok2 || last <= first {
			return 0, fmt.Errorf("%w: list from %q to %q", errBadReply, truncateBytes(body[:i]), truncateBytes(body[j+1:]))
		}
		return want, nil
	}
	got := 0
	for line := range bytes.SplitSeq(body, []byte{'\n'}) {
		id, ok := parseID(line)
		if !ok {
			return 0, fmt.Errorf("%w: %q is not an ID", errBadReply, truncateBytes(line))
		}
		got++
		l.saw(id, id)
	}
	if got != want {
		return 0, fmt.Errorf("%w: %d IDs, want %d", errBadReply, got, want)
	}
	return got, nil
}

// saw notes IDs first..last of the reply being checked, for the duplicate
// check (Verify only).
func (l *loader) saw(first, last int64) {
	if !l.cfg.Verify {
		return
	}
	if n := len(l.reply); n > 0 && l.reply[n-1].Last+1 == first {
		l.reply[n-1].Last = last
	} else {
		l.reply = append(l.reply, segmentRun{first, last})
	}
}

// parseID parses a positive decimal int64.
func parseID(b []byte) (int64, bool) {
	if len(b) == 0 || len(b) > 19 {
		return 0, false
	}
	var n uint64
	for _, c := range b {
		if c < '0' || c > '9' {
			return 0, false
		}
		n = n*10 + uint64(c-'0')
	}
	if n == 0 || n > math.MaxInt64 {
		return 0, false
	}
	return int64(n), true
}

func truncateBytes(b []byte) string {
	if len(b) > 40 {
		return string(b[:40]) + "..."
	}
	return string(b)
}

// mergeRuns sorts runs and merges them into disjoint runs, returning those
// and how many IDs were covered more than once.
func mergeRuns(runs []segmentRun) ([]segmentRun, uint64) {
	runs = slices.Clone(runs)
	slices.SortFunc(runs, func(a, b segmentRun) int {
		if a.First != b.First {
			if a.First < b.First {
				return -1
			}
			return 1
		}
		if a.Last < b.Last {
			return -1
		}
		if a.Last > b.Last {
			return 1
		}
		return 0
	})
	var out []segmentRun
	var dups uint64
	for _, r := range runs {
		n := len(out)
		if n == 0 || r.First > out[n-1].Last+1 {
			out = append(out, r)
			continue
		}
		last := &out[n-1]
		if r.First <= last.Last { // overlap
			dups += uint64(min(r.Last, last.Last) - r.First + 1)
		}
		last.Last = max(last.Last, r.Last)
	}
	return out, dups
}
