// Package tagmodel is what a tag is and what a store of tags promises:
// the tag row and its settings (Tag, Update, ApplyUpdate), the checks that
// refuse a setting that cannot be proven safe (Tag.Check,
// Update.Check, ApplyUpdate, ParseFormat, Regions.Check), reset periods and their keys
// (Reset, Period, PeriodName, PeriodPruned), business-number formats
// (Format), regions (Regions, CheckRegions) and the store interfaces
// (Store, Admin, PeriodPruner, ChangeLister, RegionStore) that the
// PostgreSQL, MySQL and JetStream KV stores implement and the allocator
// engine (package segment) uses.
//
// The invariants below are the one promise (no ID and no formatted number
// handed out twice) as far as the tag model carries it. The model-based
// test (internal/tests/model) drives every setting on every store against
// them, and the store conformance suite (segment/storetest) checks each
// store's part:
//   - Fetch hands out disjoint segments: two fetches of one row, wherever
//     they run, never overlap, and a row's max_id never goes back (a
//     give-back succeeds only if nobody fetched since, GiveBack).
//   - A deleted tag is never created again (ErrTagDeleted): from its start
//     it would repeat its IDs.
//   - A tag's reset period, once set, never changes, and a period's key
//     names exactly one period of the tag's reset whatever its time zone is
//     now (PeriodOfKey). A period whose row was pruned is never started
//     again: a missing period is compared by its earliest possible end, at
//     MaxZoneOffset ahead of UTC, with the store's pruned-until mark
//     (PeriodPruned); a zone further ahead is refused.
//   - A format prints a different number for every (period, sequence) of
//     its tag, on every date of the years 0000-9999: ParseFormat proves its
//     date layout over a whole 400-year cycle (same width, parsed back to
//     the same period) and refuses what it cannot prove; the text before
//     {seq} never changes once set (ApplyUpdate).
//   - Regions map a store's values v to IDs v*Count+Region, disjoint
//     across regions; a store records the regions it was first used with,
//     "one region" included, and a worker of other settings is refused
//     (CheckRegions, ErrRegionMismatch).
//   - Every check refuses bad input with an error wrapping one of the
//     sentinel errors below and changes nothing.
package tagmodel
