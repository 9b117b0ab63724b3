package main

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/dispenser-dev/dispenser/segment/kv"
	"github.com/dispenser-dev/dispenser/segment/mysql"
	"github.com/dispenser-dev/dispenser/segment/postgres"
	"github.com/dispenser-dev/dispenser/segment/witness"
	"github.com/dispenser-dev/dispenser/snowflake"
	"github.com/dispenser-dev/dispenser/tagmodel"
	"github.com/dispenser-dev/dispenser/worker"
	"github.com/dispenser-dev/dispenser/worker/adminstore"
	"github.com/dispenser-dev/dispenser/worker/mysqlstore"
)

// storeFlags are the flags that select the store of admin commands.
type storeFlags struct {
	adminstore.Settings
	fs *flag.FlagSet // the flags, parsed by the time open is called
}

// regionFlags adds --region, --region-bits and --regions, as serve has
// them.
func regionFlags(fs *flag.FlagSet, r *worker.Region) {
	fs.IntVar(&r.N, "region", 0, "this worker's region, 0-based, with --region-bits or --regions: region-local buckets get the suffix _rN and are created in the worker's NATS cluster (docs/regions.md)")
	fs.IntVar(&r.Bits, "region-bits", 0, "bits of the 10 snowflake worker bits that name the region: each region leases worker IDs from its own bucket; every region must use the same (0: one lease bucket for all)")
	fs.IntVar(&r.Count, "regions", 0, "number of regions with segment stores of their own (per-region mode): region N hands out the values v of its store as IDs v×regions+N; every region must use the same (0 or 1: one store for all regions)")
}

func addStoreFlags(fs *flag.FlagSet) *storeFlags {
	f := &storeFlags{fs: fs}
	fs.StringVar(&f.PostgresURL, "postgres-url", "", "PostgreSQL URL of the segment store")
	fs.StringVar(&f.MySQLURL, "mysql-url", "", "MySQL/MariaDB DSN of the segment store (user:password@tcp(host:3306)/dbname); not with --postgres-url")
	urlFileFlag(fs, &f.PostgresURL, "postgres-url", "the PostgreSQL URL")
	urlFileFlag(fs, &f.MySQLURL, "mysql-url", "the MySQL/MariaDB DSN")
	f.NATS.AddFlags(fs, "NATS URL, for the JetStream KV segment store (when --postgres-url and --mysql-url are empty); with --postgres-url or --mysql-url, tags list shows the witness marks", false)
	inboxFlag(fs, &f.InboxPrefix)
	fs.StringVar(&f.Bucket, "segment-bucket", kv.DefaultBucket, "JetStream KV bucket of the segment store")
	fs.StringVar(&f.WitnessBucket, "witness-bucket", witness.DefaultBucket, "JetStream KV bucket of the witness marks (with --postgres-url or --mysql-url, and --nats-url)")
	regionFlags(fs, &f.Region)
	return f
}

// open opens the selected store (adminstore.Open) once the flags are
// checked. close releases it.
func (f *storeFlags) open(ctx context.Context) (st *worker.Store, w adminstore.Marker, close func(), err error) {
	if err := worker.CheckRegion(f.Region); err != nil {
		return nil, nil, nil, err
	}
	if err := checkURLFiles(f.fs, "postgres-url", "mysql-url"); err != nil {
		return nil, nil, nil, err
	}
	return adminstore.Open(ctx, f.Settings)
}

