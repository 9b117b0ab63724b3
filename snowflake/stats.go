package snowflake

import "time"

// NodeStats is the lease state reported by Stats.
type NodeStats struct {
	WorkerID int    `json:"worker_id"` // -1: none held
	Held     bool   `json:"held"`
	Instance string `json:"instance"`
	Bucket   string `json:"bucket"`
	// Epoch is the time of timestamp 0.
	Epoch time.Time `json:"epoch"`
	// Layout names the bit layout, e.g. "js (41+5+7 bits)".
	Layout string `json:"layout"`
	// LastHeartbeat is the wall time written by the last successful lease
	// write; LeaseExpires is it plus the lease.
	LastHeartbeat time.Time `json:"last_heartbeat"`
	LeaseExpires  time.Time `json:"lease_expires"`
	// Bound is the highest timestamp the worker may use under its lease.
	Bound time.Time `json:"bound"`
	// LastTimestamp is the timestamp of the last ID issued (or the floor
	// inherited from the previous holder).
	LastTimestamp time.Time `json:"last_timestamp"`
	// Fenced is true while issuing is refused for want of a valid lease.
	Fenced bool `json:"fenced"`
	// ClockBehind is true while issuing is refused because the clock is
	// behind.
	ClockBehind bool `json:"clock_behind"`
	Closed      bool `json:"closed"`
	// Issued counts IDs issued.
	Issued uint64 `json:"issued"`
	// ClockBackwards counts episodes of refusing because the clock was
	// more than MaxBackwards behind; ClockBackwardsWaits counts smaller
	// steps waited out.
	ClockBackwards      uint64 `json:"clock_backwards"`
	ClockBackwardsWaits uint64 `json:"clock_backwards_waits"`
	// FencedEpisodes counts episodes of refusing for want of a valid lease.
	FencedEpisodes uint64 `json:"fenced_episodes"`
	Heartbeats     uint64 `json:"heartbeats"`
	// HeartbeatFailures counts heartbeat writes that failed for other
	// reasons than losing the key.
	HeartbeatFailures uint64 `json:"heartbeat_failures"`
	// Claims counts worker IDs claimed; LostLeases counts worker IDs lost to
	// another holder.
	Claims     uint64 `json:"claims"`
	LostLeases uint64 `json:"lost_leases"`
	// WriteBacks counts released leases written back over the delete or
	// purge marker of our own key (an operator removed it while we held
	// it).
	WriteBacks uint64 `json:"write_backs"`
	// Stopped is set once the worker stopped for good because its lease
	// bucket was deleted or recreated: the reason.
	Stopped string `json:"stopped,omitempty"`
}

// Stats returns the lease state as a NodeStats (JSON-marshalable).
func (w *Node) Stats() any { return w.stats() }

func (w *Node) stats() NodeStats {
	w.mu.Lock()
	defer w.mu.Unlock()
	g := w.gen.stats()
	st := NodeStats{
		WorkerID:            w.id,
		Held:                w.id >= 0,
		Instance:            w.cfg.Instance,
		Bucket:              w.cfg.Bucket,
		Epoch:               w.cfg.Epoch,
		Layout:              w.gen.layout.String(),
		LastHeartbeat:       w.rec.Heartbeat,
		LeaseExpires:        w.rec.Expires,
		Bound:               w.rec.Bound,
		Fenced:              g.fenced && !w.closed,
		ClockBehind:         g.backwards,
		Closed:              w.closed,
		Issued:              g.issued,
		ClockBackwards:      g.backEvents,
		ClockBackwardsWaits: g.backWaits,
		FencedEpisodes:      g.fenceEvents,
		Heartbeats:          w.heartbeats,
		HeartbeatFailures:   w.holder.Failures(),
		Claims:              w.claims,
		LostLeases:          w.losses,
		WriteBacks:          w.writeBacks,
	}
	if w.gone != nil {
		st.Stopped = w.gone.Error()
	}
	if g.lastMs >= 0 {
		st.LastTimestamp = w.gen.msTime(g.lastMs)
	}
	return st
}
