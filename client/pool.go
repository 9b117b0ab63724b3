package client

import (
	"context"
	"sync"

	"github.com/dispenser-dev/dispenser/protocol"
)

func (c *Client) pool(tag string) *pool {
	c.mu.Lock()
	defer c.mu.Unlock()
	p := c.pools[tag]
	if p == nil {
		p = &pool{c: c, tag: tag, ready: make(chan struct{})}
		c.pools[tag] = p
	}
	return p
}

// pool is the local range of one tag's prefetched IDs.
type pool struct {
	c   *Client
	tag string

	mu sync.Mutex // protects the fields below
	// runs are the IDs at hand, in increasing order; runs[0].first is next.
	runs    []protocol.Run
	left    int           // IDs in runs
	filling bool          // a refill request is in flight
	ready   chan struct{} // closed and replaced when a refill ends
	err     error         // the last refill's error
}

// take returns the next prefetched ID, waiting for a refill when none is at
// hand.
func (p *pool) take(ctx context.Context) (int64, error) {
	for {
		p.mu.Lock()
		if p.left > 0 {
			r := &p.runs[0]
			id := r.First
			if r.First == r.Last {
				p.runs = p.runs[1:]
			} else {
				r.First++
			}
			p.left--
			if p.left < p.c.prefetch/2 {
				p.refillLocked()
			}
			p.mu.Unlock()
			return id, nil
		}
		p.refillLocked()
		ready, err := p.ready, p.err
		p.mu.Unlock()
		select {
		case <-ready:
		case <-ctx.Done():
			return 0, ctx.Err()
		case <-p.c.ctx.Done():
			return 0, ErrClosed
		}
		p.mu.Lock()
		err = p.err
		empty := p.left == 0
		p.mu.Unlock()
		if empty && err != nil {
			return 0, err
		}
	}
}

// refillLocked starts a background refill unless one is in flight.
func (p *pool) refillLocked() {
	if p.filling || p.c.ctx.Err() != nil {
		return
	}
	p.filling = true
	go func() {
		runs, err := p.c.requestRuns(p.c.ctx, p.tag, p.c.prefetch, true, minSegment, nil)
		p.mu.Lock()
		defer p.mu.Unlock()
		p.filling = false
		p.err = err
		for _, r := range runs { // checked: prefetch IDs in all
			p.runs = append(p.runs, r)
			p.left += int(r.Len())
		}
		close(p.ready)
		p.ready = make(chan struct{})
	}()
}
