package worker

import "flag"

// AddFlags adds the NATS connection flags to fs, filling n: --nats-url
// (urlUsage says what it is for this command; empty: the caller defines
// it, as bench.LoadConfig.AddFlags does), the credentials and TLS flags,
// and with jetStream the --nats-js-* flags of serve's second connection.
// serve, the admin commands and bench all define them here.
func (n *NATS) AddFlags(fs *flag.FlagSet, urlUsage string, jetStream bool) {
	if urlUsage != "" {
		fs.StringVar(&n.URL, "nats-url", "", urlUsage)
	}
	fs.StringVar(&n.Context, "nats-context", "", "nats CLI context to connect with: NAME reads $XDG_CONFIG_HOME/nats/context/NAME.json (default ~/.config/nats/context/NAME.json), a path ending in .json that file; its url, credentials, TLS files and inbox_prefix apply where no --nats-* flag gives them (credentials flags replace the context's credentials as a whole); a context with settings dispenser does not support is refused")
	fs.StringVar(&n.Creds, "nats-creds", "", "NATS credentials file (JWT and seed)")
	fs.StringVar(&n.NKey, "nats-nkey", "", "NATS NKey seed file")
	fs.StringVar(&n.User, "nats-user", "", "NATS user, with --nats-password-file")
	fs.StringVar(&n.PasswordFile, "nats-password-file", "", "file holding the NATS user's password (its first line), so that the password is in no URL and no process list")
	fs.StringVar(&n.TokenFile, "nats-token-file", "", "file holding a NATS authentication token (its first line)")
	if jetStream {
		fs.StringVar(&n.JSURL, "nats-js-url", "", "NATS URL(s) of the second connection, which carries JetStream (KV store, witness, leases) and answers no requests; empty: --nats-url. A second user (--nats-js-creds, --nats-js-nkey) keeps JetStream rights away from the connection that answers requests")
		fs.StringVar(&n.JSCreds, "nats-js-creds", "", "credentials file of the JetStream connection; empty: the credentials of the first")
		fs.StringVar(&n.JSNKey, "nats-js-nkey", "", "NKey seed file of the JetStream connection; empty: the credentials of the first")
	}
	fs.StringVar(&n.TLSCA, "nats-tls-ca", "", "CA certificate file to verify the NATS server")
	fs.StringVar(&n.TLSCert, "nats-tls-cert", "", "client certificate file for NATS TLS")
	fs.StringVar(&n.TLSKey, "nats-tls-key", "", "client key file for NATS TLS")
}

// Args returns the context, credentials and TLS flags that AddFlags
// reads for n, for a child process (not --nats-url, not --nats-js-*): n
// as the flags gave it, not resolved, so that the child reads the same
// files and no secret reaches its command line.
func (n NATS) Args() []string {
	var a []string
	for _, f := range []struct{ name, v string }{
		{"nats-context", n.Context}, {"nats-creds", n.Creds}, {"nats-nkey", n.NKey},
		{"nats-user", n.User}, {"nats-password-file", n.PasswordFile}, {"nats-token-file", n.TokenFile},
		{"nats-tls-ca", n.TLSCA},
		{"nats-tls-cert", n.TLSCert}, {"nats-tls-key", n.TLSKey},
	} {
		if f.v != "" {
			a = append(a, "--"+f.name, f.v)
		}
	}
	return a
}
