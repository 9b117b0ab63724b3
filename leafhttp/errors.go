package leafhttp

import (
	"context"
	"errors"
	"net/http"
	"strconv"
	"time"

	"github.com/dispenser-dev/dispenser/protocol"
)

// Errors as Leaf's clients see them. Leaf's server answers a failed ID
// request with HTTP 500 and Spring Boot's error body, whose message is
// Leaf's Result: {"timestamp":…,"status":500,"error":"Internal Server
// Error","message":"Result{id=-2, status=EXCEPTION}","path":…}. Its
// clients check for a status other than 200. dispenser answers the HTTP
// status of its reply code instead (400, 404, 410, 503 or 500), so that a
// proxy or a client can tell "try again" (503) from "wrong key" (404),
// with the same body: the Leaf code of the table below in message, plus
// dispenser's description of the failure.

// path tells the ID paths apart in the table: Leaf's codes differ.
type path int

const (
	segmentPath path = iota
	snowflakePath
)

// Leaf's Result codes (Result.id with Status.EXCEPTION).
const (
	// Segment: ID cache not initialised, key does not exist, both
	// segments not ready.
	leafNotInitialised = -1
	leafNoKey          = -2
	leafNotReady       = -3
	// Snowflake: the clock is behind (Leaf's -1; its -2 and -3 are an
	// interrupted wait and a drift over 5 ms).
	leafClockBehind = -1
)

// leafCodes maps dispenser's reply codes (from Settings.Classify) to the
// Leaf codes of each path; codes not in it are leafNotReady and
// leafClockBehind. The HTTP status is the reply code itself.
var leafCodes = map[string][2]int{
	protocol.CodeBadRequest:  {leafNoKey, leafClockBehind},    // invalid key (Leaf: no such key), bad count or format
	protocol.CodeNotFound:    {leafNoKey, leafClockBehind},    // unknown tag
	protocol.CodeGone:        {leafNotReady, leafClockBehind}, // tag exhausted
	protocol.CodeUnavailable: {leafNotReady, leafClockBehind}, // no segment within --max-wait (-1 before the tag list loaded), no lease, clock behind
	protocol.CodeInternal:    {leafNotReady, leafClockBehind},
}

// leafCode returns the Leaf code and HTTP status of a failure with reply
// code code on path p.
func (h *Handler) leafCode(p path, code string) (leaf, status int) {
	status, err := strconv.Atoi(code)
	if err != nil || status < 400 || status > 599 {
		status = http.StatusInternalServerError
	}
	codes, ok := leafCodes[code]
	if !ok {
		codes = [2]int{leafNotReady, leafClockBehind}
	}
	leaf = codes[p]
	if p == segmentPath && code == protocol.CodeUnavailable && !h.s.Segments.Ready() {
		leaf = leafNotInitialised
	}
	return leaf, status
}

// Error is the body of a failed ID request: Spring Boot's error body as
// Leaf's server sends it, and Description, dispenser's description of the
// failure (as the NATS error header carries it).
type Error struct {
	Timestamp int64  `json:"timestamp"` // Unix milliseconds
	Status    int    `json:"status"`
	Error     string `json:"error"`   // the status's text
	Message   string `json:"message"` // "Result{id=-N, status=EXCEPTION}"
	Path      string `json:"path"`
	// Code is Leaf's code, the id in Message.
	Code        int    `json:"code"`
	Description string `json:"description"`
}

// fail answers a failed ID request of tag (for the metrics: "" if it
// has none or is invalid) that arrived at start. A request whose client
// went away gets nothing (and logs nothing, nor is it counted).
func (h *Handler) fail(w http.ResponseWriter, r *http.Request, p path, err error, tag string, start time.Time) {
	if errors.Is(err, context.Canceled) && r.Context().Err() != nil {
		return
	}
	code, desc := h.s.Classify(err)
	h.observe([2]string{"segment", "snowflake"}[p], tag, code, 0, start)
	leaf, status := h.leafCode(p, code)
	writeJSON(w, h.s.Logger, status, Error{
		Timestamp:   time.Now().UnixMilli(),
		Status:      status,
		Error:       http.StatusText(status),
		Message:     "Result{id=" + strconv.Itoa(leaf) + ", status=EXCEPTION}",
		Path:        truncate(r.URL.Path, 256),
		Code:        leaf,
		Description: desc,
	})
}