func migrate(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("migrate", "dispenser migrate --postgres-url URL | --mysql-url DSN", stderr)
	url := fs.String("postgres-url", "", "PostgreSQL URL of the segment store")
	dsn := fs.String("mysql-url", "", "MySQL/MariaDB DSN of the segment store (user:password@tcp(host:3306)/dbname): creates Leaf's leaf_alloc if missing, exactly as Leaf does, and dispenser's own two tables; changes no existing table")
	if _, err := parse(fs, args); err != nil {
		return err
	}
	if *dsn != "" {
		if *url != "" {
			return errors.New("--postgres-url and --mysql-url: give one segment store")
		}
		db, err := mysqlstore.Connect(ctx, *dsn)
		if err != nil {
			return err
		}
		defer db.Close()
		created, err := mysql.Migrate(ctx, db)
		if err != nil {
			return err
		}
		if len(created) == 0 {
			fmt.Fprintln(stdout, "tables are up to date")
		}
		for _, t := range created {
			fmt.Fprintln(stdout, "created table", t)
		}
		return nil
	}
	pool, err := adminstore.OpenPostgres(ctx, *url)
	if err != nil {
		return err
	}
	defer pool.Close()
	applied, err := postgres.Migrate(ctx, pool)
	if err != nil {
		return err
	}
	if len(applied) == 0 {
		fmt.Fprintln(stdout, "schema is up to date")
	}
	for _, v := range applied {
		fmt.Fprintln(stdout, "applied", v)
	}
	return nil
}

const tagsUsage = `dispenser tags list [store flags]
dispenser tags create TAG --step N [--start M] [--description D] [--ordered] [periodic flags] [store flags]
dispenser tags update TAG [--step N] [--description D] [--ordered=true|false] [periodic flags] [store flags]
dispenser tags import --from-mysql-url DSN --margin N [store flags]   (Leaf's rows; see tags import --help)
periodic flags: --reset day|month|year|none, --time-zone ZONE, --format TEMPLATE, --retention-days N
store flags: --postgres-url URL, --mysql-url DSN, or --nats-url URL [--segment-bucket B] for the JetStream KV store`

