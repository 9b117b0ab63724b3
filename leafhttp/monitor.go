package leafhttp

import (
	"context"
	_ "embed"
	"errors"
	"html/template"
	"net/http"
	"slices"
	"strconv"
	"strings"

	"github.com/dispenser-dev/dispenser/internal/htmlpage"
	"github.com/dispenser-dev/dispenser/segment"
	"github.com/dispenser-dev/dispenser/tagmodel"
)

// Leaf's monitoring views, LeafMonitorController's /cache and /db: HTML
// by default, as Leaf's, and JSON for Accept: application/json or
// ?format=json, with the field names of Leaf's models (SegmentBufferView
// and LeafAlloc). Their data is the status page's: the allocator's Stats,
// and the store's rows.

// JSONLimit is how many tags one page of /cache and /db lists in JSON by
// default; HTML lists htmlpage.TagLimit, as the status page. A page is
// the first tags by name after ?after=NAME (from the first if absent),
// ?limit=N of them (1..htmlpage.MaxLimit); the header NextHeader names
// the after of the next page, and TotalHeader how many tags there are.
// The tags come from a snapshot computed at most once a second
// (htmlpage.SnapshotEvery) and shared by every viewer.
const JSONLimit = 1_000

// TotalHeader is the response header of /cache and /db with the number of
// tags there are, listed or not.
const TotalHeader = "Dispenser-Tags-Total"

// NextHeader is the response header of /cache and /db with the after
// parameter of the next page; absent on the last page.
const NextHeader = "Dispenser-Next-After"

// Cache is one tag of /cache: Leaf's SegmentBufferView. Segment 0 is the
// current segment, segment 1 the next (all zero while there is none), so
// Pos, the index of the current one, is always 0. Value is the next ID a
// segment hands out (Max once spent), Max its end (exclusive), Step its
// size.
type Cache struct {
	Key       string `json:"key"`
	InitOK    bool   `json:"initOk"` // the tag has a segment
	NextReady bool   `json:"nextReady"`
	Pos       int    `json:"pos"`
	Value0    int64  `json:"value0"`
	Max0      int64  `json:"max0"`
	Step0     int64  `json:"step0"`
	Value1    int64  `json:"value1"`
	Max1      int64  `json:"max1"`
	Step1     int64  `json:"step1"`
}

// CacheOf returns the /cache view of one tag's stats.
func CacheOf(st segment.TagStats) Cache {
	c := Cache{Key: st.Tag, InitOK: st.Current != nil, NextReady: st.NextReady}
	if s := st.Current; s != nil {
		c.Value0, c.Max0, c.Step0 = s.Cursor, s.End, s.Step
	}
	if s := st.Next; s != nil {
		c.Value1, c.Max1, c.Step1 = s.Cursor, s.End, s.Step
	}
	return c
}

// DB is one row of /db: Leaf's LeafAlloc. MaxID is the store's max_id
// (the next segment starts there), Step the tag's configured step,
// UpdateTime the row's last change in UTC.
type DB struct {
	Key        string `json:"key"`
	MaxID      int64  `json:"maxId"`
	Step       int64  `json:"step"`
	UpdateTime string `json:"updateTime"`
}

// dbTime is how /db writes a row's update time.
const dbTime = "2006-01-02 15:04:05"

//go:embed cache.html
var cacheHTML string

//go:embed db.html
var dbHTML string

var (
	cacheTemplate = htmlpage.Parse("cache", cacheHTML)
	dbTemplate    = htmlpage.Parse("db", dbHTML)
)

// page is what the HTML views render: Rows of Total, More after them,
// Next the after of the next page ("" on the last).
type page[T any] struct {
	Rows  []T
	Total int
	More  int
	Next  string
}

// viewPage reads the paging parameters of a view request; it answers 400
// and returns false if they are bad.
func viewPage(w http.ResponseWriter, r *http.Request, asJSON bool) (htmlpage.Page, bool) {
	limit := htmlpage.TagLimit
	if asJSON {
		limit = JSONLimit
	}
	q, err := parseQuery(r)
	if err == nil {
		var p htmlpage.Page
		if p, err = htmlpage.ParsePage(q, limit); err == nil {
			return p, true
		}
	}
	http.Error(w, err.Error()+" (want ?after=NAME&limit=1.."+strconv.Itoa(htmlpage.MaxLimit)+")", http.StatusBadRequest)
	return htmlpage.Page{}, false
}

// wantsJSON reports whether r asks for JSON: ?format=json, or an Accept
// header that names application/json and not text/html (a browser's
// names both, and gets HTML).
func wantsJSON(r *http.Request) bool {
	if r.URL.Query().Get("format") == "json" {
		return true
	}
	accept := strings.Join(r.Header.Values("Accept"), ",")
	return strings.Contains(accept, "application/json") && !strings.Contains(accept, "text/html")
}

