package tagmodel

import (
	"fmt"
	"strings"
	"unicode/utf8"
)

// The one validator of a tag: Check for a tag as it is created, Update.Check
// for the fields an update sets (before the stored tag is read), and
// ApplyUpdate for the tag as updated (its reset settings, by Periodic).
// Stores call these and nothing else, so that every store refuses the same
// tags with the same errors and changes nothing.

// Check checks a tag as CreateTag takes it: its name (CheckTag), its step
// (1..MaxStepLimit: ErrInvalidStep), its description (UTF-8 text without
// NUL of at most MaxDescription characters: ErrInvalidArgument), its first
// ID MaxID (at least 1: ErrInvalidArgument) and its reset settings
// (Periodic). It returns the reset settings read.
func (t Tag) Check() (Periodic, error) {
	if err := checkFields(t.Name, &t.Step, &t.Description); err != nil {
		return Periodic{}, err
	}
	if t.MaxID < 1 {
		return Periodic{}, fmt.Errorf("%q: %w: start %d, want at least 1", t.Name, ErrInvalidArgument, t.MaxID)
	}
	if err := checkOrderedFormat(t); err != nil {
		return Periodic{}, err
	}
	return t.Periodic()
}

// checkOrderedFormat refuses a tag that is ordered and has a format: an
// ordered tag has no formatted numbers (a worker answers Id-Format:
// formatted for it with 400), so the format would be accepted and never
// served. Tag.Check calls it, and ApplyUpdate for an update that sets
// either (a tag stored with both by an older version keeps taking other
// changes, and may drop its order). Errors wrap ErrInvalidArgument.
func checkOrderedFormat(t Tag) error {
	if t.Ordered && t.Format != "" {
		return fmt.Errorf("%q: %w: an ordered tag has no formatted numbers, so format %s would never be served: "+
			"give formats to plain tags (--ordered=false), and order to tags without a format", t.Name, ErrInvalidArgument, t.Format)
	}
	return nil
}

// Check checks the name of the tag u changes and the step and description
// u sets, as Tag.Check does; fields u leaves as they are pass. The tag as
// updated is checked by ApplyUpdate.
func (u Update) Check(name string) error {
	return checkFields(name, u.Step, u.Description)
}

// checkFields checks a tag's name, step and description; a nil step or
// description passes.
func checkFields(name string, step *int64, description *string) error {
	if err := CheckTag(name); err != nil {
		return err
	}
	if step != nil && (*step < 1 || *step > MaxStepLimit) {
		return fmt.Errorf("%q: %w %d: want 1..%d", name, ErrInvalidStep, *step, MaxStepLimit)
	}
	if description != nil {
		if !utf8.ValidString(*description) || strings.ContainsRune(*description, 0) {
			return fmt.Errorf("%q: %w: description is not UTF-8 text without NUL", name, ErrInvalidArgument)
		}
		if n := utf8.RuneCountInString(*description); n > MaxDescription {
			return fmt.Errorf("%q: %w: description has %d characters, want at most %d", name, ErrInvalidArgument, n, MaxDescription)
		}
	}
	return nil
}
