// Package redact masks the secrets in connection strings before they are
// printed: in logs, errors, the status page and the admin commands'
// output. Every place that shows a NATS URL, a PostgreSQL URL or DSN, or
// a MySQL DSN shows redact.URL of it, and nothing else.
package redact

import (
	"net/url"
	"regexp"
	"strings"
)

// Mask replaces a secret.
const Mask = "xxxxx"

// URL returns s with its secrets replaced by Mask, whichever of the forms
// the worker reads s is in:
//
//   - URLs, comma-separated (NATS: nats://user:pass@host,nats://token@host;
//     PostgreSQL: postgres://user:pass@host/db): the password, and a user
//     without a password, which NATS reads as a token, are masked (a
//     PostgreSQL user without a password is masked too: harmless);
//   - PostgreSQL keyword/value strings (host=h user=u password=p): the
//     password's value;
//   - MySQL DSNs as go-sql-driver writes them (user:password@tcp(h:3306)/db):
//     the password.
//
// Query parameters named like a secret (password, token, …) are masked
// in every form. Something URL cannot read is masked whole: it never
// returns a secret it failed to find.
func URL(s string) string {
	if s == "" {
		return ""
	}
	if !scheme.MatchString(s) {
		if m := mysqlDSN.FindStringSubmatch(s); m != nil {
			out := m[1]
			if m[2] != "" {
				out += ":" + Mask
			}
			return out + "@" + maskQuery(m[3])
		}
		if keyValue.MatchString(s) {
			return keyValue.ReplaceAllString(s, "${1}"+Mask)
		}
		if strings.ContainsAny(s, "@=:/ ") && !hostPort.MatchString(s) {
			return Mask // not a form we know: it may hold a secret
		}
		return s
	}
	parts := strings.Split(s, ",")
	for i, p := range parts {
		parts[i] = oneURL(strings.TrimSpace(p))
	}
	return strings.Join(parts, ",")
}

var (
	// scheme starts a URL.
	scheme = regexp.MustCompile(`^[a-zA-Z][a-zA-Z0-9+.-]*://`)
	// hostPort is a bare address.
	hostPort = regexp.MustCompile(`^[a-zA-Z0-9.\-\[\]:]+$`)
	// keyValue finds the secret values of a keyword/value string.
	keyValue = regexp.MustCompile(`(?i)(\b(?:password|passwd|pass|token|sslpassword)\s*=\s*)('(?:[^'\\]|\\.)*'|[^\s]*)`)
	// mysqlDSN is [user[:password]@]net(addr)/db?params: 1 the user, 2 ":" +
	// the password, 3 the rest.
	mysqlDSN = regexp.MustCompile(`^([^:@/]*)(:.*)?@([a-z0-9]*\(.*)$`)
	// secretParam finds query parameters named like a secret.
	secretParam = regexp.MustCompile(`(?i)([?&](?:password|passwd|pass|token|sslpassword|secret)=)([^&]*)`)
)

// oneURL masks one URL.
func oneURL(s string) string {
	if !scheme.MatchString(s) {
		return Mask // a piece of a secret that held a comma
	}
	u, err := url.Parse(s)
	if err != nil {
		return Mask
	}
	if u.User != nil {
		if _, ok := u.User.Password(); ok {
			u.User = url.UserPassword(u.User.Username(), Mask)
		} else {
			u.User = url.User(Mask) // NATS reads a lone user as a token
		}
	}
	// url.URL.String escapes the mask's characters in no way: Mask is
	// plain letters.
	return maskQuery(u.String())
}

// maskQuery masks the secret query parameters of s.
func maskQuery(s string) string {
	return secretParam.ReplaceAllString(s, "${1}"+Mask)
}
