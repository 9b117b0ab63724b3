package dispenser

import (
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/dispenser-dev/dispenser/segment"
	"github.com/dispenser-dev/dispenser/snowflake"
)

// Transports: the values of the metrics' transport label. NATS is the
// service's own endpoints; HTTP is Leaf's HTTP API of the same worker
// (package leafhttp), which reports through Service.ObserveHTTP.
const (
	TransportNATS = "nats"
	TransportHTTP = "http"
)

// Endpoints, the values of the metrics' endpoint label: the NATS
// endpoint, or the kind of HTTP path (never the tag or the URL): segment
// (/api/segment/get/), snowflake (/api/snowflake/get/), snowflake_decode
// (/decodeSnowflakeId), cache, db, and other (any other path).
var endpoints = [...]string{"segment", "snowflake", "snowflake_decode", "cache", "db", "other"}

// codes are the reply codes whose counters are resolved once and kept
// (metrics.counted): those of the protocol, and HTTP's 405. Another code
// is looked up by its labels each time.
var codes = [...]string{"200", "400", "404", "405", "410", "421", "500", "503"}

// metrics are the service's Prometheus metrics. A nil *metrics records
// nothing. Only the tags named in Config.MetricsTags get a label value of
// their own, so that the number of series is bounded whatever the number of
// tags; the endpoint label is a value of endpoints and transport one of
// TransportNATS and TransportHTTP, so it stays bounded whatever the
// requests.
//
// The hot path looks no labels up: a request's counters and histogram are
// found by indexes (transport, endpoint, tag, code) in slots resolved on
// first use, so that series appear only once they have a sample.
type metrics struct {
	requests *prometheus.CounterVec   // transport, endpoint, tag, code
	ids      *prometheus.CounterVec   // transport, endpoint, tag
	latency  *prometheus.HistogramVec // transport, endpoint
	named    map[string]int           // Config.MetricsTags, their index from 1 (0: all others); read only
	tags     []string                 // the tag label of each index
	// series[transport][endpoint][tag] and observers[transport][endpoint]
	// hold the resolved series.
	series    [2][len(endpoints)][]tagSeries
	observers [2][len(endpoints)]atomic.Pointer[prometheus.Observer]
	// collectors are what newMetrics registered.
	collectors []prometheus.Collector
}

// tagSeries are the counters of one transport, endpoint and tag, each
// resolved on first use. Two requests resolving one at once both store
// the same series (a vector returns the one child of its labels).
type tagSeries struct {
	requests [len(codes)]atomic.Pointer[prometheus.Counter]
	ids      atomic.Pointer[prometheus.Counter]
}

func newMetrics(reg prometheus.Registerer, s *Service) (*metrics, error) {
	if reg == nil {
		return nil, nil
	}
	m := &metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "dispenser_requests_total",
			Help: "Requests answered, by transport (nats, or http: Leaf's HTTP API), endpoint (or HTTP path kind), tag and reply code (200 for IDs).",
		}, []string{"transport", "endpoint", "tag", "code"}),
		ids: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "dispenser_ids_total",
			Help: "IDs handed out, by transport, endpoint and tag.",
		}, []string{"transport", "endpoint", "tag"}),
		latency: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "dispenser_request_duration_seconds",
			Help:    "Time from receiving a request to publishing (NATS) or writing (HTTP) its reply, including any wait for a segment, by transport and endpoint.",
			Buckets: []float64{10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3, 1},
		}, []string{"transport", "endpoint"}),
		named: map[string]int{},
		tags:  []string{""},
	}
	for _, t := range s.cfg.MetricsTags {
		if _, ok := m.named[t]; !ok {
			m.named[t] = len(m.tags)
			m.tags = append(m.tags, t)
		}
	}
	for tr := range m.series {
		for e := range m.series[tr] {
			m.series[tr][e] = make([]tagSeries, len(m.tags))
		}
	}
	cs := []prometheus.Collector{m.requests, m.ids, m.latency, refusedCollector{s}, servingCollector{s}}
	if s.cfg.Segments != nil {
		cs = append(cs, segmentCollector{s.cfg.Segments, s.cfg.MetricsTags})
	}
	if s.cfg.Snowflake != nil {
		cs = append(cs, snowflakeCollector{s.cfg.Snowflake})
	}
	if s.cfg.Owners != nil && s.cfg.Segments != nil { // the service has ordered tags
		cs = append(cs, ownersCollector{s})
	}
	for i, c := range cs {
		if err := reg.Register(c); err != nil {
			for _, r := range cs[:i] {
				reg.Unregister(r)
			}
			return nil, err
		}
	}
	m.collectors = cs
	return m, nil
}

