package tagmodel

import (
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/dispenser-dev/dispenser/protocol"
)

// MaxFormatted is the most bytes one formatted number may take, and
// MaxTemplate the most bytes a format template may have.
const (
	MaxFormatted = protocol.MaxFormattedBytes
	MaxTemplate  = 64
)

// Format is a tag's number format, parsed from a template such as
// "ORD-{date:20060102}-{seq:6}": literal text, the period's date in a Go
// time layout ({date:LAYOUT}, only for a tag with a reset period, which
// must have one) and, last, the number ({seq}, or {seq:N} zero-padded to N
// digits; a number longer than N keeps all its digits, it never wraps).
//
// A format never changes uniqueness: everything before the number is the
// same for all numbers of one period, has the same length in every period,
// and differs between any two periods of years 0000 to 9999, in every time
// zone (ParseFormat proves it: checkDateLayout), so a formatted string
// names one period and one number. ApplyUpdate keeps it true across
// changes of the tag's settings (formatChange).
type Format struct {
	template string
	before   []part // everything before {seq}
	width    int    // {seq:N}'s N; 0: no padding
	reset    Reset
	loc      *time.Location
	headLen  int // length of Head's result, the same in every period
}

// part is a literal (date == false) or the period's date in layout text.
type part struct {
	text string
	date bool
}

// ParseFormat parses a template for a tag with reset period r in loc.
// Errors wrap ErrInvalidArgument.
func ParseFormat(template string, r Reset, loc *time.Location) (*Format, error) {
	bad := func(why string, args ...any) error {
		return fmt.Errorf("%w: format %q: %s", ErrInvalidArgument, template, fmt.Sprintf(why, args...))
	}
	if len(template) > MaxTemplate {
		return nil, bad("longer than %d bytes", MaxTemplate)
	}
	f := &Format{template: template, reset: r, loc: loc, width: -1}
	rest := template
	dates := 0
	for rest != "" {
		if f.width >= 0 {
			return nil, bad("{seq} must come last")
		}
		open := strings.IndexByte(rest, '{')
		if open != 0 {
			lit := rest
			if open > 0 {
				lit = rest[:open]
			}
			if err := checkLiteral(lit); err != nil {
				return nil, bad("%v", err)
			}
			f.before = append(f.before, part{text: lit})
			rest = rest[len(lit):]
			continue
		}
		end := strings.IndexByte(rest, '}')
		if end < 0 {
			return nil, bad("a { without }")
		}
		field, arg, hasArg := strings.Cut(rest[1:end], ":")
		rest = rest[end+1:]
		switch field {
		case "seq":
			f.width = 0
			if hasArg {
				n, err := strconv.Atoi(arg)
				if err != nil || n < 1 || n > 19 {
					return nil, bad("{seq:%s}: want a width of 1 to 19 digits", arg)
				}
				f.width = n
			}
		case "date":
			if r == ResetNone {
				return nil, bad("{date} needs a reset period (day, month or year): the date printed is the period's")
			}
			if !hasArg || arg == "" {
				return nil, bad("{date:LAYOUT}: want a Go time layout such as 20060102")
			}
			if err := checkLiteral(arg); err != nil {
				return nil, bad("{date:%s}: %v", arg, err)
			}
			if err := checkDateLayout(arg, r); err != nil {
				return nil, bad("{date:%s}: %v", arg, err)
			}
			dates++
			f.before = append(f.before, part{text: arg, date: true})
		default:
			return nil, bad("unknown field {%s}: want {date:LAYOUT} or {seq[:N]}", rest[:0]+field)
		}
	}
	switch {
	case f.width < 0:
		return nil, bad("no {seq}")
	case dates > 1:
		return nil, bad("{date} more than once")
	case r != ResetNone && dates == 0:
		return nil, bad("a tag with a reset period needs {date:LAYOUT}: without it, the numbers of two periods would read alike")
	}
	f.headLen = len(f.Head(time.Date(2026, 1, 1, 0, 0, 0, 0, loc)))
	if f.headLen+max(f.width, 19) > MaxFormatted {
		return nil, bad("a formatted number could take more than %d bytes", MaxFormatted)
	}
	return f, nil
}

// checkLiteral accepts printable ASCII without space, braces or a
// backslash, so that a formatted number is one token of one line.
func checkLiteral(s string) error {
	for i := range len(s) {
		if c := s[i]; c <= ' ' || c > '~' || c == '{' || c == '}' || c == '\\' {
			return fmt.Errorf("character %q: want printable ASCII without space, braces or backslash", c)
		}
	}
	return nil
}

// String returns the template.
func (f *Format) String() string { return f.template }

// HeadLen is the length of every Head: a formatted number takes at most
// HeadLen plus max(width, 19) bytes.
func (f *Format) HeadLen() int { return f.headLen }

// Head returns what comes before the number in the period starting at
// start (in the tag's time zone).
func (f *Format) Head(start time.Time) string {
	var b strings.Builder
	for _, p := range f.before {
		if p.date {
			b.WriteString(start.In(f.loc).Format(p.text))
		} else {
			b.WriteString(p.text)
		}
	}
	return b.String()
}

// AppendNumber appends head and seq, zero-padded to the format's width.
func (f *Format) AppendNumber(dst []byte, head string, seq int64) []byte {
	dst = append(dst, head...)
	var digits [20]byte
	d := strconv.AppendInt(digits[:0], seq, 10)
	for range f.width - len(d) {
		dst = append(dst, '0')
	}
	return append(dst, d...)
}
