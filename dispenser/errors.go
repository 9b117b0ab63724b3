package dispenser

import (
	"context"
	"errors"
	"log/slog"

	"github.com/dispenser-dev/dispenser/internal/kvbucket"
	"github.com/dispenser-dev/dispenser/protocol"
	"github.com/dispenser-dev/dispenser/segment"
	"github.com/dispenser-dev/dispenser/snowflake"
	"github.com/dispenser-dev/dispenser/tagmodel"
)

// Error codes: the one mapping from errors to the wire protocol's reply
// codes is the table errorCodes below, keyed by sentinel error, walked by
// Classify; Leaf's HTTP API (package leafhttp) maps those reply codes to
// HTTP statuses and Leaf's codes in one table of its own (leafCodes).
//
// The sentinels are not given codes of their own (as wtf.Error carries
// its code): they belong to the packages below the service (protocol,
// tagmodel, segment, snowflake, kvbucket), which know nothing of the wire
// protocol's codes, and the answer to some depends on more than the error
// (whether this worker serves ordered tags, what its snowflake generator
// says, whether the store's details must be kept out of the reply). The
// errors that do come with their code, a reply of another worker
// (client.Error), keep it (worker's classify).

// codeRow is one row of errorCodes: an error that is (errors.Is) err is
// answered with code and the description desc gives, if when, if set,
// holds for the service.
type codeRow struct {
	err  error
	when func(*Service) bool
	code string
	desc func(err error) string
	// logMsg, if set, is logged at logLevel with the error: what the
	// description leaves out (the store's or the network's details).
	logMsg   string
	logLevel slog.Level
}

// describe describes the error itself (protocol.Describe).
func describe(err error) string { return protocol.Describe(err) }

// describeAs describes the sentinel e, then suffix: the error's own
// text may name addresses, users or databases.
func describeAs(e error, suffix string) func(error) string {
	return func(error) string { return protocol.Describe(e) + suffix }
}

// describeWith describes the error itself, then suffix.
func describeWith(suffix string) func(error) string {
	return func(err error) string { return protocol.Describe(err) + suffix }
}

// text is a fixed description.
func text(s string) func(error) string { return func(error) string { return s } }

// servesOrdered reports whether the service serves ordered tags.
func servesOrdered(s *Service) bool { return s.cfg.Owners != nil }

// errorCodes maps errors to reply codes: the first row whose error the
// error is decides. 400 and 404 describe the request; 503 and 500 say what
// happened without the store's or the network's details, which go to the
// log instead. After it, Classify asks the snowflake generator
// (Snowflake.Unavailable: 503), and answers anything else 500.
var errorCodes = []codeRow{
	{err: protocol.ErrBadCount, code: protocol.CodeBadRequest, desc: describe},
	{err: protocol.ErrBadID, code: protocol.CodeBadRequest, desc: describe},
	{err: protocol.ErrBadHeader, code: protocol.CodeBadRequest, desc: describe},
	{err: protocol.ErrBadSubject, code: protocol.CodeBadRequest, desc: describe},
	{err: tagmodel.ErrInvalidTag, code: protocol.CodeBadRequest, desc: describe},
	{err: segment.ErrInvalidCount, code: protocol.CodeBadRequest, desc: describe},
	{err: snowflake.ErrInvalidCount, code: protocol.CodeBadRequest, desc: describe},
	{err: segment.ErrNoFormat, code: protocol.CodeBadRequest, desc: describe},
	{err: tagmodel.ErrUnknownTag, code: protocol.CodeNotFound, desc: describe},
	{err: tagmodel.ErrPeriodExpired, code: protocol.CodeUnavailable,
		desc:   text("the period asked for has expired: this worker's clock is behind; try again"),
		logMsg: "dispenser: a period asked for has expired: this worker's clock is far behind the store's", logLevel: slog.LevelError},
	{err: tagmodel.ErrExhausted, code: protocol.CodeGone, desc: describe},
	{err: segment.ErrClosed, code: protocol.CodeUnavailable, desc: describeAs(segment.ErrClosed, "")},
	{err: ErrNotOwner, code: protocol.CodeMisdirected, desc: describe},
	{err: ErrOwnershipMoving, code: protocol.CodeUnavailable, desc: describeWith("; try again")},
	// An ordered tag on a worker that serves them: its owner is changing
	// (the buffers were reset while the request waited).
	{err: segment.ErrOrdered, when: servesOrdered, code: protocol.CodeUnavailable, desc: describeAs(ErrOwnershipMoving, "; try again")},
	{err: segment.ErrOrdered, code: protocol.CodeUnavailable, desc: describeWith(": this worker serves no ordered tags")},
	{err: tagmodel.ErrTagDeleted, code: protocol.CodeUnavailable,
		desc: text("the tag's record was deleted by hand: it is not created again until an operator restores it")},
	{err: kvbucket.ErrPurged, code: protocol.CodeUnavailable,
		desc:   text("the store's bucket was purged or recreated: an operator must restore it"),
		logMsg: "dispenser: unavailable", logLevel: slog.LevelDebug},
	{err: kvbucket.ErrRecreated, code: protocol.CodeUnavailable,
		desc:   text("the store's bucket was purged or recreated: an operator must restore it"),
		logMsg: "dispenser: unavailable", logLevel: slog.LevelDebug},
	{err: segment.ErrUnavailable, code: protocol.CodeUnavailable,
		desc:   describeAs(segment.ErrUnavailable, " (store slow or unreachable); try again"),
		logMsg: "dispenser: unavailable", logLevel: slog.LevelDebug},
}

// snowflakeUnavailable are the reasons a snowflake worker cannot issue, by
// which a 503 of the generator is described.
var snowflakeUnavailable = []error{snowflake.ErrBucketDeleted, snowflake.ErrEpochLost, snowflake.ErrClockBackwards, snowflake.ErrFenced,
	snowflake.ErrOverloaded, snowflake.ErrClosed, snowflake.ErrNoWorkerID}

// Classify maps an error of the allocator, the snowflake generator, the
// ordered tags or the protocol's parsers to the reply code of the wire
// protocol (protocol.CodeBadRequest, …) and a description for the
// requester, by the table errorCodes: the one mapping from errors to codes,
// which the NATS endpoints and Leaf's HTTP API (package leafhttp) share.
func (s *Service) Classify(err error) (code, desc string) {
	for _, row := range errorCodes {
		if !errors.Is(err, row.err) || row.when != nil && !row.when(s) {
			continue
		}
		if row.logMsg != "" {
			s.cfg.Logger.Log(context.Background(), row.logLevel, row.logMsg, "err", err)
		}
		return row.code, row.desc(err)
	}
	if s.cfg.Snowflake != nil && s.cfg.Snowflake.Unavailable(err) {
		s.cfg.Logger.Debug("dispenser: unavailable", "err", err)
		for _, e := range snowflakeUnavailable {
			if errors.Is(err, e) {
				return protocol.CodeUnavailable, protocol.Describe(e)
			}
		}
		return protocol.CodeUnavailable, protocol.Describe(snowflake.ErrUnavailable)
	}
	s.cfg.Logger.Error("dispenser: unexpected error", "err", err)
	return protocol.CodeInternal, "internal error"
}
