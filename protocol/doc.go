// Package protocol is dispenser's wire protocol, in one place: the subjects,
// the headers, the error codes, how a request is read (ReadRequest: its
// headers, count and format, and whether its reply fits in a message),
// how IDs are written into a reply and read back out of one, which reply
// subjects a worker may answer to, and the line format of requests one
// worker forwards to the owner of an ordered tag. The service (package
// dispenser), the Go client (package client) and the benchmark's baseline
// all use it, so that they cannot drift apart. It depends on the standard
// library only.
//
// # Requests
//
// A request is a NATS request on one of these subjects (Prefix defaults to
// "id"):
//
//	<prefix>.segment.<tag>    IDs of the tag's sequence (SegmentSubject)
//	<prefix>.snowflake        snowflake IDs (SnowflakeSubject)
//	<prefix>.snowflake.decode a snowflake ID's parts, as JSON, in the layout of the worker that answers
//	<prefix>.direct.<tag>.<owner>  IDs of an ordered tag, from its owner
//	                          (DirectSubject; see Direct requests)
//
// The body is the count: empty for one ID, otherwise a decimal number from
// 1 to the service's batch limit, optionally surrounded by ASCII white space
// (ParseCount); or the count, white space and a token: "<count> <token>"
// (SplitBody; see Tokens). A tag is 1 to 128 characters of [A-Za-z0-9_-],
// so that it is always one subject token (ValidTag).
//
// Headers a request may carry: FormatHeader ("list", the default,
// "range", or "formatted" for a segment tag with a format), WorkerHeader
// (any value: the reply names the worker that answered it), DirectHeader
// (any value: see Direct requests) and TokenHeader (a token in the
// header; see Tokens).
//
// # Tokens
//
// A request may carry a token: 1 to MaxTokenLen characters of
// [A-Za-z0-9_-] (ValidToken), after the count in the body ("1 <token>",
// the count then required; <prefix>.snowflake.decode, whose body is an
// ID, takes it in the header only) or in TokenHeader; in both, or not valid, is
// answered 400 without a token. Every reply to the request, IDs or error,
// from whichever worker answers it, carries the same token back, so that a
// requester that sends a new unpredictable one with every request (the Go
// client: 128 random bits) accepts only replies to its own request. Where
// it comes back: an error reply carries it in TokenHeader; a reply with
// IDs carries it where the request had it: in TokenHeader, or, for a token
// in the body, as the body's first line (AppendTokenLine, CutTokenLine):
// "<token>\n" before the IDs, or "<token> <direct subject>\n" from the
// owner of an ordered tag answering on <prefix>.segment.<tag> (see Direct
// requests: a body token asks for the direct subject too). A body token
// costs a request and its reply no headers: nats.go encodes and decodes
// headers into new maps and strings, which costs a request more than the
// rest of what a client does (docs/performance.md). The line is within
// ReplyHeaderRoom, which every reply keeps free. Workers older than body
// tokens answer "<count> <token>" with 400 (a bad count) without the
// token; a requester that sees that 400 may send the request again with
// the token in TokenHeader (nothing was taken), as the Go client does. An
// owner older than body tokens, given such a request by a newer worker,
// echoes the token in TokenHeader: a requester accepts the token from
// either place, once.
//
// # Replies
//
// A reply carries exactly the IDs asked for, strictly increasing: one
// decimal ID per line (FormatList, AppendList), or one "first-last" line per
// run of consecutive IDs (FormatRange, AppendRanges), lines separated by a
// single newline. ParseIDs reads a reply back and refuses anything else.
// With FormatFormatted the lines are the IDs written out in the tag's
// format (such as ORD-20261124-000123: printable ASCII without space, at
// most MaxFormattedBytes each), in the order they were taken; a tag without
// a format, an ordered tag and a snowflake request refuse it with 400.
//
// A failure is a reply with an empty body and the micro error headers
// ErrorCodeHeader and ErrorHeader: code 400 (CodeBadRequest) for a request
// the service cannot read, 404 (CodeNotFound) for an unknown tag, 410
// (CodeGone) for a tag whose IDs would pass 2^63-1, 503 (CodeUnavailable)
// for "try again", 500 (CodeInternal) for anything else, and 421
// (CodeMisdirected) for a request on a direct subject whose worker does
// not own the tag.
//
// A request whose reply subject is refused (CheckReply) gets no reply at
// all: a reply subject is chosen freely by the requester, and a worker never
// publishes where the requester could not.
//
// # Direct requests
//
// The owner of an ordered tag answers the requests for the tag that reach
// it on <prefix>.segment.<tag> (itself, or forwarded by another worker)
// and carry DirectHeader (any value) with the reply header
// DirectHeader, "Id-Direct: <prefix>.direct.<tag>.<owner>" (owner is
// one token of [A-Za-z0-9_-] naming the worker), or, for a request with
// its token in the body, with the same subject in the reply's token line:
// where it takes the tag's requests itself. A client may send the tag's next requests there, with
// the same body and headers; the reply is the same, without DirectHeader.
// A client must check the value is the direct subject of the tag it asked
// for under its prefix (CheckDirect): a reply is untrusted. When that
// worker does not own the tag (any more), it answers 421 (CodeMisdirected)
// and takes nothing; on 421, no responders or a timeout, the client
// forgets the direct subject and sends the request to
// <prefix>.segment.<tag> at once. The direct subject is requester input
// like any other: its reply subject, count and headers are checked the
// same way. Requests without DirectHeader get replies as before.
//
// # Forwarded requests
//
// A worker that does not own an ordered tag forwards the tag's requests to
// the owner: one message to "<owner subject>.<tag>", with ForwardedHeader
// naming the forwarding worker, holding one request per line (Forward,
// AppendForward, ParseForward), its token included, and whether it came
// in the body.
package protocol
