package client

import (
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/dispenser-dev/dispenser/protocol"
)

// Checking a reply's token (protocol.TokenHeader, or the body's first
// line for a token sent in the body), and going back to the header for
// workers older than body tokens.

// answer is a reply with IDs whose token was checked: its IDs (the body
// after the token line, if the token came in the body) and the direct
// subject it names, if any (unchecked: CheckDirect).
type answer struct {
	ids, direct []byte
}

// errOlderWorker is the answer of a worker older than body tokens to a
// request with one: 400 (it reads "<count> <token>" as a bad count),
// without the token, which it did not see.
var errOlderWorker = errors.New("client: a worker older than body tokens")

// check reads resp, the reply to r's attempt with a token in its body if
// inBody (else in protocol.TokenHeader): an answer, an *Error, or
// ErrBadReply if it is not a reply to this attempt (no token, or another
// one: never used, whatever it holds, error replies included), or
// errOlderWorker. A reply to a body token may echo it in the header
// instead: an owner older than body tokens does, for a request another
// worker forwarded to it (protocol.Forward).
func (c *Client) check(resp *nats.Msg, r *request, inBody bool) (answer, error) {
	if len(resp.Header) > 0 {
		code := resp.Header.Get(protocol.ErrorCodeHeader)
		got, echoed := resp.Header[protocol.TokenHeader]
		switch {
		case echoed && (len(got) != 1 || got[0] != string(r.token[:])) || !echoed && !inBody:
			return answer{}, c.notOurs(r, fmt.Sprintf("%s %.40q", protocol.TokenHeader, got))
		case !echoed && code == protocol.CodeBadRequest:
			return answer{}, errOlderWorker
		case code != "":
			if !echoed {
				return answer{}, c.notOurs(r, fmt.Sprintf("%s none", protocol.TokenHeader))
			}
			return answer{}, &Error{Code: code, Description: resp.Header.Get(protocol.ErrorHeader)}
		case echoed:
			return answer{ids: resp.Data, direct: []byte(resp.Header.Get(protocol.DirectHeader))}, nil
		}
	}
	if !inBody {
		return answer{}, c.notOurs(r, protocol.TokenHeader+" none")
	}
	tok, direct, ids, ok := protocol.CutTokenLine(resp.Data)
	if !ok || !r.tokenIs(tok) {
		return answer{}, c.notOurs(r, fmt.Sprintf("token line %.40q", tok))
	}
	return answer{ids: ids, direct: direct}, nil
}

// notOurs is the error of a reply to r that does not carry its token.
func (c *Client) notOurs(r *request, got string) error {
	return fmt.Errorf("%w from %s: %s, want the request's token (a forged reply, or a worker older than the token: upgrade the workers)",
		ErrBadReply, r.msg.Subject, got)
}

// headerTokensFor is how long a client that met a worker older than body
// tokens (errOlderWorker) sends its tokens in protocol.TokenHeader, before
// it tries the body again.
const headerTokensFor = time.Minute

// tokensInBody reports whether an attempt starting now sends its token in
// the body.
func (c *Client) tokensInBody() bool {
	u := c.headerUntil.Load()
	return u == 0 || time.Now().UnixNano() >= u
}
