package segment

import (
	"context"
	"fmt"
	"github.com/dispenser-dev/dispenser/tagmodel"
	"slices"
	"sync/atomic"
	"time"
)

// ErrNoFormat means a request asked for formatted numbers of a tag that
// has no format (Tag.Format).
var ErrNoFormat = fmt.Errorf("%w: the tag has no format (dispenser tags update TAG --format TEMPLATE)", tagmodel.ErrInvalidArgument)

// tagSpec is what a tag's settings say about serving it beyond its step:
// its reset period, time zone and format. A buffer's spec is set before the
// buffer is in the tag map and never changes; a change of the settings
// drops the buffer (apply), so that the next request looks the tag up.
type tagSpec struct {
	reset    tagmodel.Reset
	loc      *time.Location
	template string           // Tag.Format as stored
	format   *tagmodel.Format // nil: no format, or one this worker cannot prove (formatErr)
	// formatErr refuses formatted numbers of a tag whose stored format
	// ParseFormat refuses (written by an older version: see newSpec).
	formatErr error
	// head is the format's Head of a tag without a reset period (no date:
	// the same for every number).
	head string
	// period is the period last served, a tag with a reset period only.
	period atomic.Pointer[periodState]
}

// periodState is one period of a tag with a reset period, as served.
type periodState struct {
	tagmodel.Period
	name       string // PeriodName(tag, Key): its buffer's and row's name
	head       string // the format's Head for the period; "" without format
	start, end int64  // Start and End in UnixNano
}

// newSpec returns the spec of t, nil for a tag without reset period or
// format (most tags). A tag whose settings do not pass Tag.Periodic (a
// store changed by hand) is an error.
//
// A stored format that ParseFormat refuses is not: it was written by an
// older version, which checked less (issue 34: {date:Mon0102} repeats
// after six years, {date:2006-01-_2} prints a space). A format changes
// how numbers are written, never which numbers are handed out, so the
// tag's plain numbers are served as before, and its formatted numbers are
// refused (formatErr) rather than printed in a text this worker cannot
// prove unique. The way out is a new tag with an accepted format: the
// format of a tag can only be changed in the width of {seq}
// (ApplyUpdate).
func newSpec(t tagmodel.Tag) (*tagSpec, error) {
	if t.Reset == tagmodel.ResetNone && t.Format == "" && t.TimeZone == "" {
		return nil, nil
	}
	unformatted := t
	unformatted.Format = ""
	p, err := unformatted.Periodic()
	if err != nil {
		return nil, err
	}
	s := &tagSpec{reset: p.Reset, loc: p.Location, template: t.Format}
	if t.Format != "" {
		if s.format, err = tagmodel.ParseFormat(t.Format, p.Reset, p.Location); err != nil {
			s.formatErr = fmt.Errorf("%w; its formatted numbers are refused (its plain ones are served): create a new tag with a format that tags create accepts", err)
		}
	}
	if s.format != nil && s.reset == tagmodel.ResetNone {
		s.head = s.format.Head(time.Time{})
	}
	return s, nil
}

// same reports whether t's settings are those of s (nil: none).
func (s *tagSpec) same(t tagmodel.Tag) bool {
	if s == nil {
		return t.Reset == tagmodel.ResetNone && t.Format == "" && t.TimeZone == ""
	}
	return s.reset == t.Reset && s.template == t.Format && s.loc.String() == cmpOr(t.TimeZone, "UTC")
}

func cmpOr(a, b string) string {
	if a == "" {
		return b
	}
	return a
}

// periodic reports whether s is the spec of a tag with a reset period.
func (s *tagSpec) periodic() bool { return s != nil && s.reset != tagmodel.ResetNone }

// at returns the period of tag that holds now.
func (s *tagSpec) at(tag string, now time.Time) *periodState {
	t := now.UnixNano()
	if ps := s.period.Load(); ps != nil && t >= ps.start && t < ps.end {
		return ps
	}
	p := s.reset.PeriodAt(now, s.loc)
	ps := &periodState{Period: p, name: tagmodel.PeriodName(tag, p.Key), start: p.Start.UnixNano(), end: p.End.UnixNano()}
	if s.format != nil {
		ps.head = s.format.Head(p.Start)
	}
	s.period.Store(ps)
	return ps
}

// Numbering writes numbers out as a tag's format says, for one period.
type Numbering struct {
	format *tagmodel.Format
	head   string
}

