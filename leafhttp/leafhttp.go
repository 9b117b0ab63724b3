// Package leafhttp serves Meituan Leaf's HTTP API from a worker's
// allocator and snowflake generator, the ones its NATS endpoints serve
// from, so that a client of Leaf's server works against dispenser
// unmodified:
//
//	/api/segment/get/{key}             a segment ID of tag key, in decimal
//	/api/snowflake/get/{key}           a snowflake ID (key is ignored, as by Leaf)
//	/decodeSnowflakeId?snowflakeId=N   N's fields, as Leaf's JSON
//	/cache                             the tags' buffers (Leaf's SegmentBufferView)
//	/db                                the store's rows (Leaf's LeafAlloc)
//
// The ID paths take any method but HEAD, OPTIONS, TRACE and CONNECT (Leaf
// maps every method), and two query parameters of dispenser's own:
// count=N (1..MaxBatch IDs, one per line, as the NATS protocol) and
// format=list|range|formatted (as the Id-Format header). A failure
// answers the HTTP status of dispenser's reply code (400, 404, 410, 503,
// 500: never 200) with the body Leaf's server sends, its Result code
// within: see Error. docs/leaf-http.md is the user's description.
package leafhttp

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/dispenser-dev/dispenser/internal/htmlpage"
	"github.com/dispenser-dev/dispenser/protocol"
	"github.com/dispenser-dev/dispenser/segment"
	"github.com/dispenser-dev/dispenser/snowflake"
	"github.com/dispenser-dev/dispenser/tagmodel"
)

// Segments takes segment IDs and describes the tags' buffers;
// *segment.Allocator implements it.
type Segments interface {
	// Take takes n IDs of tag, waiting for a segment at most the
	// allocator's MaxWait; an ordered tag fails with segment.ErrOrdered.
	Take(ctx context.Context, tag string, n int, dst []segment.Run) ([]segment.Run, error)
	// TakeNowNumbered takes n IDs of a tag with a format, with what
	// writes them out; see segment.Allocator.
	TakeNowNumbered(tag string, n int, dst []segment.Run) ([]segment.Run, segment.Numbering, *segment.Pending, error)
	// Stats describes the buffers of every tag in memory, by name.
	Stats() []segment.TagStats
	// Ready reports whether the tag list has been loaded once (Leaf's
	// "ID cache initialised").
	Ready() bool
}

// Ordered takes IDs of ordered tags, which only their owner serves
// (package dispenser): the worker asks its own service over NATS, which
// routes the request to the owner, so that the IDs keep the tag's promise
// (linearizably increasing across workers). Its errors are those Classify
// maps.
type Ordered interface {
	Take(ctx context.Context, tag string, n int) ([]segment.Run, error)
}

// Snowflake issues snowflake IDs and knows how to decode them;
// *snowflake.Node implements it.
type Snowflake interface {
	AppendIDs(dst []int64, n int) ([]int64, error)
	Epoch() time.Time
	Layout() snowflake.Layout
}

// Rows reads the store's rows for /db; a tagmodel.Store implements it.
type Rows interface {
	Tags(ctx context.Context) ([]string, error)
	Tag(ctx context.Context, name string) (tagmodel.Tag, error)
}

// Errors of package leafhttp.
var (
	// ErrConfig means Settings cannot work.
	ErrConfig = errors.New("leafhttp: invalid settings")
	// errFormattedOrdered refuses format=formatted for an ordered tag, as
	// the NATS endpoint does.
	errFormattedOrdered = fmt.Errorf("%w: format=formatted: ordered tags have no formatted numbers", protocol.ErrBadHeader)
	// errFormattedSnowflake refuses format=formatted for snowflake IDs.
	errFormattedSnowflake = fmt.Errorf("%w: format=formatted: snowflake IDs have no format", protocol.ErrBadHeader)
)