// unregister takes m's collectors out of reg again (New failed).
func (m *metrics) unregister(reg prometheus.Registerer) {
	if m == nil {
		return
	}
	for _, c := range m.collectors {
		reg.Unregister(c)
	}
}

// endpointIndex returns the index in endpoints of an endpoint label value
// (other for one not in it).
func endpointIndex(e string) int {
	switch e {
	case "segment":
		return 0
	case "snowflake":
		return 1
	case "snowflake_decode":
		return 2
	case "cache":
		return 3
	case "db":
		return 4
	}
	return len(endpoints) - 1
}

// codeIndex returns the index in codes of a reply code, or -1.
func codeIndex(c string) int {
	for i, k := range codes {
		if k == c {
			return i
		}
	}
	return -1
}

// observe records one request answered over NATS. tag is counted under
// its own label value only if it is named in Config.MetricsTags, else
// under "". start is when it came, as mono read it.
func (m *metrics) observe(endpoint, tag, code string, ids int, start time.Duration) {
	if m == nil {
		return
	}
	m.record(0, endpoint, tag, code, ids, mono()-start)
}

// record records one answered request of transport tr (0 NATS, 1 HTTP)
// that took d.
func (m *metrics) record(tr int, endpoint, tag, code string, ids int, d time.Duration) {
	if m == nil {
		return
	}
	transport := [2]string{TransportNATS, TransportHTTP}[tr]
	e := endpointIndex(endpoint)
	endpoint = endpoints[e]
	ti := m.named[tag] // 0, "", for a tag not named
	ts := &m.series[tr][e][ti]
	// Each series is resolved by its labels once, then loaded from its
	// slot (no closures: nothing here allocates once resolved).
	if c := codeIndex(code); c < 0 {
		m.requests.WithLabelValues(transport, endpoint, m.tags[ti], code).Inc()
	} else if p := ts.requests[c].Load(); p != nil {
		(*p).Inc()
	} else {
		ctr := m.requests.WithLabelValues(transport, endpoint, m.tags[ti], code)
		ts.requests[c].Store(&ctr)
		ctr.Inc()
	}
	if ids > 0 {
		if p := ts.ids.Load(); p != nil {
			(*p).Add(float64(ids))
		} else {
			ctr := m.ids.WithLabelValues(transport, endpoint, m.tags[ti])
			ts.ids.Store(&ctr)
			ctr.Add(float64(ids))
		}
	}
	if p := m.observers[tr][e].Load(); p != nil {
		(*p).Observe(d.Seconds())
	} else {
		o := m.latency.WithLabelValues(transport, endpoint)
		m.observers[tr][e].Store(&o)
		o.Observe(d.Seconds())
	}
}

// ObserveHTTP records one request of Leaf's HTTP API (package leafhttp's
// Settings.Observe): endpoint is the path's kind (segment, snowflake,
// snowflake_decode, cache, db; anything else counts as other), code the
// reply code (the HTTP status), ids how many IDs it handed out, start
// when it arrived. It records nothing without Config.Registerer.
func (s *Service) ObserveHTTP(endpoint, tag, code string, ids int, start time.Time) {
	if s.metrics != nil {
		s.metrics.record(1, endpoint, tag, code, ids, time.Since(start))
	}
}

var refusedDesc = prometheus.NewDesc("dispenser_requests_refused_total",
	"Requests neither answered nor served because of their reply subject: none (no_reply), or one the service never publishes to (reply_subject: a system namespace, the service's own subjects, malformed or too long).",
	[]string{"reason"}, nil)

// refusedCollector exports the requests refused for their reply subject.
type refusedCollector struct{ s *Service }

func (c refusedCollector) Describe(ch chan<- *prometheus.Desc) { ch <- refusedDesc }