// Append appends the IDs of runs to dst, formatted, one per line.
func (n Numbering) Append(dst []byte, runs []Run) []byte {
	first := true
	for _, r := range runs {
		for id := r.First; ; id++ {
			if !first {
				dst = append(dst, '\n')
			}
			first = false
			dst = n.format.AppendNumber(dst, n.head, id)
			if id == r.Last {
				break
			}
		}
	}
	return dst
}

// Valid reports whether n can format numbers.
func (n Numbering) Valid() bool { return n.format != nil }

// numbering returns the numbering of a take from b (the tag's buffer, not a
// period's) in period ps (nil: a tag without periods), or ErrNoFormat.
func numbering(b *buffer, ps *periodState) (Numbering, error) {
	if b.spec != nil && b.spec.formatErr != nil {
		return Numbering{}, fmt.Errorf("tag %q: %w", b.tag, b.spec.formatErr)
	}
	if b.spec == nil || b.spec.format == nil {
		return Numbering{}, fmt.Errorf("%w: %q", ErrNoFormat, b.tag)
	}
	if ps != nil {
		return Numbering{format: b.spec.format, head: ps.head}, nil
	}
	return Numbering{format: b.spec.format, head: b.spec.head}, nil
}

// TakeNowNumbered is TakeNow for a request for formatted numbers
// (Id-Format: formatted): it also returns how to write the IDs out, in the
// tag's format and for the period they were taken in; for a Pending, its
// Numbering once Wait has returned. A tag without a format is ErrNoFormat
// (from Pending.Wait if the tag was not known yet); an ordered tag,
// ErrOrdered.
func (a *Allocator) TakeNowNumbered(tag string, n int, dst []Run) ([]Run, Numbering, *Pending, error) {
	if n < 1 {
		return dst, Numbering{}, nil, fmt.Errorf("%w: %d", ErrInvalidCount, n)
	}
	b := a.tags.get(tag)
	if b == nil {
		return dst, Numbering{}, &Pending{a: a, tag: tag, n: n, deadline: a.deadline(), numbered: true}, nil
	}
	if b.ordered.Load() {
		return dst, Numbering{}, nil, ErrOrdered
	}
	var ps *periodState
	pb := b
	if b.spec.periodic() {
		ps, pb = a.periodBuffer(b)
	}
	num, err := numbering(b, ps)
	if err != nil {
		return dst, Numbering{}, nil, err
	}
	var rest int
	if dst, rest = pb.take(n, dst); rest == 0 {
		return dst, num, nil, nil
	}
	return dst, num, &Pending{a: a, b: pb, tag: pb.tag, n: rest, runs: slices.Clone(dst), deadline: a.deadline(), numbered: true, num: num}, nil
}

// Numbering returns how to write out the IDs Wait returned, for a Pending
// of TakeNowNumbered.
func (p *Pending) Numbering() Numbering { return p.num }

// periodBuffer returns the period of b's tag (a tag with a reset period)
// that holds now, and its buffer, added if missing: a period's buffer is
// added without asking the store (its first fetch creates the period's row
// or finds it).
func (a *Allocator) periodBuffer(b *buffer) (*periodState, *buffer) {
	if !b.used.Load() {
		b.used.Store(true) // the tag is in use: keep its spec
	}
	ps := b.spec.at(b.tag, a.now())
	if pb := a.tags.get(ps.name); pb != nil {
		return ps, pb
	}
	return ps, a.addTag(tagmodel.Tag{Name: ps.name}, nil)
}

// takePeriodSlow is takeSlow's part for a tag with a reset period: it
// serves the period that holds now from its own buffer.
func (a *Allocator) takePeriodSlow(ctx context.Context, b *buffer, n int, dst []Run, deadline time.Time, p *Pending) ([]Run, error) {
	ps, pb := a.periodBuffer(b)
	if p != nil && p.numbered {
		num, err := numbering(b, ps)
		if err != nil {
			return dst, err
		}
		p.num = num
	}
	dst, rest := pb.take(n, dst)
	if rest == 0 {
		return dst, nil
	}
	return a.wait(ctx, pb, rest, dst, deadline, false)
}

// parentTag returns the tag of a period name, or name itself.
func parentTag(name string) string {
	if tag, _, ok := tagmodel.SplitPeriodName(name); ok {
		return tag
	}
	return name
}
