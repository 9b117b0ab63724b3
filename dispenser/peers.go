package dispenser

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"

	"github.com/dispenser-dev/dispenser/segment"
)

// PrefixMetadata and QueueGroupMetadata are the micro metadata keys naming a
// worker's subject prefix and queue group, so that a worker is known as a
// peer of its queue group before it adds its endpoints.
const (
	PrefixMetadata     = "prefix"
	QueueGroupMetadata = "queue_group"
)

// checkPeers asks the running dispenser workers for their info and refuses
// (ErrPeerMismatch) if one of this worker's prefix is in another queue
// group, or one of its prefix and queue group uses another store, other
// snowflake leases or another owners bucket. New
// calls it after registering the service, so that others see this worker,
// and before adding the endpoints, so that it serves nothing yet: of two workers that start at
// the same instant, at least the one whose question reaches the server
// second sees the other and refuses.
func (s *Service) checkPeers(wait time.Duration, id string) error {
	inbox := s.cfg.Conn.NewRespInbox()
	sub, err := s.cfg.Conn.SubscribeSync(inbox)
	if err != nil {
		return fmt.Errorf("dispenser: asking for peers: %w", err)
	}
	defer sub.Unsubscribe()
	if err := s.cfg.Conn.PublishRequest("$SRV.INFO."+Name, inbox, nil); err != nil {
		return fmt.Errorf("dispenser: asking for peers: %w", err)
	}
	deadline := time.Now().Add(wait)
	for {
		msg, err := sub.NextMsg(time.Until(deadline))
		if errors.Is(err, nats.ErrTimeout) || errors.Is(err, nats.ErrNoResponders) {
			return nil // no more answers (or none at all): nothing conflicts
		}
		if err != nil {
			return fmt.Errorf("dispenser: asking for peers: %w", err)
		}
		var info micro.Info
		if json.Unmarshal(msg.Data, &info) != nil || info.ID == id || info.Metadata[PrefixMetadata] != s.cfg.Prefix {
			continue
		}
		// Queue groups do not divide subjects: NATS hands each request
		// to one member of every queue group subscribed to its subject,
		// so workers of two groups on one prefix both answer every
		// request, each with IDs of its own, and the requester takes
		// whichever comes first. From one store that wastes them; from
		// two stores (or lease buckets), which the checks below compare
		// only within a group, it hands out the same IDs.
		if group := info.Metadata[QueueGroupMetadata]; group != "" && group != s.cfg.QueueGroup {
			return fmt.Errorf("%w: worker %s serves %s<tag> in queue group %q, this one would join %q: "+
				"NATS hands every request to a worker of each queue group, so both would answer it, each with IDs of its own "+
				"(from two stores, the same IDs); use the same --queue-group, or another --prefix",
				ErrPeerMismatch, info.ID, s.segPrefix, group, s.cfg.QueueGroup)
		}
		settings, region := info.Metadata[RegionSettingsMetadata], info.Metadata[RegionMetadata]
		if settings != s.cfg.Region.Settings() {
			return fmt.Errorf("%w: worker %s in queue group %q has region settings %q, this one %q: "+
				"every region must use the same --region-bits and --regions (docs/regions.md)",
				ErrPeerMismatch, info.ID, s.cfg.QueueGroup, settings, s.cfg.Region.Settings())
		}
		otherRegion := settings != "" && region != regionN(s.cfg.Region)
		if other := info.Metadata[StoreMetadata]; s.cfg.Segments != nil && other != "" && !(otherRegion && s.cfg.Region.PerRegionStores()) &&
			!s.sameStore(other, info.Metadata[StoreIDMetadata]) {
			return fmt.Errorf("%w: worker %s in queue group %q serves %s<tag> from store %q, this one would use %q: "+
				"workers of different stores hand out the same IDs; use the same store, or another --prefix",
				ErrPeerMismatch, info.ID, s.cfg.QueueGroup, s.segPrefix, other, s.cfg.Store)
		}
		if other := info.Metadata[SnowflakeMetadata]; s.cfg.Snowflake != nil && other != "" && s.cfg.SnowflakeLeases != "" &&
			!(otherRegion && s.cfg.Region.PerRegionLeases()) && other != s.cfg.SnowflakeLeases {
			return fmt.Errorf("%w: worker %s in queue group %q serves %s.snowflake with worker IDs leased from %q, this one from %q: "+
				"workers of different lease buckets or epochs hand out the same IDs; use the same snowflake bucket "+
				"(in the same JetStream domain) and epoch, or another --prefix",
				ErrPeerMismatch, info.ID, s.cfg.QueueGroup, s.cfg.Prefix, other, s.cfg.SnowflakeLeases)
		}
		// Owners of ordered tags: one bucket for all regions but in
		// per-region mode, where each region orders its tags alone
		// (docs/regions.md).
		if other := info.Metadata[OwnersMetadata]; other != "" && s.cfg.OwnersBucket != "" &&
			!(otherRegion && s.cfg.Region.PerRegionStores()) && other != s.cfg.OwnersBucket {
			return fmt.Errorf("%w: worker %s in queue group %q records the owners of ordered tags in %q, this one in %q: "+
				"each would own an ordered tag at once and serve it from its own segments, out of order; use the same "+
				"--ordered-bucket (in the same JetStream domain), or another --prefix",
				ErrPeerMismatch, info.ID, s.cfg.QueueGroup, other, s.cfg.OwnersBucket)
		}
	}
}

