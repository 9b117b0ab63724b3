package main

import (
	"flag"
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/dispenser-dev/dispenser/worker"
)

// envName returns the environment variable that stands in for a flag:
// --nats-url is DISPENSER_NATS_URL.
func envName(flagName string) string {
	return "DISPENSER_" + strings.ToUpper(strings.ReplaceAll(flagName, "-", "_"))
}

// newFlagSet returns a flag set whose usage lists every flag with its
// environment variable.
func newFlagSet(name, synopsis string, out io.Writer) *flag.FlagSet {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(out)
	fs.Usage = func() {
		fmt.Fprintf(out, "usage: %s\n\n", synopsis)
		fs.VisitAll(func(f *flag.Flag) {
			typ, usage := flag.UnquoteUsage(f)
			fmt.Fprintf(out, "  --%s %s\n    \t%s", f.Name, typ, strings.ReplaceAll(usage, "\n", "\n    \t"))
			if f.DefValue != "" && f.DefValue != "false" && f.DefValue != "0" && f.DefValue != "0s" {
				fmt.Fprintf(out, " (default %s)", f.DefValue)
			}
			fmt.Fprintf(out, "\n    \tenv %s\n", envName(f.Name))
		})
	}
	return fs
}

// parse parses args, allowing flags and positional arguments in any order,
// then fills every flag not given on the command line from its environment
// variable. It returns the positional arguments.
func parse(fs *flag.FlagSet, args []string) ([]string, error) {
	var pos []string
	for {
		if err := fs.Parse(args); err != nil {
			return nil, err
		}
		args = fs.Args()
		if len(args) == 0 {
			break
		}
		if args[0] == "--" {
			pos = append(pos, args[1:]...)
			break
		}
		pos = append(pos, args[0])
		args = args[1:]
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	var err error
	fs.VisitAll(func(f *flag.Flag) {
		if set[f.Name] || err != nil {
			return
		}
		if v, ok := os.LookupEnv(envName(f.Name)); ok {
			if e := fs.Set(f.Name, v); e != nil {
				err = fmt.Errorf("%s=%q: %w", envName(f.Name), v, e)
			}
		}
	})
	return pos, err
}

// natsFlags adds the NATS connection flags to fs, filling n: --nats-url
// (urlUsage says what it is for this command; empty: the caller defines
// it, as bench.LoadConfig.AddFlags does), the credentials and TLS flags,
// and with jetStream the --nats-js-* flags of serve's second connection.
// serve, the admin commands and bench all define them here.
func natsFlags(fs *flag.FlagSet, n *worker.NATS, urlUsage string, jetStream bool) {
	if urlUsage != "" {
		fs.StringVar(&n.URL, "nats-url", "", urlUsage)
	}
	fs.StringVar(&n.Creds, "nats-creds", "", "NATS credentials file (JWT and seed); user/password or token go in --nats-url")
	fs.StringVar(&n.NKey, "nats-nkey", "", "NATS NKey seed file")
	if jetStream {
		fs.StringVar(&n.JSURL, "nats-js-url", "", "NATS URL(s) of the second connection, which carries JetStream (KV store, witness, leases) and answers no requests; empty: --nats-url. Put a second user in it (nats://user:pass@host) to keep JetStream rights away from the connection that answers requests")
		fs.StringVar(&n.JSCreds, "nats-js-creds", "", "credentials file of the JetStream connection; empty: --nats-creds")
		fs.StringVar(&n.JSNKey, "nats-js-nkey", "", "NKey seed file of the JetStream connection; empty: --nats-nkey")
	}
	fs.StringVar(&n.TLSCA, "nats-tls-ca", "", "CA certificate file to verify the NATS server")
	fs.StringVar(&n.TLSCert, "nats-tls-cert", "", "client certificate file for NATS TLS")
	fs.StringVar(&n.TLSKey, "nats-tls-key", "", "client key file for NATS TLS")
}

// natsArgs returns the credentials and TLS flags that natsFlags reads for
// n, for a child process (not --nats-url, not --nats-js-*).
func natsArgs(n worker.NATS) []string {
	var a []string
	for _, f := range []struct{ name, v string }{
		{"nats-creds", n.Creds}, {"nats-nkey", n.NKey}, {"nats-tls-ca", n.TLSCA},
		{"nats-tls-cert", n.TLSCert}, {"nats-tls-key", n.TLSKey},
	} {
		if f.v != "" {
			a = append(a, "--"+f.name, f.v)
		}
	}
	return a
}

// inboxFlag adds --nats-inbox-prefix, the inbox prefix of the command's
// connection (serve: of the one that answers requests), to fs.
func inboxFlag(fs *flag.FlagSet, p *string) {
	fs.StringVar(p, "nats-inbox-prefix", "", "inbox prefix of the NATS connection (default _INBOX): with per-user inbox prefixes in a single account, the prefix this user may subscribe to, e.g. _INBOX_dispenser (docs/operations.md)")
}
