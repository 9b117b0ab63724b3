package chaos

import (
	"fmt"
	"slices"
	"syscall"
	"time"

	"github.com/dispenser-dev/dispenser/internal/tests/wait"
)

// The faults on the owner of the ordered tag: while one is under way, the
// requests for the tag may fail only with 503 or time out (see
// checkOrderedFailures), and none may break linearizable increase. Each
// must show its effect: the tag's ownership moved to another worker
// process, as that process's stats say.

// ownerOf returns the slot of the worker that owns the ordered tag and its
// stats, waiting up to 20 s for one to own it (the load's requests make a
// worker claim it).
func (c *chaos) ownerOf() (int, *workerStats) {
	c.t.Helper()
	slot, st := -1, (*workerStats)(nil)
	err := wait.Until(20*time.Second, func() error {
		for i, p := range c.slots {
			s, err := statsOf(c.nc, p.id)
			if err == nil && slices.Contains(s.Ordered.Owned, orderedTag) {
				slot, st = i, s
				return nil
			}
		}
		return fmt.Errorf("no worker owns %s", orderedTag)
	})
	if err != nil {
		c.t.Fatalf("ordered tag: %v within 20s", err)
	}
	return slot, st
}

// awaitNewOwner waits up to d until a live worker process other than old
// owns the ordered tag, and returns it with its stats.
func (c *chaos) awaitNewOwner(old *proc, d time.Duration) (*proc, *workerStats, error) {
	var owner *proc
	var st *workerStats
	err := wait.Until(d, func() error {
		for _, p := range c.slots {
			if p == old {
				continue // perhaps frozen: its stats would only time out
			}
			s, err := statsOf(c.nc, p.id)
			if err == nil && slices.Contains(s.Ordered.Owned, orderedTag) {
				owner, st = p, s
				return nil
			}
		}
		return fmt.Errorf("no worker but %v owns %s", old, orderedTag)
	})
	return owner, st, err
}

// sigkillOwner kills the owner of the ordered tag and starts it again;
// another process must take the tag over once the dead owner's lease has
// expired.
func (c *chaos) sigkillOwner(name string) {
	i, _ := c.ownerOf()
	p := c.slots[i]
	w := c.log.begin(name)
	p.signal(c.t, syscall.SIGKILL)
	if !p.wait(10 * time.Second) {
		c.t.Fatalf("worker %v still runs 10s after SIGKILL", p)
	}
	ws, ok := p.state.Sys().(syscall.WaitStatus)
	killed := ok && ws.Signaled() && ws.Signal() == syscall.SIGKILL
	c.pause(200*time.Millisecond, 1500*time.Millisecond)
	c.slots[i] = c.fleet.start(p.instance)
	np, st, err := c.awaitNewOwner(p, 20*time.Second)
	c.log.end(w)
	switch {
	case err != nil:
		c.t.Errorf("%s: %v within 20s of killing the owner", name, err)
	case killed:
		c.log.observed(w, "owner %v killed by SIGKILL; %v took %s over (claims %d)", p, np, orderedTag, st.Ordered.Claims)
	}
	c.logf("%s: %v, restarted as %v; %v owns %s", name, p, c.slots[i], np, orderedTag)
}

// sigtermOwner stops the owner of the ordered tag gracefully (it hands the
// tag over at once) and starts it again.
func (c *chaos) sigtermOwner(name string) {
	i, _ := c.ownerOf()
	p := c.slots[i]
	w := c.log.begin(name)
	effect := c.terminate(p)
	np, st, err := c.awaitNewOwner(p, 20*time.Second)
	c.pause(200*time.Millisecond, time.Second)
	c.slots[i] = c.fleet.start(p.instance)
	c.log.end(w)
	switch {
	case err != nil:
		c.t.Errorf("%s: %v within 20s of stopping the owner", name, err)
	case effect != "":
		c.log.observed(w, "owner %s; %v took %s over (claims %d)", effect, np, orderedTag, st.Ordered.Claims)
	}
	c.logf("%s: %v, restarted as %v; %v owns %s", name, p, c.slots[i], np, orderedTag)
}

// sigstopOwner freezes the owner of the ordered tag until another worker
// has taken the tag over (its lease expired), then thaws it: the thawed
// worker must not own the tag any more and must recover by itself.
func (c *chaos) sigstopOwner(name string) {
	i, before := c.ownerOf()
	p := c.slots[i]
	w := c.log.begin(name)
	p.signal(c.t, syscall.SIGSTOP)
	np, st, err := c.awaitNewOwner(p, 20*time.Second)
	p.signal(c.t, syscall.SIGCONT)
	var after *workerStats
	thawErr := wait.Until(20*time.Second, func() error {
		s, err := statsOf(c.nc, p.id)
		if err != nil {
			return err
		}
		after = s
		switch {
		case slices.Contains(s.Ordered.Owned, orderedTag) && np != nil:
			return fmt.Errorf("still owns %s, which %v took over", orderedTag, np)
		case !s.Snowflake.Held || s.Snowflake.Fenced:
			return fmt.Errorf("snowflake lease: held %v, fenced %v", s.Snowflake.Held, s.Snowflake.Fenced)
		}
		return nil
	})
	c.log.end(w)
	switch {
	case err != nil:
		c.t.Errorf("%s: %v within 20s of freezing the owner %v", name, err, p)
	case thawErr != nil:
		c.t.Errorf("%s: thawed former owner %v did not recover within 20s: %v", name, p, thawErr)
	default:
		c.log.observed(w, "owner %v frozen; %v took %s over (claims %d); thawed %v no longer owns it (losses %d -> %d)",
			p, np, orderedTag, st.Ordered.Claims, p, before.Ordered.Losses, after.Ordered.Losses)
	}
	c.logf("%s: %v; %v owns %s", name, p, np, orderedTag)
}
