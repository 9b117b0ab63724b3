package client

import (
	"errors"
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
	c.directMu.RLock()
	d, ok := c.direct[tag]
	c.directMu.RUnlock()
	if !ok {
		return segment, false
	}
	return d, true
}

// learnDirect remembers the direct subject a reply for tag names, if it
// is one of tag's (protocol.CheckDirect: a reply is untrusted) and tag's
// direct subjects are not held off.
func (c *Client) learnDirect(tag string, d string) {
	if d == "" || c.noDirect || protocol.CheckDirect(d, c.prefix, tag) != nil {
		return
	}
	c.directMu.RLock()
	cur, off := c.direct[tag], c.directOff[tag]
	c.directMu.RUnlock()
	if cur == d || !off.IsZero() && time.Now().Before(off) {
		return
	}
	c.directMu.Lock()
	c.direct[tag] = d
	delete(c.directOff, tag)
	c.directMu.Unlock()
}

// forgetDirect drops tag's direct subject d, which failed; timedOut holds
// tag's direct subjects off for directHoldoff, or for good if the
// connection's last error is a permissions violation naming d.
func (c *Client) forgetDirect(tag, d string, timedOut bool) {
	c.directMu.Lock()
	defer c.directMu.Unlock()
	if c.direct[tag] == d {
		delete(c.direct, tag)
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
