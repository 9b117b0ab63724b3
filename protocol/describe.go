package protocol

import "strings"

// packages are the names dispenser's packages put before their errors'
// texts ("protocol: bad count", "segment: invalid tag"): words for a
// programmer reading a wrapped chain, not for the operator or client who
// reads the error.
var packages = map[string]bool{
	"bench": true, "client": true, "dispenser": true, "dispensertest": true, "kv": true, "kvbucket": true,
	"leafhttp": true, "lease": true, "mysql": true, "mysqlstore": true, "ordered": true, "ownership": true,
	"pgstore": true, "postgres": true, "protocol": true, "schema": true, "segment": true, "snowflake": true,
	"witness": true, "worker": true,
}

// Describe returns err's text as a person reads it, in an error reply's
// description or on an operator's screen: without the package names of
// dispenser's error chains ("kv: create tag: segment: invalid tag" reads
// "create tag: invalid tag"), and with a part that repeats the one before
// it said once ("invalid settings: invalid settings: …"). Parts are the
// text between ": "; quoted values are never changed, as a part that is a
// quoted value is never a bare package name.
func Describe(err error) string {
	if err == nil {
		return ""
	}
	parts := strings.Split(err.Error(), ": ")
	kept := parts[:0]
	for _, p := range parts {
		if packages[p] || (len(kept) > 0 && kept[len(kept)-1] == p) {
			continue
		}
		kept = append(kept, p)
	}
	if len(kept) == 0 {
		return err.Error()
	}
	return strings.Join(kept, ": ")
}