func (c refusedCollector) Collect(ch chan<- prometheus.Metric) {
	ch <- prometheus.MustNewConstMetric(refusedDesc, prometheus.CounterValue, float64(c.s.noReply.Load()), "no_reply")
	ch <- prometheus.MustNewConstMetric(refusedDesc, prometheus.CounterValue, float64(c.s.badReply.Load()), "reply_subject")
}

var (
	servingDesc = prometheus.NewDesc("dispenser_endpoint_serving",
		"1 while the worker is in the endpoint's queue group, 0 while it has left it because it cannot serve it (snowflake: no valid lease or the clock behind; segment: before the tag list loaded).",
		[]string{"endpoint"}, nil)
	handedOffDesc = prometheus.NewDesc("dispenser_requests_handed_off_total",
		"Requests this worker could not serve and handed to another worker of its queue group (snowflake: in the moment before it left the group; segment: no segment within --max-wait).",
		[]string{"endpoint"}, nil)
)

// handOffEndpoints are the endpoints whose requests may be handed on, by
// their index in Service.handedOff.
var handOffEndpoints = [2]string{"segment", "snowflake"}

// handOffIndex is endpoint's index in Service.handedOff.
func handOffIndex(endpoint string) int {
	if endpoint == "snowflake" {
		return 1
	}
	return 0
}

// servingCollector exports which endpoints the worker serves.
type servingCollector struct{ s *Service }

func (c servingCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- servingDesc
	ch <- handedOffDesc
}

func (c servingCollector) Collect(ch chan<- prometheus.Metric) {
	if c.s.bound.Load() == nil {
		return
	}
	for name, ok := range c.s.Serving() {
		v := 0.0
		if ok {
			v = 1
		}
		ch <- prometheus.MustNewConstMetric(servingDesc, prometheus.GaugeValue, v, name)
	}
	for i, name := range handOffEndpoints {
		if i == 0 && c.s.cfg.Segments != nil || i == 1 && c.s.cfg.Snowflake != nil {
			ch <- prometheus.MustNewConstMetric(handedOffDesc, prometheus.CounterValue, float64(c.s.handedOff[i].Load()), name)
		}
	}
}

var (
	segFetches = prometheus.NewDesc("dispenser_segment_fetches_total",
		"Segments fetched from the store, by tag.", []string{"tag"}, nil)
	segLastFetch = prometheus.NewDesc("dispenser_segment_last_fetch_duration_seconds",
		"Latency of the tag's last segment fetch.", []string{"tag"}, nil)
	segStep = prometheus.NewDesc("dispenser_segment_step",
		"Current dynamic step of the tag.", []string{"tag"}, nil)
	segNextReady = prometheus.NewDesc("dispenser_segment_next_ready",
		"1 when the tag's next segment is in memory.", []string{"tag"}, nil)
	segRemaining = prometheus.NewDesc("dispenser_segment_remaining_ids",
		"IDs left in memory for the tag (both segments).", []string{"tag"}, nil)
	segWaits = prometheus.NewDesc("dispenser_segment_waits_total",
		"Requests that waited for a segment because both buffers were empty.", []string{"tag"}, nil)
	segTimeouts = prometheus.NewDesc("dispenser_segment_wait_timeouts_total",
		"Waits for a segment that expired (answered 503).", []string{"tag"}, nil)

	segTags = prometheus.NewDesc("dispenser_segment_tags",
		"Tags in memory (requested and not released as idle).", nil, nil)
	segReleased = prometheus.NewDesc("dispenser_segment_released_tags_total",
		"Idle tags that gave their unused IDs back and dropped their buffers.", nil, nil)
	segAllFetches = prometheus.NewDesc("dispenser_segment_all_fetches_total",
		"Segments fetched from the store, all tags in memory.", nil, nil)
	segAllWaits = prometheus.NewDesc("dispenser_segment_all_waits_total",
		"Requests that waited for a segment, all tags in memory.", nil, nil)
	segAllTimeouts = prometheus.NewDesc("dispenser_segment_all_wait_timeouts_total",
		"Waits for a segment that expired, all tags in memory.", nil, nil)
	segAllRemaining = prometheus.NewDesc("dispenser_segment_all_remaining_ids",
		"IDs left in memory, all tags.", nil, nil)
)

// segmentCollector exports at scrape time, so that the hot path pays
// nothing for it, the totals over all tags and the per-tag state of the
// tags named in Config.MetricsTags: a bounded set of series.
type segmentCollector struct {
	a     *segment.Allocator
	named []string
}