// sameStore reports whether a peer that publishes store and id (maybe
// empty) uses this worker's store: by ID if both know theirs, else by the
// store's name (a peer of an earlier version publishes no ID).
//
// The names and IDs include the witness's (" witness:…", worker/pgstore),
// also between regions in shared mode: a store shared by all regions has
// one witness for all of them, or a region's witness would not know the
// segments other regions served before a rollback (docs/regions.md).
func (s *Service) sameStore(store, id string) bool {
	mine, myID := s.cfg.Store, s.cfg.StoreID
	if myID != "" && id != "" {
		return id == myID
	}
	return store == mine
}

// warm loads the tags b's peers served last (Config.WarmTimeout), unless
// there is no PeerCheck or the service stopped meanwhile.
func (s *Service) warm(b *binding) {
	if s.cfg.PeerCheck <= 0 {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), s.cfg.WarmTimeout)
	defer cancel()
	go func() {
		select {
		case <-s.done:
			cancel()
		case <-ctx.Done():
		}
	}()
	tags := s.peerTags(b)
	if len(tags) == 0 {
		return
	}
	t0 := time.Now()
	n := s.cfg.Segments.Warm(ctx, tags)
	s.cfg.Logger.Info("dispenser: warmed up the tags peers serve", "tags", n, "asked", min(len(tags), segment.WarmMax),
		"took", time.Since(t0).Round(time.Millisecond))
}

// peerTags asks the running workers of this prefix and queue group for
// their micro stats and returns the tags they hold, those fetched most
// recently first.
func (s *Service) peerTags(b *binding) []string {
	inbox := b.conn.NewRespInbox()
	sub, err := b.conn.SubscribeSync(inbox)
	if err != nil {
		return nil
	}
	defer sub.Unsubscribe()
	if err := b.conn.PublishRequest("$SRV.STATS."+Name, inbox, nil); err != nil {
		return nil
	}
	last := map[string]time.Time{}
	deadline := time.Now().Add(s.cfg.PeerCheck)
	for {
		msg, err := sub.NextMsg(time.Until(deadline))
		if err != nil {
			break // no more answers within PeerCheck (or none at all)
		}
		var st struct {
			micro.Stats
			Endpoints []struct {
				Name string `json:"name"`
				Data struct {
					Tags []segment.TagStats `json:"tags"`
				} `json:"data"`
			} `json:"endpoints"`
		}
		if json.Unmarshal(msg.Data, &st) != nil || st.ID == b.id ||
			st.Metadata[PrefixMetadata] != s.cfg.Prefix || st.Metadata[QueueGroupMetadata] != s.cfg.QueueGroup {
			continue
		}
		for _, e := range st.Endpoints {
			if e.Name != "segment" {
				continue
			}
			for _, t := range e.Data.Tags {
				if t.LastFetch.After(last[t.Tag]) || last[t.Tag].IsZero() {
					last[t.Tag] = t.LastFetch
				}
			}
		}
	}
	tags := slices.Collect(maps.Keys(last))
	slices.SortFunc(tags, func(x, y string) int { return last[y].Compare(last[x]) })
	return tags
}