// Settings configure a Handler. Zero values mean the documented defaults.
type Settings struct {
	// Segments serves /api/segment/get and /cache. Required.
	Segments Segments
	// Ordered serves ordered tags; nil: their requests fail as Classify
	// maps segment.ErrOrdered (503).
	Ordered Ordered
	// Snowflake serves /api/snowflake/get and /decodeSnowflakeId; nil
	// leaves them out (404).
	Snowflake Snowflake
	// Rows serves /db; nil leaves it out (404).
	Rows Rows
	// Classify maps an error to the wire protocol's reply code and a
	// description (dispenser.Service.Classify): the one mapping of errors
	// to codes. Required.
	Classify func(error) (code, desc string)
	// MaxBatch is the most IDs count may ask for. Default
	// protocol.DefaultMaxBatch (10,000).
	MaxBatch int
	// RowsTimeout bounds the store reads of one /db. Default 10 s.
	RowsTimeout time.Duration
	// Logger receives failures to write a response. Default
	// slog.Default().
	Logger *slog.Logger
	// OnSnapshot, if not nil, is called with "cache" or "db" each time
	// a view's snapshot is computed (tests count them).
	OnSnapshot func(view string)
	// Observe, if set, records every request answered (the worker's
	// dispenser.Service.ObserveHTTP: the metrics with transport="http"):
	// endpoint is the path's kind (segment, snowflake, snowflake_decode,
	// cache, db, other), tag the segment tag (else ""), code the reply
	// code (the HTTP status), ids the IDs handed out, start when the
	// request arrived. A request whose client went away is not recorded.
	Observe func(endpoint, tag, code string, ids int, start time.Time)
}

// Handler serves Leaf's HTTP API. It is safe for concurrent use.
type Handler struct {
	s   Settings
	mux *http.ServeMux
	// rows lets one /db read the store at a time: a flood of /db requests
	// costs the store one walk at a time.
	rows chan struct{}
	bufs sync.Pool // *[]byte response bodies
	// cache and names are the snapshots of /cache's rows and /db's tag
	// names, computed at most once a second for every viewer.
	cache htmlpage.Snapshot[[]Cache]
	names htmlpage.Snapshot[[]string]
}

// New validates s and returns its Handler.
func New(s Settings) (*Handler, error) {
	s.MaxBatch = cmp.Or(s.MaxBatch, protocol.DefaultMaxBatch)
	s.RowsTimeout = cmp.Or(s.RowsTimeout, 10*time.Second)
	if s.Logger == nil {
		s.Logger = slog.Default()
	}
	switch {
	case s.Segments == nil || s.Classify == nil:
		return nil, fmt.Errorf("%w: Segments and Classify are required", ErrConfig)
	case s.MaxBatch < 1 || s.MaxBatch > protocol.MaxCount:
		return nil, fmt.Errorf("%w: MaxBatch %d: want 1..%d", ErrConfig, s.MaxBatch, protocol.MaxCount)
	case s.RowsTimeout < 0:
		return nil, fmt.Errorf("%w: RowsTimeout %v: must not be negative", ErrConfig, s.RowsTimeout)
	}
	h := &Handler{s: s, mux: http.NewServeMux(), rows: make(chan struct{}, 1)}
	h.bufs.New = func() any { b := make([]byte, 0, 64); return &b }
	h.cache.Compute, h.names.Compute = h.cacheRows, h.tagNames
	if s.OnSnapshot != nil {
		h.cache.OnCompute = func() { s.OnSnapshot("cache") }
		h.names.OnCompute = func() { s.OnSnapshot("db") }
	}
	// The ID paths are served by ServeHTTP itself: everything below
	// their prefixes, so that an empty key, or one with slashes, gets its
	// 400 in Leaf's shape rather than the mux's 404.
	h.mux.HandleFunc("/cache", h.serveCache)
	if s.Snowflake != nil {
		h.mux.HandleFunc("/decodeSnowflakeId", h.serveDecode)
	}
	if s.Rows != nil {
		h.mux.HandleFunc("/db", h.serveDB)
	}
	return h, nil
}

// Path prefixes of the ID paths.
const (
	segmentPrefix   = "/api/segment/get/"
	snowflakePrefix = "/api/snowflake/get/"
)

// ServeHTTP implements http.Handler. The ID paths are matched before the
// mux, which costs them a pattern match and the path value's copy.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	var start time.Time
	if h.s.Observe != nil {
		start = time.Now()
	}
	if key, ok := strings.CutPrefix(r.URL.Path, segmentPrefix); ok {
		h.serveSegment(w, r, key, start)
		return
	}
	if _, ok := strings.CutPrefix(r.URL.Path, snowflakePrefix); ok && h.s.Snowflake != nil {
		h.serveSnowflake(w, r, start)
		return
	}
	if h.s.Observe == nil {
		h.mux.ServeHTTP(w, r)
		return
	}
	// The monitoring paths are few and rare: a writer that keeps the
	// status costs them an allocation.
	sw := &statusWriter{ResponseWriter: w, status: http.StatusOK}
	h.mux.ServeHTTP(sw, r)
	endpoint := "other"
	switch r.URL.Path {
	case "/decodeSnowflakeId":
		endpoint = "snowflake_decode"
	case "/cache", "/db":
		endpoint = r.URL.Path[1:]
	}
	h.s.Observe(endpoint, "", strconv.Itoa(sw.status), 0, start)
}

