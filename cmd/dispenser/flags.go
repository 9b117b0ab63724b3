package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"regexp"
	"strings"
)

// envName returns the environment variable that stands in for a flag:
// --nats-url is DISPENSER_NATS_URL.
func envName(flagName string) string {
	return "DISPENSER_" + strings.ToUpper(strings.ReplaceAll(flagName, "-", "_"))
}

// hasEnv reports whether the flag name of command cmd (a flag set's
// name) reads an environment variable. Environment variables are for what
// a deployment sets: every flag of serve, and the flags the other commands
// share with serve (the NATS connection, the store, buckets, regions, the
// snowflake epoch and layout), with serve's meaning. A command's own
// settings have none: an exported DISPENSER_STEP must not change the next
// `tags create`, nor DISPENSER_FORMAT a bench run. TestEnvironmentScope
// checks that every variable an admin command reads is one of serve's.
func hasEnv(cmd, name string) bool {
	return cmd == "serve" || strings.HasPrefix(name, "nats-") || sharedWithServe[name]
}

// sharedWithServe are the flags other than --nats-* that the other
// commands take with the meaning serve gives them.
var sharedWithServe = map[string]bool{
	"postgres-url": true, "mysql-url": true, "segment-bucket": true, "witness-bucket": true,
	"region": true, "region-bits": true, "regions": true,
	"snowflake-epoch": true, "snowflake-layout": true, "prefix": true,
}

// newFlagSet returns a flag set whose usage (--help, on out) lists every
// flag with its environment variable. It prints nothing on a parse error:
// parse returns the error with where to look.
func newFlagSet(name, synopsis string, out io.Writer) *flag.FlagSet {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(io.Discard) // the flag package's own error and usage print
	fs.Usage = func() {
		fmt.Fprintf(out, "usage: %s\n\n", synopsis)
		fs.VisitAll(func(f *flag.Flag) {
			typ, usage := flag.UnquoteUsage(f)
			fmt.Fprintf(out, "  --%s %s\n    \t%s", f.Name, typ, strings.ReplaceAll(usage, "\n", "\n    \t"))
			if f.DefValue != "" && f.DefValue != "false" && f.DefValue != "0" && f.DefValue != "0s" {
				fmt.Fprintf(out, " (default %s)", f.DefValue)
			}
			if hasEnv(name, f.Name) {
				fmt.Fprintf(out, "\n    \tenv %s", envName(f.Name))
			}
			fmt.Fprintln(out)
		})
	}
	return fs
}

// flagError turns an error of the flag package into one sentence with
// the flags as they are typed (--name) and where to look for the right
// ones, instead of the command's whole help (which the flag package
// prints on its output, discarded by newFlagSet).
func flagError(fs *flag.FlagSet, err error) error {
	msg := err.Error()
	if m := badBool.FindStringSubmatch(msg); m != nil {
		msg = fmt.Sprintf("--%s=%s: want true or false", m[2], m[1])
	} else if m := badValue.FindStringSubmatch(msg); m != nil {
		why := m[3]
		if f := fs.Lookup(m[2]); f != nil && (why == "parse error" || why == "value out of range") {
			typ, _ := flag.UnquoteUsage(f)
			why = "want " + map[string]string{"duration": "a duration such as 250ms, 2s or 1m", "int": "a whole number",
				"uint": "a whole number", "float": "a number"}[typ]
			if why == "want " {
				why = "want a " + typ
			}
			if m[3] == "value out of range" {
				why = "out of range"
			}
		}
		msg = fmt.Sprintf("--%s=%s: %s", m[2], m[1], why)
	} else {
		msg = dashName.ReplaceAllString(msg, "${1}--$2")
		msg = strings.Replace(msg, "flag provided but not defined", "unknown flag", 1)
	}
	return fmt.Errorf("%s\nrun 'dispenser %s --help' for its flags", msg, fs.Name())
}

var (
	badBool  = regexp.MustCompile(`^invalid boolean value "(.*)" for -([a-z0-9-]+): `)
	badValue = regexp.MustCompile(`^invalid value "(.*)" for flag -([a-z0-9-]+): (.*)$`)
	dashName = regexp.MustCompile(`(^|[ :])-([a-z0-9])`)
)

// parse parses args, allowing flags and positional arguments in any order,
// then fills every flag not given on the command line that hasEnv from its
// environment variable. It returns the positional arguments. --help
// prints the usage and returns flag.ErrHelp.
func parse(fs *flag.FlagSet, args []string) ([]string, error) {
	// The flag package calls Usage on every error: print it on --help only.
	usage := fs.Usage
	fs.Usage = func() {}
	defer func() { fs.Usage = usage }()
	var pos []string
	for {
		if err := fs.Parse(args); errors.Is(err, flag.ErrHelp) {
			usage()
			return nil, err
		} else if err != nil {
			return nil, flagError(fs, err)
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
		if set[f.Name] || err != nil || !hasEnv(fs.Name(), f.Name) {
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

// urlFileFlag adds --NAME-file to fs: a file whose first line is the
// value of --NAME (a database URL with a password), so that the secret
// is in no process list. Giving both is refused by checkURLFile.
func urlFileFlag(fs *flag.FlagSet, dst *string, name, what string) {
	fs.Func(name+"-file", "file holding "+what+" (its first line), instead of --"+name+": the password stays out of the process list", func(path string) error {
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		line, _, _ := strings.Cut(string(b), "\n")
		if *dst = strings.TrimSpace(line); *dst == "" {
			return fmt.Errorf("%s: the file is empty", path)
		}
		return nil
	})
}

// checkURLFiles refuses --NAME and --NAME-file together, for each name.
func checkURLFiles(fs *flag.FlagSet, names ...string) error {
	given := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { given[f.Name] = true })
	for _, n := range names {
		for _, e := range []string{n, n + "-file"} {
			if _, ok := os.LookupEnv(envName(e)); ok && !given[e] {
				given[e] = os.Getenv(envName(e)) != ""
			}
		}
		if given[n] && given[n+"-file"] {
			return fmt.Errorf("--%s and --%s-file: give one", n, n)
		}
	}
	return nil
}

// inboxFlag adds --nats-inbox-prefix, the inbox prefix of the command's
// connection (serve: of the one that answers requests), to fs.
func inboxFlag(fs *flag.FlagSet, p *string) {
	fs.StringVar(p, "nats-inbox-prefix", "", "inbox prefix of the NATS connection (default _INBOX): with per-user inbox prefixes in a single account, the prefix this user may subscribe to, e.g. _INBOX_dispenser (docs/operations.md)")
}
