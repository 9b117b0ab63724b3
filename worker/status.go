package worker

import (
	_ "embed"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/dispenser-dev/dispenser/internal/buildinfo"
	"github.com/dispenser-dev/dispenser/internal/htmlpage"
	"github.com/dispenser-dev/dispenser/internal/redact"
	"github.com/dispenser-dev/dispenser/ownership"
	"github.com/dispenser-dev/dispenser/segment"
	"github.com/dispenser-dev/dispenser/snowflake"
)

// StatusTagLimit is the most tags, and owned ordered tags, the status
// page lists: a worker may hold 100,000 tags. Leaf's views /cache and /db
// (package leafhttp) list as many.
const StatusTagLimit = htmlpage.TagLimit

//go:embed status.html
var statusHTML string

var statusTemplate = htmlpage.Parse("status", statusHTML)

// Status is what the status page (GET /status on Config.MetricsAddr)
// shows.
type Status struct {
	Now       time.Time
	Instance  string
	ServiceID string // the micro service's ID
	Version   string // the binary's (package internal/buildinfo), as the micro service reports it
	// NATSURL and NATSStatus are those of the connection that serves
	// requests, JetStreamURL and JetStreamStatus those of the one for
	// the store and the leases. The URLs have no passwords.
	NATSURL, NATSStatus           string
	JetStreamURL, JetStreamStatus string
	// Store names the segment store (Store.Name).
	Store string
	// HasRollbacks says whether the store counts rollbacks
	// (dispenser_segment_rollbacks_total); Rollbacks is the count.
	HasRollbacks bool
	Rollbacks    float64
	// Snowflake is the snowflake lease's state; nil without snowflake.
	Snowflake *snowflake.NodeStats
	// Tags are the first StatusTagLimit tags in memory by name, of
	// TotalTags; MoreTags is how many are not listed.
	Tags      []segment.TagStats
	TotalTags int
	MoreTags  int
	// Ordered is the ownership state, with Owned cut to StatusTagLimit
	// tags of OwnedTotal; MoreOwned is how many are not listed.
	Ordered    *ownership.Stats
	OwnedTotal int
	MoreOwned  int
	// NextTags is the after parameter of the next page of tags ("" on
	// the last page).
	NextTags string
}

// Render writes s as an HTML page.
func (s *Status) Render(w io.Writer) error {
	return statusTemplate.Execute(w, s)
}

// limit cuts the tag lists to StatusTagLimit and counts what it cut.
func (s *Status) limit() {
	s.TotalTags = len(s.Tags)
	s.Tags, s.MoreTags = htmlpage.Cut(s.Tags, StatusTagLimit)
	if s.Ordered != nil {
		s.OwnedTotal = len(s.Ordered.Owned)
		s.Ordered.Owned, s.MoreOwned = htmlpage.Cut(s.Ordered.Owned, StatusTagLimit)
	}
}

// Status returns the worker's state as the status page shows it. It
// copies the state of every tag in memory (SegmentStats) to list the first
// StatusTagLimit by name.
func (w *Worker) Status() *Status {
	s := w.fullStatus()
	s.limit()
	return s
}

// fullStatus returns the worker's state with every tag and owned tag.
func (w *Worker) fullStatus() *Status {
	s := &Status{Now: time.Now(), Instance: w.cfg.Instance, Version: buildinfo.Version(), Tags: w.SegmentStats()}
	if w.svc != nil {
		s.ServiceID = w.svc.ID()
	}
	if nc := w.conn(); nc != nil {
		s.NATSURL, s.NATSStatus = redact.URL(nc.ConnectedUrl()), nc.Status().String()
	}
	if w.jsnc != nil {
		s.JetStreamURL, s.JetStreamStatus = redact.URL(w.jsnc.ConnectedUrl()), w.jsnc.Status().String()
	}
	if w.store != nil {
		s.Store = w.store.Name
	}
	if w.sf != nil {
		if st, ok := w.sf.Stats().(snowflake.NodeStats); ok {
			s.Snowflake = &st
		}
	}
	if w.owners != nil {
		st := w.owners.Stats()
		s.Ordered = &st
	}
	s.HasRollbacks, s.Rollbacks = counter(w.reg, "dispenser_segment_rollbacks_total")
	return s
}

// testStatusComputed, if not nil when a worker starts, is called each
// time its status page's snapshot is computed (tests count them).
var testStatusComputed func()

// serveStatus serves the status page: a snapshot of the worker's state
// computed at most once a second (htmlpage.SnapshotEvery) for every
// viewer, with one page of its tags: ?after=NAME&limit=N (default
// StatusTagLimit), and the first StatusTagLimit owned ordered tags.
func (w *Worker) serveStatus(rw http.ResponseWriter, r *http.Request) {
	q, err := url.ParseQuery(r.URL.RawQuery)
	var p htmlpage.Page
	if err == nil {
		p, err = htmlpage.ParsePage(q, StatusTagLimit)
	}
	if err != nil {
		http.Error(rw, err.Error()+" (want ?after=NAME&limit=1.."+strconv.Itoa(htmlpage.MaxLimit)+")", http.StatusBadRequest)
		return
	}
	full, _ := w.statusSnap.Get(r.Context()) // never fails
	s := *full                               // the snapshot is shared: cut copies
	from, to, next := p.Cut(len(full.Tags), func(i int) string { return full.Tags[i].Tag })
	s.TotalTags, s.Tags, s.MoreTags, s.NextTags = len(full.Tags), full.Tags[from:to], len(full.Tags)-to, next
	if full.Ordered != nil {
		o := *full.Ordered
		s.Ordered, s.OwnedTotal = &o, len(o.Owned)
		o.Owned, s.MoreOwned = htmlpage.Cut(o.Owned, StatusTagLimit)
	}
	rw.Header().Set("Content-Type", "text/html; charset=utf-8")
	if err := s.Render(rw); err != nil {
		w.log.Warn("status page", "err", err)
	}
}

// counter returns the sum of the named counter's series in reg, and
// whether reg has it.
func counter(reg prometheus.Gatherer, name string) (bool, float64) {
	if reg == nil {
		return false, 0
	}
	mfs, err := reg.Gather()
	if err != nil {
		return false, 0
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		var sum float64
		for _, m := range mf.GetMetric() {
			sum += m.GetCounter().GetValue()
		}
		return true, sum
	}
	return false, 0
}
