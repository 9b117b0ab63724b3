package client_test

import (
	"github.com/nats-io/nats.go"

	"github.com/dispenser-dev/dispenser/protocol"
)

// answer is the reply a worker gives m with data (the IDs): its token
// echoed where it came, in the body's first line (with direct, if any) or
// in protocol.TokenHeader (with protocol.DirectHeader, if direct is set).
func answer(m *nats.Msg, data []byte, direct string) *nats.Msg {
	resp := nats.NewMsg(m.Reply)
	token, inBody := protocol.RequestToken(m.Header, m.Data)
	switch {
	case inBody:
		resp.Data = append(protocol.AppendTokenLine(nil, token, direct), data...)
		return resp
	case token != "":
		resp.Header[protocol.TokenHeader] = []string{token}
	}
	if direct != "" {
		resp.Header.Set(protocol.DirectHeader, direct)
	}
	resp.Data = data
	return resp
}

// failure is a worker's error reply to m: code and desc in the micro
// error headers, its token echoed in protocol.TokenHeader.
func failure(m *nats.Msg, code, desc string) *nats.Msg {
	resp := nats.NewMsg(m.Reply)
	if token, _ := protocol.RequestToken(m.Header, m.Data); token != "" {
		resp.Header[protocol.TokenHeader] = []string{token}
	}
	resp.Header.Set(protocol.ErrorCodeHeader, code)
	resp.Header.Set(protocol.ErrorHeader, desc)
	return resp
}

// count is the count a request m asks for.
func count(m *nats.Msg) int {
	c, _, _ := protocol.SplitBody(m.Data)
	n, err := protocol.ParseCount(c, protocol.MaxCount)
	if err != nil {
		return 0
	}
	return n
}