func (c segmentCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{segFetches, segLastFetch, segStep, segNextReady, segRemaining, segWaits, segTimeouts,
		segTags, segReleased, segAllFetches, segAllWaits, segAllTimeouts, segAllRemaining} {
		ch <- d
	}
}

func (c segmentCollector) Collect(ch chan<- prometheus.Metric) {
	tot := c.a.Totals()
	ch <- prometheus.MustNewConstMetric(segTags, prometheus.GaugeValue, float64(tot.Tags))
	ch <- prometheus.MustNewConstMetric(segReleased, prometheus.CounterValue, float64(tot.Released))
	ch <- prometheus.MustNewConstMetric(segAllFetches, prometheus.CounterValue, float64(tot.Fetches))
	ch <- prometheus.MustNewConstMetric(segAllWaits, prometheus.CounterValue, float64(tot.Waits))
	ch <- prometheus.MustNewConstMetric(segAllTimeouts, prometheus.CounterValue, float64(tot.WaitTimeouts))
	ch <- prometheus.MustNewConstMetric(segAllRemaining, prometheus.GaugeValue, float64(tot.Remaining))
	for _, t := range c.a.StatsOf(c.named) {
		ready, left := 0.0, int64(0)
		if t.NextReady {
			ready = 1
			left += t.Next.End - t.Next.Cursor
		}
		if t.Current != nil {
			left += t.Current.End - t.Current.Cursor
		}
		ch <- prometheus.MustNewConstMetric(segFetches, prometheus.CounterValue, float64(t.Fetches), t.Tag)
		ch <- prometheus.MustNewConstMetric(segLastFetch, prometheus.GaugeValue, t.LastFetchLatencyMS/1000, t.Tag)
		ch <- prometheus.MustNewConstMetric(segStep, prometheus.GaugeValue, float64(t.Step), t.Tag)
		ch <- prometheus.MustNewConstMetric(segNextReady, prometheus.GaugeValue, ready, t.Tag)
		ch <- prometheus.MustNewConstMetric(segRemaining, prometheus.GaugeValue, float64(left), t.Tag)
		ch <- prometheus.MustNewConstMetric(segWaits, prometheus.CounterValue, float64(t.Waits), t.Tag)
		ch <- prometheus.MustNewConstMetric(segTimeouts, prometheus.CounterValue, float64(t.WaitTimeouts), t.Tag)
	}
}

var (
	ordOwned     = prometheus.NewDesc("dispenser_ordered_owned_tags", "Ordered tags this worker owns.", nil, nil)
	ordClaims    = prometheus.NewDesc("dispenser_ordered_claims_total", "Ordered tags this worker took ownership of.", nil, nil)
	ordHandovers = prometheus.NewDesc("dispenser_ordered_handovers_total", "Claims that took an ordered tag over from another worker.", nil, nil)
	ordLosses    = prometheus.NewDesc("dispenser_ordered_losses_total", "Ordered tags this worker lost to another (not released).", nil, nil)
	ordForwarded = prometheus.NewDesc("dispenser_ordered_forwarded_total", "Requests forwarded to the owner of their ordered tag.", nil, nil)
	ordNoOwner   = prometheus.NewDesc("dispenser_ordered_no_owner_total", "Requests for ordered tags answered 503 because no worker owned their tag and this one could not claim it within the wait: the tag has no owner (its owner died and its lease has not run out yet, or JetStream is unreachable).", nil, nil)
	ordDirect    = prometheus.NewDesc("dispenser_ordered_direct_total", "Requests on this worker's direct subject, by outcome: served as the owner of their ordered tag, or misdirected (421: not the owner).", []string{"outcome"}, nil)
)

// ownersCollector exports the ownership of ordered tags at scrape time.
type ownersCollector struct{ s *Service }

func (c ownersCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{ordOwned, ordClaims, ordHandovers, ordLosses, ordForwarded, ordNoOwner, ordDirect} {
		ch <- d
	}
}

