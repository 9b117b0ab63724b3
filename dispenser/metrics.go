package dispenser

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/dispenser-dev/dispenser/segment"
	"github.com/dispenser-dev/dispenser/snowflake"
)

// metrics are the service's Prometheus metrics. A nil *metrics records
// nothing. Only the tags named in Config.MetricsTags get a label value of
// their own, so that the number of series is bounded whatever the number of
// tags.
type metrics struct {
	requests *prometheus.CounterVec   // endpoint, tag, code
	ids      *prometheus.CounterVec   // endpoint, tag
	latency  *prometheus.HistogramVec // endpoint
	named    map[string]bool          // Config.MetricsTags; read only
	// collectors are what newMetrics registered.
	collectors []prometheus.Collector
}

func newMetrics(reg prometheus.Registerer, s *Service) (*metrics, error) {
	if reg == nil {
		return nil, nil
	}
	m := &metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "dispenser_requests_total",
			Help: "Requests answered, by endpoint, tag and reply code (200 for IDs).",
		}, []string{"endpoint", "tag", "code"}),
		ids: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "dispenser_ids_total",
			Help: "IDs handed out, by endpoint and tag.",
		}, []string{"endpoint", "tag"}),
		latency: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "dispenser_request_duration_seconds",
			Help:    "Time from receiving a request to publishing its reply, including any wait for a segment.",
			Buckets: []float64{10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3, 1},
		}, []string{"endpoint"}),
		named: map[string]bool{},
	}
	for _, t := range s.cfg.MetricsTags {
		m.named[t] = true
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

// observe records one answered request. tag is counted under its own label
// value only if it is named in Config.MetricsTags, else under "".
func (m *metrics) observe(endpoint, tag, code string, ids int, start time.Time) {
	if m == nil {
		return
	}
	if !m.named[tag] {
		tag = ""
	}
	m.requests.WithLabelValues(endpoint, tag, code).Inc()
	if ids > 0 {
		m.ids.WithLabelValues(endpoint, tag).Add(float64(ids))
	}
	m.latency.WithLabelValues(endpoint).Observe(time.Since(start).Seconds())
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
		"Requests this worker could not serve and handed to another worker of its queue group (snowflake, in the moment before it left the group).",
		[]string{"endpoint"}, nil)
)

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
	if c.s.cfg.Snowflake != nil {
		ch <- prometheus.MustNewConstMetric(handedOffDesc, prometheus.CounterValue, float64(c.s.handedOff.Load()), "snowflake")
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
	st := ot.Stats()
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
	st, ok := c.sf.Stats().(snowflake.WorkerStats)
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
