package client

import (
	"errors"
	"maps"
	"strings"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/dispenser-dev/dispenser/protocol"
)

// directWanted is the value of protocol.DirectHeader on a request: any.
var directWanted = []string{"1"}

// directHoldoff is how long a tag's direct subjects are not used after one
// of them timed out.
const directHoldoff = time.Minute

// directSubject returns where tag's request goes: its owner's direct
// subject, if known and not held off, and true; else segment and false.
func (c *Client) directSubject(tag, segment string) (string, bool) {
	if c.noDirect {
		return segment, false
	}
	if m := c.direct.Load(); m != nil {
		if d, ok := (*m)[tag]; ok {
			return d, true
		}
	}
	return segment, false
}

// setDirect stores direct with tag's subject d, or without tag if d is
// empty: a new map (direct is read without a lock). Call with directMu.
func (c *Client) setDirect(tag, d string) {
	var m map[string]string
	if old := c.direct.Load(); old != nil {
		m = maps.Clone(*old)
	}
	if d == "" {
		delete(m, tag)
	} else {
		if m == nil {
			m = map[string]string{}
		}
		m[tag] = d
	}
	c.direct.Store(&m)
}

// learnDirect remembers the direct subject a reply for tag names, if it
// is one of tag's (protocol.CheckDirect: a reply is untrusted) and tag's
// direct subjects are not held off.
func (c *Client) learnDirect(tag string, d string) {
	if d == "" || c.noDirect {
		return
	}
	if cur, _ := c.directSubject(tag, ""); cur == d {
		return // known: the common case, without a lock or a check
	}
	if protocol.CheckDirect(d, c.prefix, tag) != nil {
		return
	}
	c.directMu.Lock()
	defer c.directMu.Unlock()
	if off := c.directOff[tag]; !off.IsZero() && time.Now().Before(off) {
		return
	}
	c.setDirect(tag, d)
	delete(c.directOff, tag)
}

// forgetDirect drops tag's direct subject d, which failed; timedOut holds
// tag's direct subjects off for directHoldoff, or for good if the
// connection's last error is a permissions violation naming d.
func (c *Client) forgetDirect(tag, d string, timedOut bool) {
	c.directMu.Lock()
	defer c.directMu.Unlock()
	if cur, _ := c.directSubject(tag, ""); cur == d {
		c.setDirect(tag, "")
	}
	if !timedOut {
		return
	}
	until := time.Now().Add(directHoldoff)
	if err := c.nc.LastError(); errors.Is(err, nats.ErrPermissionViolation) && strings.Contains(err.Error(), `"`+d+`"`) {
		until = time.Now().Add(100 * 365 * 24 * time.Hour) // for good
	}
	c.directOff[tag] = until
}