// cacheRows returns every tag's /cache row, by name.
func (h *Handler) cacheRows(context.Context) ([]Cache, error) {
	stats := h.s.Segments.Stats()
	rows := make([]Cache, len(stats))
	for i, st := range stats {
		rows[i] = CacheOf(st)
	}
	slices.SortFunc(rows, func(a, b Cache) int { return strings.Compare(a.Key, b.Key) })
	return rows, nil
}

// serveCache serves /cache: a page of the snapshot of every tag's row.
func (h *Handler) serveCache(w http.ResponseWriter, r *http.Request) {
	if !viewMethod(w, r) {
		return
	}
	asJSON := wantsJSON(r)
	p, ok := viewPage(w, r, asJSON)
	if !ok {
		return
	}
	rows, _ := h.cache.Get(r.Context()) // cacheRows never fails
	from, to, next := p.Cut(len(rows), func(i int) string { return rows[i].Key })
	render(w, h, asJSON, cacheTemplate, page[Cache]{Rows: rows[from:to], Total: len(rows), More: len(rows) - to, Next: next})
}

// serveDB serves /db: a page of the store's tags, from a snapshot of
// their names, and the rows of that page's tags read from the store, one
// /db at a time, within RowsTimeout.
func (h *Handler) serveDB(w http.ResponseWriter, r *http.Request) {
	if !viewMethod(w, r) {
		return
	}
	asJSON := wantsJSON(r)
	p, ok := viewPage(w, r, asJSON)
	if !ok {
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), h.s.RowsTimeout)
	defer cancel()
	select {
	case h.rows <- struct{}{}:
		defer func() { <-h.rows }()
	case <-ctx.Done():
		http.Error(w, "the store's rows are being read for another request; try again", http.StatusServiceUnavailable)
		return
	}
	names, err := h.names.Get(ctx)
	var rows []DB
	if err == nil {
		rows, err = h.readRows(ctx, names, p)
	}
	if err != nil {
		if r.Context().Err() == nil {
			h.s.Logger.Warn("leafhttp: /db: reading the store", "err", err)
			http.Error(w, "the store did not answer; try again", http.StatusServiceUnavailable)
		}
		return
	}
	_, to, next := p.Cut(len(names), func(i int) string { return names[i] })
	render(w, h, asJSON, dbTemplate, page[DB]{Rows: rows, Total: len(names), More: len(names) - to, Next: next})
}

// tagNames returns the store's tag names, sorted.
func (h *Handler) tagNames(ctx context.Context) ([]string, error) {
	names, err := h.s.Rows.Tags(ctx)
	if err != nil {
		return nil, err
	}
	names = slices.Clone(names)
	slices.Sort(names)
	return names, nil
}

// readRows reads the store's rows of the tags of names on page p.
func (h *Handler) readRows(ctx context.Context, names []string, p htmlpage.Page) ([]DB, error) {
	from, to, _ := p.Cut(len(names), func(i int) string { return names[i] })
	rows := make([]DB, 0, to-from)
	for _, name := range names[from:to] {
		t, err := h.s.Rows.Tag(ctx, name)
		if errors.Is(err, tagmodel.ErrUnknownTag) {
			continue // removed meanwhile
		}
		if err != nil {
			return nil, err
		}
		rows = append(rows, DB{Key: t.Name, MaxID: t.MaxID, Step: t.Step, UpdateTime: t.UpdateTime.UTC().Format(dbTime)})
	}
	return rows, nil
}

// viewMethod reports whether r may read a view: GET or HEAD; it answers
// 405 if not.
func viewMethod(w http.ResponseWriter, r *http.Request) bool {
	if r.Method == http.MethodGet || r.Method == http.MethodHead {
		return true
	}
	w.Header().Set("Allow", "GET, HEAD")
	http.Error(w, "method "+r.Method+" not allowed: use GET", http.StatusMethodNotAllowed)
	return false
}

// render writes p as JSON (its rows) or as the HTML of t.
func render[T any](w http.ResponseWriter, h *Handler, asJSON bool, t *template.Template, p page[T]) {
	w.Header().Set(TotalHeader, strconv.Itoa(p.Total))
	if p.Next != "" {
		w.Header().Set(NextHeader, p.Next)
	}
	if asJSON {
		writeJSON(w, h.s.Logger, http.StatusOK, p.Rows)
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.Header().Set("Cache-Control", "no-store")
	if err := t.Execute(w, p); err != nil {
		h.s.Logger.Debug("leafhttp: rendering a view", "err", err)
	}
}
