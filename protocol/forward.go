package protocol

import (
	"fmt"
	"strconv"
	"strings"
)

// Forward is one request a worker forwards to the owner of its ordered
// tag: a line "<reply subject> <count> <format> <flags>[:<token>]" of the
// forwarded message, whose subject ends with the tag. The owner answers
// the requester at Reply directly. flags is a decimal digit: 1 if the
// requester asked for WorkerHeader, plus 2 if it asked for DirectHeader (a
// worker that knows only the 1 reads any other value as no header).
// ":<token>" follows it if the request carried TokenHeader: the owner
// echoes it. (An owner older than TokenHeader reads "3:<token>" as no
// flags and answers without the token, which the Go client refuses:
// upgrade every worker before the clients.)
type Forward struct {
	Reply  string
	N      int
	Format Format
	Worker bool   // the requester asked for WorkerHeader
	Direct bool   // the requester asked for DirectHeader
	Token  string // the request's token, "" if none
	// BodyToken: the token came in the body (Request.BodyToken).
	BodyToken bool
}

// AppendForward appends f as one line, newline included.
func AppendForward(dst []byte, f Forward) []byte {
	dst = append(dst, f.Reply...)
	dst = append(dst, ' ')
	dst = strconv.AppendInt(dst, int64(f.N), 10)
	dst = append(dst, ' ')
	dst = append(dst, f.Format.String()...)
	flags := byte('0')
	if f.Worker {
		flags++
	}
	if f.Direct {
		flags += 2
	}
	if f.BodyToken && f.Token != "" {
		flags += 4
	}
	dst = append(dst, ' ', flags)
	if f.Token != "" {
		dst = append(dst, ':')
		dst = append(dst, f.Token...)
	}
	return append(dst, '\n')
}

// ParseForward reads one line (without its newline) of a forwarded
// message. A line whose fields are readable but whose count or format is
// not comes back with its Reply set and an error, so that the requester can
// be told; a line without four fields comes back with an empty Reply.
func ParseForward(line string) (Forward, error) {
	var f [4]string
	rest := line
	for i := range f {
		var ok bool
		if f[i], rest, ok = strings.Cut(rest, " "); !ok && i < 3 || ok && i == 3 || len(f[i]) == 0 {
			return Forward{}, fmt.Errorf("%w: forwarded line %q", ErrBadCount, truncate(line, 200))
		}
	}
	fw := Forward{Reply: f[0]}
	flags, token, tokened := strings.Cut(f[3], ":")
	if len(flags) == 1 && '0' <= flags[0] && flags[0] <= '7' {
		fl := flags[0] - '0'
		fw.Worker, fw.Direct, fw.BodyToken = fl&1 != 0, fl&2 != 0, fl&4 != 0
	}
	if tokened {
		if !ValidToken(token) {
			return fw, fmt.Errorf("%w: forwarded %s %q", ErrBadHeader, TokenHeader, truncate(token, 80))
		}
		fw.Token = token
	} else {
		fw.BodyToken = false // nothing to echo
	}
	var err error
	if fw.N, err = strconv.Atoi(f[1]); err != nil {
		return fw, fmt.Errorf("%w %q", ErrBadCount, truncate(f[1], 32))
	}
	switch f[2] {
	case "list":
		fw.Format = FormatList
	case "range":
		fw.Format = FormatRange
	default:
		return fw, fmt.Errorf("%w: format %q: want list or range", ErrBadHeader, truncate(f[2], 32))
	}
	return fw, nil
}
