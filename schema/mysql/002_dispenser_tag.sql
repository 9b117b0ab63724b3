-- dispenser_tag: dispenser's own table beside leaf_alloc: what
-- dispenser keeps of a tag that Leaf's table has no column for. A tag
-- without a row here (any tag Leaf created) is a plain tag at version 0.
-- Names are varbinary: compared byte for byte, whatever the collation of
-- leaf_alloc, and comparable with it without a collation conflict.
--
--   - version: raised by every fetch and give-back of dispenser; a
--     give-back applies only if it is still the version its giver's own
--     fetch left (see Store.GiveBack). Leaf's fetches leave it alone, which
--     is safe: they only raise max_id, and max_id comes back down only by a
--     give-back of dispenser.
--   - ordered, reset_period, time_zone, number_format, retention_days: as
--     the columns of the same names of the PostgreSQL store (NULL: none).
--   - periods_pruned_until: latest end of a period row pruned; no period
--     ending at or before it is created again.
CREATE TABLE IF NOT EXISTS `dispenser_tag` (
  `biz_tag` varbinary(128) NOT NULL,
  `version` bigint NOT NULL DEFAULT 0,
  `ordered` tinyint(1) DEFAULT NULL,
  `reset_period` varchar(8) DEFAULT NULL,
  `time_zone` varchar(255) DEFAULT NULL,
  `number_format` varchar(1024) CHARACTER SET utf8mb4 DEFAULT NULL,
  `retention_days` int DEFAULT NULL,
  `periods_pruned_until` datetime(6) DEFAULT NULL,
  PRIMARY KEY (`biz_tag`)
) ENGINE=InnoDB
