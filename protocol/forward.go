package protocol

import (
	"fmt"
	"strconv"
	"strings"
)

// Forward is one request a worker forwards to the owner of its ordered
// tag: a line "<reply subject> <count> <format> <worker>" of the forwarded
// message, whose subject ends with the tag. The owner answers the
// requester at Reply directly.
type Forward struct {
	Reply  string
	N      int
	Format Format
	Worker bool // the requester asked for WorkerHeader
}

// AppendForward appends f as one line, newline included.
func AppendForward(dst []byte, f Forward) []byte {
	dst = append(dst, f.Reply...)
	dst = append(dst, ' ')
	dst = strconv.AppendInt(dst, int64(f.N), 10)
	dst = append(dst, ' ')
	dst = append(dst, f.Format.String()...)
	if f.Worker {
		return append(dst, " 1\n"...)
	}
	return append(dst, " 0\n"...)
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
	fw := Forward{Reply: f[0], Worker: f[3] == "1"}
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