// statusWriter remembers the status a handler wrote.
type statusWriter struct {
	http.ResponseWriter
	status int
}

func (w *statusWriter) WriteHeader(status int) {
	w.status = status
	w.ResponseWriter.WriteHeader(status)
}

// observe records a request of an ID path answered with code.
func (h *Handler) observe(endpoint, tag, code string, ids int, start time.Time) {
	if h.s.Observe != nil {
		h.s.Observe(endpoint, tag, code, ids, start)
	}
}

// idMethods are the methods that take IDs (every method, as Leaf maps
// them, but those idMethod refuses), as a 405's Allow lists them.
const idMethods = "GET, POST, PUT, PATCH, DELETE"

// idMethod reports whether r's method may take IDs; it answers 405 if not.
// A HEAD request would take an ID and drop it with the body.
func idMethod(w http.ResponseWriter, r *http.Request) bool {
	switch r.Method {
	case http.MethodHead, http.MethodOptions, http.MethodTrace, http.MethodConnect:
		w.Header().Set("Allow", idMethods)
		http.Error(w, "method "+r.Method+" takes no IDs: use GET (any of "+idMethods+" does, as Leaf maps every method)", http.StatusMethodNotAllowed)
		return false
	}
	return true
}

// params reads the query parameters count and format of an ID request.
func (h *Handler) params(r *http.Request) (int, protocol.Format, error) {
	q, err := parseQuery(r)
	if err != nil {
		return 0, 0, err
	}
	format, err := protocol.ParseFormat(q["format"])
	if err != nil {
		return 0, 0, err
	}
	n := 1
	switch c := q["count"]; len(c) {
	case 0:
	case 1:
		if n, err = protocol.ParseCount([]byte(c[0]), h.s.MaxBatch); err != nil {
			return 0, 0, err
		}
	default:
		return 0, 0, fmt.Errorf("%w: count given %d times", protocol.ErrBadCount, len(c))
	}
	return n, format, nil
}

// parseQuery parses r's query, refusing a malformed one.
func parseQuery(r *http.Request) (map[string][]string, error) {
	if r.URL.RawQuery == "" {
		return nil, nil
	}
	q, err := url.ParseQuery(r.URL.RawQuery)
	if err != nil {
		return nil, fmt.Errorf("%w: malformed query: %v", protocol.ErrBadHeader, err)
	}
	return q, nil
}

// serveSegment serves /api/segment/get/{key}: Leaf's LeafController.
func (h *Handler) serveSegment(w http.ResponseWriter, r *http.Request, tag string, start time.Time) {
	if !idMethod(w, r) {
		h.observe("segment", "", "405", 0, start)
		return
	}
	n, format, err := h.params(r)
	if err == nil && !protocol.ValidTag(tag) {
		err = fmt.Errorf("%w %q: want %s", tagmodel.ErrInvalidTag, truncate(tag, 64), protocol.TagRule)
	}
	if err != nil {
		h.fail(w, r, segmentPath, err, tag, start)
		return
	}
	ctx := r.Context()
	var arr [2]segment.Run
	if format == protocol.FormatFormatted {
		runs, num, pending, err := h.s.Segments.TakeNowNumbered(tag, n, arr[:0])
		if err == nil && pending != nil {
			runs, err = pending.Wait(ctx)
			num = pending.Numbering()
		}
		if errors.Is(err, segment.ErrOrdered) {
			err = errFormattedOrdered
		}
		if err != nil {
			h.fail(w, r, segmentPath, err, tag, start)
			return
		}
		bp := h.bufs.Get().(*[]byte)
		h.write(w, bp, num.Append((*bp)[:0], runs))
		h.observe("segment", tag, "200", n, start)
		return
	}
	runs, err := h.s.Segments.Take(ctx, tag, n, arr[:0])
	if errors.Is(err, segment.ErrOrdered) && h.s.Ordered != nil {
		runs, err = h.s.Ordered.Take(ctx, tag, n)
	}
	if err != nil {
		h.fail(w, r, segmentPath, err, tag, start)
		return
	}
	bp := h.bufs.Get().(*[]byte)
	h.write(w, bp, protocol.AppendRuns((*bp)[:0], format, runs))
	h.observe("segment", tag, "200", n, start)
}

