package worker

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
)

// Context is what dispenser reads of a nats CLI context (ADR-21, the
// files `nats context save` writes): where to connect and how to
// authenticate. Paths may start with ~ (the home directory), as the nats
// CLI allows.
//
// The file is read here rather than with github.com/nats-io/jsm.go's
// natscontext: that package pulls in the JetStream management API, the
// nats-server's certificate store and resolvers that run programs (nsc,
// 1Password's op) or read other files, none of which a worker should do
// behind an operator's back, and it ignores fields it does not use. This
// reader knows every field of the format: it uses those below, ignores
// only the cosmetic ones (description, color_scheme), and refuses a
// context that sets anything else, so that a setting the operator relies
// on (a JetStream domain, a SOCKS proxy, a JWT given inline, a secret
// given as a reference to a resolver) is never silently dropped.
type Context struct {
	URL         string `json:"url"`
	User        string `json:"user"`
	Password    string `json:"password"`
	Token       string `json:"token"`
	Creds       string `json:"creds"`
	NKey        string `json:"nkey"`
	Cert        string `json:"cert"`
	Key         string `json:"key"`
	CA          string `json:"ca"`
	InboxPrefix string `json:"inbox_prefix"`
	path        string // the file read
}

// contextFields are the fields of a context file: read (true), or
// ignored as cosmetic (false). Every other field set to anything but its
// zero value is refused.
var contextFields = map[string]bool{
	"url": true, "user": true, "password": true, "token": true, "creds": true, "nkey": true,
	"cert": true, "key": true, "ca": true, "inbox_prefix": true,
	"name": false, "description": false, "color_scheme": false,
}

// contextName is a context's name as the nats CLI allows it.
var contextName = regexp.MustCompile(`^[A-Za-z0-9_.-]+$`)

// resolverRef is a secret or path given as a reference for a resolver
// (env://, op://, nsc://, file://, …), which dispenser does not follow.
var resolverRef = regexp.MustCompile(`^[A-Za-z][A-Za-z0-9+.-]*://`)

// ContextPath returns the file of the context name: name itself if it
// ends in .json, else $XDG_CONFIG_HOME/nats/context/NAME.json (default
// ~/.config/nats/context/NAME.json).
func ContextPath(name string) (string, error) {
	if strings.HasSuffix(name, ".json") {
		return name, nil
	}
	if !contextName.MatchString(name) || strings.Contains(name, "..") {
		return "", fmt.Errorf("%w: --nats-context %q: want a context name (letters, digits, _ . -) or a .json file", ErrConfig, name)
	}
	dir := os.Getenv("XDG_CONFIG_HOME")
	if dir == "" {
		home, err := os.UserHomeDir()
		if err != nil {
			return "", fmt.Errorf("%w: --nats-context %q: no home directory to find it in (%w); give the file's path", ErrConfig, name, err)
		}
		dir = filepath.Join(home, ".config")
	}
	return filepath.Join(dir, "nats", "context", name+".json"), nil
}

// ReadContext reads the nats CLI context name (ContextPath). It refuses a
// context that sets a field dispenser does not support, naming it.
func ReadContext(name string) (Context, error) {
	path, err := ContextPath(name)
	if err != nil {
		return Context{}, err
	}
	data, err := os.ReadFile(path)
	if err != nil {
		return Context{}, fmt.Errorf("%w: --nats-context %q: %w", ErrConfig, name, err)
	}
	var fields map[string]json.RawMessage
	if err := json.Unmarshal(data, &fields); err != nil {
		return Context{}, fmt.Errorf("%w: --nats-context %q: %s: not a context file: %w", ErrConfig, name, path, err)
	}
	var unsupported []string
	var c Context
	for k, raw := range fields {
		use, known := contextFields[k]
		if !known {
			if isZeroJSON(raw) {
				continue
			}
			unsupported = append(unsupported, k)
			continue
		}
		if !use {
			continue
		}
		var v string
		if err := json.Unmarshal(raw, &v); err != nil {
			return Context{}, fmt.Errorf("%w: --nats-context %q: %s: field %q: want a string: %w", ErrConfig, name, path, k, err)
		}
		switch k {
		case "url":
			c.URL = v
		case "user":
			c.User = v
		case "password":
			c.Password = v
		case "token":
			c.Token = v
		case "creds":
			c.Creds = v
		case "nkey":
			c.NKey = v
		case "cert":
			c.Cert = v
		case "key":
			c.Key = v
		case "ca":
			c.CA = v
		case "inbox_prefix":
			c.InboxPrefix = v
		}
	}
	if len(unsupported) > 0 {
		slices.Sort(unsupported)
		return Context{}, fmt.Errorf("%w: --nats-context %q: %s sets %s, which dispenser does not support; "+
			"it reads only url, user, password, token, creds, nkey, cert, key, ca and inbox_prefix: "+
			"remove the others, or give the settings as --nats-* flags", ErrConfig, name, path, strings.Join(unsupported, ", "))
	}
	for _, f := range []struct{ name, v string }{
		{"password", c.Password}, {"token", c.Token}, {"creds", c.Creds}, {"nkey", c.NKey},
		{"cert", c.Cert}, {"key", c.Key}, {"ca", c.CA},
	} {
		if resolverRef.MatchString(f.v) {
			return Context{}, fmt.Errorf("%w: --nats-context %q: %s: %s is a reference for a credential resolver (%s…), which dispenser does not follow: "+
				"give the value, or a file's path", ErrConfig, name, path, f.name, f.v[:strings.Index(f.v, "://")+3])
		}
	}
	for _, p := range []*string{&c.Creds, &c.NKey, &c.Cert, &c.Key, &c.CA} {
		*p = expandHome(*p)
	}
	return c, nil
}

// isZeroJSON reports whether raw is a zero value: "", false, 0, null,
// [] or {}: the nats CLI writes every field, most of them empty.
func isZeroJSON(raw json.RawMessage) bool {
	switch string(bytes.TrimSpace(raw)) {
	case `""`, "false", "0", "null", "[]", "{}":
		return true
	}
	return false
}

// expandHome replaces a leading ~ of path with the home directory.
func expandHome(path string) string {
	if path != "~" && !strings.HasPrefix(path, "~/") {
		return path
	}
	home, err := os.UserHomeDir()
	if err != nil {
		return path
	}
	return filepath.Join(home, path[1:])
}
