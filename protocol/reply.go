package protocol

import (
	"fmt"
	"strings"
)

// MaxReplyLen is the longest reply subject a worker answers to, in bytes.
// Inboxes of NATS clients are about 50 bytes.
const MaxReplyLen = 512

// CheckReply decides whether a worker may publish a reply to subject reply,
// a value every requester chooses freely. A worker's connection may hold
// rights its requesters lack (in zero-setup mode it holds all of them), so
// a reply subject is input, and these are refused:
//
//   - an empty one (ErrNoReply);
//   - one longer than MaxReplyLen, with an empty token, a wildcard token
//     ("*" or ">"), or a byte that is white space or a control character;
//   - one whose first token starts with "$": every system namespace of
//     NATS ($JS JetStream, $KV key-value, $O object store, $SYS system
//     account, $SRV micro services, $G, $GR, $MQTT, $NRG and any added
//     later);
//   - one equal to or below one of own, the service's own subject
//     prefixes (its prefix, where requests and forwarded requests arrive).
//
// Every other subject is allowed: _INBOX.> (the default inbox prefix of
// every NATS client), custom inbox prefixes, and _R_.> (replies to
// requests that came through an account's service import).
func CheckReply(reply string, own ...string) error {
	if reply == "" {
		return ErrNoReply
	}
	if len(reply) > MaxReplyLen {
		return fmt.Errorf("%w: %d bytes, longer than %d", ErrBadReply, len(reply), MaxReplyLen)
	}
	if reply[0] == '$' {
		return fmt.Errorf("%w %q: a system namespace ($...)", ErrBadReply, truncate(reply, 64))
	}
	// One pass over the bytes: most are letters, digits or '_' (above '.',
	// below DEL) and need one comparison; white space, controls, DEL and
	// the token-ending dot are looked at, and '*' or '>' only as a whole
	// token. Errors in the order of the bytes, as a reader would find them.
	tokenStart := 0
	for i := 0; i < len(reply); i++ {
		c := reply[i]
		if c > '.' && c < 0x7f {
			continue
		}
		if c <= ' ' || c == 0x7f {
			return fmt.Errorf("%w %q: white space or a control character", ErrBadReply, truncate(reply, 64))
		}
		if c != '.' {
			continue
		}
		if err := checkToken(reply, reply[tokenStart:i]); err != nil {
			return err
		}
		tokenStart = i + 1
	}
	if err := checkToken(reply, reply[tokenStart:]); err != nil {
		return err
	}
	for _, p := range own {
		if p != "" && (reply == p || strings.HasPrefix(reply, p) && reply[len(p)] == '.') {
			return fmt.Errorf("%w %q: the service's own subjects (%s.>)", ErrBadReply, truncate(reply, 64), p)
		}
	}
	return nil
}

// checkToken refuses tok, a token of reply, if it is empty or a wildcard.
func checkToken(reply, tok string) error {
	switch {
	case tok == "":
		return fmt.Errorf("%w %q: an empty token", ErrBadReply, truncate(reply, 64))
	case tok == "*" || tok == ">":
		return fmt.Errorf("%w %q: a wildcard", ErrBadReply, truncate(reply, 64))
	}
	return nil
}