// serveSnowflake serves /api/snowflake/get/{key}; the key is ignored, as
// by Leaf.
func (h *Handler) serveSnowflake(w http.ResponseWriter, r *http.Request, start time.Time) {
	if !idMethod(w, r) {
		h.observe("snowflake", "", "405", 0, start)
		return
	}
	n, format, err := h.params(r)
	if err == nil && format == protocol.FormatFormatted {
		err = errFormattedSnowflake
	}
	var ids []int64
	if err == nil {
		var arr [1]int64
		ids, err = h.s.Snowflake.AppendIDs(arr[:0], n)
	}
	if err != nil {
		h.fail(w, r, snowflakePath, err, "", start)
		return
	}
	bp := h.bufs.Get().(*[]byte)
	if format == protocol.FormatRange {
		h.write(w, bp, protocol.AppendRanges((*bp)[:0], protocol.Runs(nil, ids)))
	} else {
		h.write(w, bp, protocol.AppendIDs((*bp)[:0], ids))
	}
	h.observe("snowflake", "", "200", n, start)
}

// write answers 200 with b, appended to the pooled buffer bp, which it
// puts back. IDs must never come from a cache: Cache-Control: no-store.
func (h *Handler) write(w http.ResponseWriter, bp *[]byte, b []byte) {
	hd := w.Header()
	hd["Content-Type"] = textPlain
	hd["Cache-Control"] = noStore
	if _, err := w.Write(b); err != nil {
		h.s.Logger.Debug("leafhttp: writing IDs", "err", err)
	}
	if cap(b) <= 1<<16 {
		*bp = b
		h.bufs.Put(bp)
	}
}

// Header values shared by every response (never modified).
var (
	textPlain = []string{"text/plain; charset=utf-8"}
	noStore   = []string{"no-store"}
)

// decoded is Leaf's /decodeSnowflakeId answer: every field a string.
type decoded struct {
	Timestamp  string `json:"timestamp"`
	SequenceID string `json:"sequenceId"`
	WorkerID   string `json:"workerId"`
}

// decodeTime is how Leaf writes the time of a decoded ID, after its Unix
// milliseconds (SimpleDateFormat "yyyy-MM-dd HH:mm:ss.SSS", local time).
const decodeTime = "2006-01-02 15:04:05.000"

// serveDecode serves /decodeSnowflakeId?snowflakeId=N in the worker's
// layout and epoch: Leaf's fields, all strings; the timestamp is the Unix
// milliseconds followed by the local time in parentheses. A missing or
// bad N answers 400 with Leaf's {"errorMsg": ...} (Leaf answers that with
// 200; a missing parameter, 400).
func (h *Handler) serveDecode(w http.ResponseWriter, r *http.Request) {
	q, err := parseQuery(r)
	var id int64
	layout := h.s.Snowflake.Layout()
	if err == nil {
		switch v := q["snowflakeId"]; {
		case len(v) != 1:
			err = fmt.Errorf("want one snowflakeId parameter, got %d", len(v))
		default:
			s := strings.TrimSpace(v[0])
			id, err = strconv.ParseInt(s, 10, 64)
			switch {
			case err != nil || id < 0:
				err = fmt.Errorf("snowflakeId %q is not a snowflake ID (a non-negative decimal int64)", truncate(s, 64))
			case id > layout.MaxID():
				err = fmt.Errorf("snowflakeId %d is not a snowflake ID of layout %s (at most %d)", id, layout, layout.MaxID())
			}
		}
	}
	if err != nil {
		writeJSON(w, h.s.Logger, http.StatusBadRequest, map[string]string{"errorMsg": err.Error()})
		return
	}
	p := layout.Decode(id, h.s.Snowflake.Epoch())
	writeJSON(w, h.s.Logger, http.StatusOK, decoded{
		Timestamp:  strconv.FormatInt(p.Time.UnixMilli(), 10) + "(" + p.Time.Local().Format(decodeTime) + ")",
		SequenceID: strconv.FormatInt(p.Sequence, 10),
		WorkerID:   strconv.FormatInt(p.Worker, 10),
	})
}

// writeJSON answers status with v in JSON.
func writeJSON(w http.ResponseWriter, log *slog.Logger, status int, v any) {
	b, err := json.Marshal(v)
	if err != nil { // our own types: cannot happen
		log.Error("leafhttp: encoding JSON", "err", err)
		http.Error(w, "internal error", http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(status)
	if _, err := w.Write(b); err != nil {
		log.Debug("leafhttp: writing JSON", "err", err)
	}
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}