func tags(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) > 0 && (args[0] == "--help" || args[0] == "-h" || args[0] == "help") {
		fmt.Fprintln(stdout, "usage:\n"+tagsUsage)
		return nil
	}
	if len(args) == 0 {
		fmt.Fprintln(stderr, "usage:\n"+tagsUsage)
		return errors.New("tags: missing subcommand")
	}
	sub, args := args[0], args[1:]
	if sub == "import" {
		return importTags(ctx, args, stdout, stderr)
	}
	fs := newFlagSet("tags "+sub, tagsUsage, stderr)
	sf := addStoreFlags(fs)
	var step, start int64
	var desc string
	var ordered bool
	var reset, timeZone, format string
	var retention int
	periodicFlags := func(what string) {
		fs.StringVar(&reset, "reset", "none", what+"reset period: day, month or year (numbers start again from --start every period, each period a row of its own), or none; once set it cannot change")
		fs.StringVar(&timeZone, "time-zone", "", what+"IANA time zone the periods are counted in, e.g. Asia/Shanghai (empty: UTC)")
		fs.StringVar(&format, "format", "", what+"number format, e.g. ORD-{date:20060102}-{seq:6} ({date:LAYOUT} required with a reset period; once set, only the width of {seq} may change; docs/business-numbers.md)")
		fs.IntVar(&retention, "retention-days", 0, fmt.Sprintf("%sdays a period's row is kept after the period ended, 1..%d (0: %d)", what, tagmodel.MaxRetentionDays, tagmodel.DefaultRetentionDays))
	}
	switch sub {
	case "list":
	case "create":
		fs.Int64Var(&step, "step", 0, "IDs per segment (required)")
		fs.Int64Var(&start, "start", 1, "first ID of the tag")
		fs.StringVar(&desc, "description", "", "free text, at most 256 characters")
		fs.BoolVar(&ordered, "ordered", false, "an ordered tag: its IDs increase across all workers, not only within each")
		periodicFlags("")
	case "update":
		fs.Int64Var(&step, "step", 0, "new step (0 leaves it)")
		fs.StringVar(&desc, "description", "", "new description")
		fs.BoolVar(&ordered, "ordered", false, "--ordered=true makes the tag ordered (IDs increase across all workers), --ordered=false plain")
		periodicFlags("new ")
	default:
		fmt.Fprintln(stderr, "usage:\n"+tagsUsage)
		return fmt.Errorf("tags: unknown subcommand %q", sub)
	}
	pos, err := parse(fs, args)
	if err != nil {
		return err
	}
	wantArgs := 1
	if sub == "list" {
		wantArgs = 0
	}
	if len(pos) != wantArgs {
		if sub != "list" && slices.ContainsFunc(pos[1:], func(a string) bool { _, err := strconv.ParseBool(a); return err == nil }) {
			// "--ordered false" sets the flag and leaves "false" behind.
			return fmt.Errorf("tags %s: want 1 argument, got %d: write a boolean flag with =, e.g. --ordered=false\nusage:\n%s", sub, len(pos), tagsUsage)
		}
		return fmt.Errorf("tags %s: want %d argument(s), got %d\nusage:\n%s", sub, wantArgs, len(pos), tagsUsage)
	}
	given := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { given[f.Name] = true })
	st, marks, closeStore, err := sf.open(ctx)
	if err != nil {
		return err
	}
	defer closeStore()
	// A store records its region settings before its first tag
	// (tagmodel.CheckRegions), so that workers of other settings are
	// refused; tags list only reads them (tagmodel.MatchRegions).
	if rs, ok := st.Admin.(tagmodel.RegionStore); ok {
		check := tagmodel.CheckRegions
		if sub == "list" {
			check = tagmodel.MatchRegions
		}
		if err := check(ctx, rs, sf.Region.Segments()); err != nil {
			return err
		}
	}

	switch sub {
	case "list":
		return listTags(ctx, st, marks, stdout)
	case "create":
		if !given["step"] {
			return errors.New("tags create: --step is required")
		}
		t := tagmodel.Tag{Name: pos[0], Step: step, MaxID: start, Description: desc, Ordered: ordered,
			Reset: tagmodel.Reset(reset), TimeZone: timeZone, Format: format, RetentionDays: retention}
		if err := st.Admin.CreateTag(ctx, t); err != nil {
			return err
		}
		fmt.Fprintf(stdout, "created tag %s: first ID %d, step %d, ordered %s", pos[0], sf.Region.Segments().ID(start), step, yesNo(ordered))
		if r, _ := tagmodel.ParseReset(reset); r != tagmodel.ResetNone {
			fmt.Fprintf(stdout, ", reset every %s (%s)", r, cmp.Or(timeZone, "UTC"))
		}
		if format != "" {
			fmt.Fprintf(stdout, ", format %s", format)
		}
		fmt.Fprintln(stdout)
		return nil
	default: // update
		var u tagmodel.Update
		var changes []string
		if given["step"] {
			u.Step = &step
			changes = append(changes, fmt.Sprintf("step %d", step))
		}
		if given["description"] {
			u.Description = &desc
			changes = append(changes, fmt.Sprintf("description %q", desc))
		}
		if given["ordered"] {
			u.Ordered = &ordered
			changes = append(changes, "ordered "+yesNo(ordered))
		}
		if given["reset"] {
			r := tagmodel.Reset(reset)
			u.Reset = &r
			changes = append(changes, "reset "+reset)
		}
		if given["time-zone"] {
			u.TimeZone = &timeZone
			changes = append(changes, fmt.Sprintf("time zone %q", timeZone))
		}
		if given["format"] {
			u.Format = &format
			changes = append(changes, fmt.Sprintf("format %q", format))
		}
		if given["retention-days"] {
			u.RetentionDays = &retention
			changes = append(changes, fmt.Sprintf("retention %d days", retention))
		}
		if len(changes) == 0 {
			return errors.New("tags update: nothing to change: give --step, --description, --ordered=true|false, --reset, --time-zone, --format and/or --retention-days")
		}
		if err := st.Admin.UpdateTag(ctx, pos[0], u); err != nil {
			return err
		}
		fmt.Fprintf(stdout, "updated tag %s: %s\n", pos[0], strings.Join(changes, ", "))
		return nil
	}
}

