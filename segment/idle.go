package segment

import (
	"context"
	"time"
)

// idleLoop drops the buffers of tags without requests for IdleTimeout, until
// Close. It looks every IdleTimeout/2: a tag unused in two looks in a row is
// dropped, so after between one and one and a half IdleTimeouts.
func (a *Allocator) idleLoop() {
	defer a.wg.Done()
	t := time.NewTicker(a.idleTimeout / 2)
	defer t.Stop()
	for {
		select {
		case <-a.ctx.Done():
			return
		case <-t.C:
		}
		for _, b := range a.tags.all() {
			if b.used.Swap(false) {
				b.idleLooks = 0
				continue
			}
			if b.idleLooks++; b.idleLooks >= 2 {
				a.release(b)
			}
		}
	}
}

// release drops an idle tag's buffers and gives their unused IDs back, unless
// a fetch runs for it (then the next look tries again).
func (a *Allocator) release(b *buffer) {
	// Holding loading for good keeps any loader from starting for b.
	if !b.loading.CompareAndSwap(false, true) {
		return
	}
	if !a.tags.drop(b.tag, b) {
		b.loading.Store(false)
		return
	}
	b.mu.Lock()
	b.wakeAll() // requests holding b take the tag's new buffer
	b.mu.Unlock()
	a.released.Add(1)
	ctx, cancel := context.WithTimeout(a.ctx, a.fetchTimeout)
	defer cancel()
	if _, _, err := b.giveBack(ctx); err != nil {
		a.log.Warn("segment: idle tag's IDs not given back; they are skipped", "tag", b.tag, "err", err)
	}
}
