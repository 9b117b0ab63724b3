// Package upgrade holds the mixed-version test: TestRollingUpgrade builds
// cmd/dispenser of a fixed earlier commit of this repository (previous,
// in binary_test.go: what operators run now) from the git history, and
// runs it beside the current code under load on a 3-node nats-server
// cluster and PostgreSQL: the database is set up by the previous version,
// the current version's `migrate` runs first (as the Helm chart's hook
// does), then every worker is replaced by a current one, one at a time
// (the rolling upgrade), then by a previous one again (the rollback).
// The clients are those of before the upgrade (clients are upgraded
// after the workers): plain requests without a reply token, with the Go
// client's retry policy or without retries. Checked: no ID twice, the
// ordered tag's IDs increasing across both versions, no failed request
// with retries, and no failed plain or snowflake request without; failed
// ordered requests are counted (while current workers stop, bounded by
// those in flight when an owner hands the tag over).
//
// The previous version's binary is kept in the user's cache directory,
// keyed by commit and Go version; building it the first time takes a
// minute or two. Without the git history (a shallow clone, a source
// archive) the test is skipped, saying so. DISPENSER_UPGRADE_LONG=1 adds
// rolling restarts of the nats-servers in lame-duck mode while both
// versions run, and more load per step; run it before a release
// (docs/development.md).
package upgrade
