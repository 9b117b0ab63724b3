package segment

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
)

// Close stops handing out IDs, stops background work and gives the unissued
// rest of each tag's last segment back to the store where nobody fetched
// after us, so that a restart wastes fewer IDs. A fetch under way is let
// finish (it is bounded by FetchTimeout) and its segment given back too;
// ctx bounds the give-back.
func (a *Allocator) Close(ctx context.Context) error {
	a.mu.Lock()
	if a.closed {
		a.mu.Unlock()
		return nil
	}
	a.closed = true
	a.mu.Unlock()
	a.cancel()
	a.wg.Wait()

	tags := a.tags.all()
	work := make(chan *buffer)
	errs := make(chan error, len(tags))
	type given struct {
		tag        string
		first, end int64
	}
	gave := make(chan given, len(tags))
	var wg sync.WaitGroup
	for range min(8, len(tags)) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for b := range work {
				first, end, err := b.giveBack(ctx)
				if err != nil {
					errs <- err
				} else if end > first {
					gave <- given{b.tag, first, end}
				}
			}
		}()
	}
	for _, b := range tags {
		work <- b
	}
	close(work)
	wg.Wait()
	close(errs)
	close(gave)
	// One line says what went back to the store: how many tags and IDs,
	// and the ranges of the first few tags by name.
	var list []given
	var ids int64
	for g := range gave {
		list, ids = append(list, g), ids+g.end-g.first
	}
	if len(list) > 0 {
		slices.SortFunc(list, func(x, y given) int { return strings.Compare(x.tag, y.tag) })
		var shown []string
		for _, g := range list[:min(len(list), 10)] {
			shown = append(shown, fmt.Sprintf("%s %d-%d", g.tag, g.first, g.end-1))
		}
		if len(list) > 10 {
			shown = append(shown, fmt.Sprintf("and %d more", len(list)-10))
		}
		a.log.Info("gave unissued segment IDs back to the store", "tags", len(list), "ids", ids, "ranges", strings.Join(shown, ", "))
	}
	var all []error
	for err := range errs {
		all = append(all, err)
	}
	return errors.Join(all...)
}