// listTags prints the tags; with marks, a WITNESS column shows a tag's
// witness mark where it differs from the next ID (the store lost writes, or
// a fetch is in flight), "none" where the tag has no mark yet. ORDERED is
// yes for an ordered tag, no for a plain one. RESET is the reset period
// (none, day, month, year), with TIME ZONE and RETENTION for a tag that
// has one; FORMAT the number format, if any. NEXT ID of a tag with a reset
// period is every period's start.
func listTags(ctx context.Context, st tagmodel.Store, marks adminstore.Marker, stdout io.Writer) error {
	names, err := st.Tags(ctx)
	if err != nil {
		return err
	}
	w := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	if marks != nil {
		fmt.Fprintln(w, "TAG\tNEXT ID\tWITNESS\tSTEP\tORDERED\tRESET\tTIME ZONE\tRETENTION\tFORMAT\tUPDATED\tDESCRIPTION")
	} else {
		fmt.Fprintln(w, "TAG\tNEXT ID\tSTEP\tORDERED\tRESET\tTIME ZONE\tRETENTION\tFORMAT\tUPDATED\tDESCRIPTION")
	}
	for _, name := range names {
		t, err := st.Tag(ctx, name)
		if errors.Is(err, tagmodel.ErrUnknownTag) {
			continue // removed meanwhile
		}
		if err != nil {
			return err
		}
		fmt.Fprintf(w, "%s\t%d\t", t.Name, t.MaxID)
		if marks != nil {
			m, ok, err := marks.Mark(ctx, name)
			switch {
			case err != nil:
				return err
			case !ok:
				fmt.Fprint(w, "none")
			case m != t.MaxID:
				fmt.Fprint(w, m)
			}
			fmt.Fprint(w, "\t")
		}
		// A tag with a reset period shows its time zone (UTC if none) and
		// retention (the default if none); one without, none of them.
		zone, retention := "", ""
		if t.Reset != tagmodel.ResetNone {
			zone = cmp.Or(t.TimeZone, "UTC")
			retention = fmt.Sprintf("%dd", cmp.Or(t.RetentionDays, tagmodel.DefaultRetentionDays))
		}
		fmt.Fprintf(w, "%d\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", t.Step, yesNo(t.Ordered), t.Reset, zone, retention, t.Format,
			t.UpdateTime.UTC().Format(time.RFC3339), t.Description)
	}
	return w.Flush()
}

// yesNo shows a flag in tags' output.
func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "no"
}

func decode(args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("decode", "dispenser decode ID [--snowflake-epoch T] [--snowflake-layout default|js] [--region-bits B]", stderr)
	epoch := fs.String("snowflake-epoch", snowflake.DefaultEpoch.Format(time.RFC3339), "epoch of snowflake timestamps (RFC 3339)")
	layout := snowflake.DefaultLayout
	fs.Func("snowflake-layout", `bit layout the ID was issued in, as its workers' --snowflake-layout: "default" or "js" (default "default")`, func(v string) (err error) {
		layout, err = snowflake.ParseLayout(v)
		return err
	})
	regionBits := fs.Int("region-bits", 0, "region bits of the workers that issued it (their --region-bits): shows the region")
	pos, err := parse(fs, args)
	if err != nil {
		return err
	}
	if len(pos) != 1 {
		return errors.New("decode: want one snowflake ID")
	}
	if layout.RegionBits = *regionBits; *regionBits < 0 || *regionBits >= layout.WorkerBits {
		return fmt.Errorf("--region-bits %d: want 0..%d for layout %s", *regionBits, layout.WorkerBits-1, layout.Name)
	}
	e, err := snowflake.ParseEpoch(*epoch)
	if err != nil {
		return fmt.Errorf("--snowflake-epoch %q: %w", *epoch, err)
	}
	id, err := strconv.ParseInt(pos[0], 10, 64)
	if err != nil || id < 0 {
		return fmt.Errorf("decode: %q is not a snowflake ID (a non-negative decimal int64)", pos[0])
	}
	if id > layout.MaxID() {
		return fmt.Errorf("decode: %d is not a snowflake ID of layout %s (at most %d); was it issued in another layout?", id, layout, layout.MaxID())
	}
	out, err := json.Marshal(layout.Decode(id, e))
	if err != nil {
		return err
	}
	fmt.Fprintln(stdout, string(out))
	return nil
}
