package bench

import (
	"context"
	"fmt"
	"slices"
)

// The client run (issue 38): the Go client's own cost. One bare counter
// responder (the baseline responder's handler under a prefix of its own)
// is called by the same number of callers, on one connection of the load
// child, first with plain nc.RequestWithContext calls, then with raw
// requests carrying a new token each (in the body, "1 <token>", its echo
// checked: what the protocol asks of any client that wants its replies
// checked), then through the Go client (Client.Segment: a token per
// request, every reply checked); then the service under test is called
// through the Go client. The four are loaded in turn, a slice each, and
// the whole is repeated Config.ClientRounds times: the ratios of each
// round are measured in the same stretch of time, so noise from the rest
// of the machine falls on all of them alike, and the rounds give their
// spread.

// clientBarePrefix is the prefix under which the bare responder of the
// client run answers.
const clientBarePrefix = "benchclient"

// Endpoints of the client run.
const (
	clientRaw     = "baseline" // raw nc.RequestWithContext, bare responder
	clientToken   = "raw request + token"
	clientBare    = "client, bare responder"
	clientService = "client, service"
)

// ClientResult sums up the client run; the rounds themselves are in the
// report's runs (mode "client").
type ClientResult struct {
	Rounds  int `json:"rounds"`
	Callers int `json:"callers"`
	// ClientVsRaw is the Go client's requests/s over a raw
	// nc.RequestWithContext's, both to the bare responder: the client's
	// own cost. ServiceVsRaw is the service's through the Go client over
	// the same raw requests to the bare responder.
	ClientVsRaw  Spread `json:"client_vs_raw"`
	ServiceVsRaw Spread `json:"service_vs_raw"`
	// TokenVsRaw is a raw request's with a new protocol.TokenHeader
	// (checked on the reply) over one's without, both to the bare
	// responder: the protocol's share of the client's cost. ClientVsToken
	// is the Go client's over the raw request with the token: the share
	// of the client's code.
	TokenVsRaw    Spread `json:"token_vs_raw"`
	ClientVsToken Spread `json:"client_vs_token"`
}

// Spread is a ratio measured in each round: its median and range.
type Spread struct {
	Median float64   `json:"median"`
	Min    float64   `json:"min"`
	Max    float64   `json:"max"`
	Rounds []float64 `json:"rounds"`
}

// spread returns the median and range of vs.
func spread(vs []float64) Spread {
	s := Spread{Rounds: vs}
	if len(vs) == 0 {
		return s
	}
	sorted := slices.Sorted(slices.Values(vs))
	s.Min, s.Max = sorted[0], sorted[len(sorted)-1]
	if n := len(sorted); n%2 == 1 {
		s.Median = sorted[n/2]
	} else {
		s.Median = round((sorted[n/2-1]+sorted[n/2])/2, 3)
	}
	return s
}

// runClient runs the client run's rounds.
func runClient(ctx context.Context, c Config, e *env, p *progress, run func(*group) error) error {
	p.note(fmt.Sprintf("client: a raw request and the Go client to a bare responder, the Go client to the service; %d rounds", c.ClientRounds))
	if err := startBaseline(e.baseNC, clientBarePrefix+".segment.*"); err != nil {
		return err
	}
	eps := []endpoint{
		{clientRaw, rawPrefix + clientBarePrefix + ".segment.bare"},
		{clientToken, tokenPrefix + clientBarePrefix + ".segment.bare"},
		{clientBare, clientPrefix + clientBarePrefix + ".segment.bare"},
		{clientService, clientPrefix + "id.segment." + c.Tag},
	}
	for r := range c.ClientRounds {
		label := fmt.Sprintf("Go client, round %d/%d: %d callers, 1 ID", r+1, c.ClientRounds, c.Inflight)
		if err := run(newGroup("client", label, c.Inflight, 1, "list", eps)); err != nil {
			return err
		}
	}
	return nil
}

// clientSummary sums up the client run's rounds in runs; nil without them.
func clientSummary(runs []*Result) *ClientResult {
	type trio struct{ raw, token, bare, service *Result }
	var labels []string
	rounds := map[string]*trio{}
	for _, r := range runs {
		if r.Mode != "client" {
			continue
		}
		rd := rounds[r.Label]
		if rd == nil {
			rd = &trio{}
			rounds[r.Label] = rd
			labels = append(labels, r.Label)
		}
		switch r.Endpoint {
		case clientRaw:
			rd.raw = r
		case clientToken:
			rd.token = r
		case clientBare:
			rd.bare = r
		case clientService:
			rd.service = r
		}
	}
	res := &ClientResult{}
	var bare, service, token, vsToken []float64
	for _, l := range labels {
		rd := rounds[l]
		if rd.raw == nil || rd.token == nil || rd.bare == nil || rd.service == nil || rd.raw.RPS <= 0 || rd.token.RPS <= 0 {
			continue
		}
		res.Rounds++
		res.Callers = rd.raw.Inflight
		bare = append(bare, round(rd.bare.RPS/rd.raw.RPS, 3))
		service = append(service, round(rd.service.RPS/rd.raw.RPS, 3))
		token = append(token, round(rd.token.RPS/rd.raw.RPS, 3))
		vsToken = append(vsToken, round(rd.bare.RPS/rd.token.RPS, 3))
	}
	if res.Rounds == 0 {
		return nil
	}
	res.ClientVsRaw, res.ServiceVsRaw = spread(bare), spread(service)
	res.TokenVsRaw, res.ClientVsToken = spread(token), spread(vsToken)
	return res
}