func (c ownersCollector) Collect(ch chan<- prometheus.Metric) {
	ot := c.s.orderedTags()
	if ot == nil {
		return
	}
	st := ot.stats()
	ch <- prometheus.MustNewConstMetric(ordOwned, prometheus.GaugeValue, float64(len(st.Owned)))
	ch <- prometheus.MustNewConstMetric(ordClaims, prometheus.CounterValue, float64(st.Claims))
	ch <- prometheus.MustNewConstMetric(ordHandovers, prometheus.CounterValue, float64(st.Handovers))
	ch <- prometheus.MustNewConstMetric(ordLosses, prometheus.CounterValue, float64(st.Losses))
	ch <- prometheus.MustNewConstMetric(ordForwarded, prometheus.CounterValue, float64(st.Forwarded))
	ch <- prometheus.MustNewConstMetric(ordNoOwner, prometheus.CounterValue, float64(st.NoOwner))
	ch <- prometheus.MustNewConstMetric(ordDirect, prometheus.CounterValue, float64(st.Direct), "served")
	ch <- prometheus.MustNewConstMetric(ordDirect, prometheus.CounterValue, float64(st.Misdirected), "misdirected")
}

func sfDesc(name, help string) *prometheus.Desc {
	return prometheus.NewDesc("dispenser_snowflake_"+name, help, nil, nil)
}

var (
	sfHeld        = sfDesc("lease_held", "1 while the worker holds a worker-ID lease.")
	sfWorkerID    = sfDesc("worker_id", "The leased worker ID, -1 when none is held.")
	sfFenced      = sfDesc("fenced", "1 while issuing is refused for want of a valid lease.")
	sfClockBehind = sfDesc("clock_behind", "1 while issuing is refused because the clock is behind the last timestamp used.")
	sfExpires     = sfDesc("lease_expires_timestamp_seconds", "When the lease expires unless renewed (Unix time).")
	sfIssued      = sfDesc("ids_issued_total", "Snowflake IDs issued.")
	sfBackwards   = sfDesc("clock_backwards_total", "Episodes of the clock moving back more than the tolerance (answered 503).")
	sfBackWaits   = sfDesc("clock_backwards_waits_total", "Small clock steps back that were waited out.")
	sfFencedEp    = sfDesc("fenced_total", "Episodes of refusing for want of a valid lease.")
	sfBeats       = sfDesc("heartbeats_total", "Successful lease renewals.")
	sfBeatFails   = sfDesc("heartbeat_failures_total", "Failed lease renewals.")
	sfLost        = sfDesc("lost_leases_total", "Worker IDs lost to another holder.")
	sfWriteBacks  = sfDesc("write_backs_total", "Released leases written back over a lease key an operator deleted or purged.")
	sfStopped     = sfDesc("stopped", "1 once the worker stopped issuing for good (its lease bucket was deleted or recreated).")
)

// snowflakeCollector exports the snowflake worker's lease state at scrape
// time.
type snowflakeCollector struct{ sf Snowflake }

func (c snowflakeCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{sfHeld, sfWorkerID, sfFenced, sfClockBehind, sfExpires, sfIssued, sfBackwards, sfBackWaits, sfFencedEp, sfBeats, sfBeatFails, sfLost, sfWriteBacks, sfStopped} {
		ch <- d
	}
}

func (c snowflakeCollector) Collect(ch chan<- prometheus.Metric) {
	st, ok := c.sf.Stats().(snowflake.NodeStats)
	if !ok {
		return
	}
	b := func(v bool) float64 {
		if v {
			return 1
		}
		return 0
	}
	gauge := func(d *prometheus.Desc, v float64) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v)
	}
	counter := func(d *prometheus.Desc, v uint64) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v))
	}
	gauge(sfHeld, b(st.Held))
	gauge(sfWorkerID, float64(st.WorkerID))
	gauge(sfFenced, b(st.Fenced))
	gauge(sfClockBehind, b(st.ClockBehind))
	gauge(sfExpires, float64(st.LeaseExpires.UnixMilli())/1000)
	counter(sfIssued, st.Issued)
	counter(sfBackwards, st.ClockBackwards)
	counter(sfBackWaits, st.ClockBackwardsWaits)
	counter(sfFencedEp, st.FencedEpisodes)
	counter(sfBeats, st.Heartbeats)
	counter(sfBeatFails, st.HeartbeatFailures)
	counter(sfLost, st.LostLeases)
	counter(sfWriteBacks, st.WriteBacks)
	gauge(sfStopped, b(st.Stopped != ""))
}
