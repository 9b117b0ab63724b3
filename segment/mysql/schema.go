package mysql

import (
	"context"
	"database/sql"
	"fmt"
	"slices"
	"strings"
)

// LeafAllocDDL is Meituan Leaf's own CREATE TABLE of leaf_alloc
// (scripts/leaf_alloc.sql in Leaf's repository), word for word but for IF
// NOT EXISTS: Migrate leaves an existing table, Leaf's or anybody's, as it
// is. Its character set and collation are the database's: create the
// database with COLLATE utf8mb4_bin so that tags differing only in case
// are different tags, as everywhere else in dispenser (with a
// case-insensitive collation they are one row, and creating the second
// fails with tagmodel.ErrTagExists).
const LeafAllocDDL = "CREATE TABLE IF NOT EXISTS `leaf_alloc` (\n" +
	"  `biz_tag` varchar(128)  NOT NULL DEFAULT '',\n" +
	"  `max_id` bigint(20) NOT NULL DEFAULT '1',\n" +
	"  `step` int(11) NOT NULL,\n" +
	"  `description` varchar(256)  DEFAULT NULL,\n" +
	"  `update_time` timestamp NOT NULL DEFAULT CURRENT_TIMESTAMP ON UPDATE CURRENT_TIMESTAMP,\n" +
	"  PRIMARY KEY (`biz_tag`)\n" +
	") ENGINE=InnoDB"

// dispenserTagDDL is dispenser's own table beside leaf_alloc: what
// dispenser keeps of a tag that Leaf's table has no column for. A tag
// without a row here (any tag Leaf created) is a plain tag at version 0.
// Names are varbinary: compared byte for byte, whatever the collation of
// leaf_alloc, and comparable with it without a collation conflict.
//
//   - version: raised by every fetch and give-back of dispenser; a
//     give-back applies only if it is still the version its giver's own
//     fetch left (see Store.GiveBack). Leaf's fetches leave it alone, which
//     is safe: they only raise max_id, and max_id comes back down only by a
//     give-back of dispenser.
//   - ordered, reset_period, time_zone, number_format, retention_days: as
//     the columns of the same names of the PostgreSQL store (NULL: none).
//   - periods_pruned_until: latest end of a period row pruned; no period
//     ending at or before it is created again.
const dispenserTagDDL = "CREATE TABLE IF NOT EXISTS `dispenser_tag` (\n" +
	"  `biz_tag` varbinary(128) NOT NULL,\n" +
	"  `version` bigint NOT NULL DEFAULT 0,\n" +
	"  `ordered` tinyint(1) DEFAULT NULL,\n" +
	"  `reset_period` varchar(8) DEFAULT NULL,\n" +
	"  `time_zone` varchar(255) DEFAULT NULL,\n" +
	"  `number_format` varchar(1024) CHARACTER SET utf8mb4 DEFAULT NULL,\n" +
	"  `retention_days` int DEFAULT NULL,\n" +
	"  `periods_pruned_until` datetime(6) DEFAULT NULL,\n" +
	"  PRIMARY KEY (`biz_tag`)\n" +
	") ENGINE=InnoDB"

// dispenserPeriodDDL holds the periods of tags with a reset period, one
// row per period (biz_tag is the period name, tag=KEY), created on the
// period's first fetch from its tag's max_id and step. They live outside
// leaf_alloc so that Leaf never loads them as tags. period_end is UTC.
const dispenserPeriodDDL = "CREATE TABLE IF NOT EXISTS `dispenser_period` (\n" +
	"  `biz_tag` varbinary(160) NOT NULL,\n" +
	"  `period_of` varbinary(128) NOT NULL,\n" +
	"  `max_id` bigint NOT NULL,\n" +
	"  `step` int NOT NULL,\n" +
	"  `version` bigint NOT NULL DEFAULT 1,\n" +
	"  `period_end` datetime(6) NOT NULL,\n" +
	"  `update_time` timestamp(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6) ON UPDATE CURRENT_TIMESTAMP(6),\n" +
	"  PRIMARY KEY (`biz_tag`),\n" +
	"  KEY `dispenser_period_of` (`period_of`, `period_end`)\n" +
	") ENGINE=InnoDB"

// dispenserRegionDDL is dispenser's table of the region settings of a
// store per region (tagmodel.Regions, docs/regions.md): one row at most, id
// 1.
const dispenserRegionDDL = "CREATE TABLE IF NOT EXISTS `dispenser_region` (\n" +
	"  `id` tinyint NOT NULL,\n" +
	"  `regions` int NOT NULL,\n" +
	"  `region` int NOT NULL,\n" +
	"  PRIMARY KEY (`id`)\n" +
	") ENGINE=InnoDB"

// tables are the tables the store needs, in creation order.
var tables = []struct{ name, ddl string }{
	{"leaf_alloc", LeafAllocDDL},
	{"dispenser_tag", dispenserTagDDL},
	{"dispenser_period", dispenserPeriodDDL},
	{"dispenser_region", dispenserRegionDDL},
}

// Migrate creates the tables the store needs where missing: leaf_alloc as
// Leaf creates it, and dispenser's own dispenser_tag, dispenser_period and
// dispenser_region.
// It changes no existing table, so Leaf servers keep working on
// leaf_alloc. It returns the names of the tables it created.
func Migrate(ctx context.Context, db *sql.DB) ([]string, error) {
	missing, err := Missing(ctx, db)
	if err != nil {
		return nil, err
	}
	for _, t := range tables {
		if !slices.Contains(missing, t.name) {
			continue
		}
		if _, err := db.ExecContext(ctx, t.ddl); err != nil {
			return nil, fmt.Errorf("mysql: migrate: create table %s: %w", t.name, err)
		}
	}
	return missing, nil
}

// Missing returns the names of the tables the store needs that the
// database lacks (none: Migrate has run).
func Missing(ctx context.Context, db *sql.DB) ([]string, error) {
	rows, err := db.QueryContext(ctx, `SELECT table_name FROM information_schema.tables WHERE table_schema = DATABASE()`)
	if err != nil {
		return nil, fmt.Errorf("mysql: reading the tables: %w", err)
	}
	defer rows.Close()
	have := map[string]bool{}
	for rows.Next() {
		var n string
		if err := rows.Scan(&n); err != nil {
			return nil, fmt.Errorf("mysql: reading the tables: %w", err)
		}
		have[strings.ToLower(n)] = true
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("mysql: reading the tables: %w", err)
	}
	var missing []string
	for _, t := range tables {
		if !have[t.name] {
			missing = append(missing, t.name)
		}
	}
	return missing, nil
}
