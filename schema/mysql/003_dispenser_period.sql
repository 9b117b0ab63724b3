-- dispenser_period holds the periods of tags with a reset period, one
-- row per period (biz_tag is the period name, tag=KEY), created on the
-- period's first fetch from its tag's max_id and step. They live outside
-- leaf_alloc so that Leaf never loads them as tags. period_end is UTC.
CREATE TABLE IF NOT EXISTS `dispenser_period` (
  `biz_tag` varbinary(160) NOT NULL,
  `period_of` varbinary(128) NOT NULL,
  `max_id` bigint NOT NULL,
  `step` int NOT NULL,
  `version` bigint NOT NULL DEFAULT 1,
  `period_end` datetime(6) NOT NULL,
  `update_time` timestamp(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6) ON UPDATE CURRENT_TIMESTAMP(6),
  PRIMARY KEY (`biz_tag`),
  KEY `dispenser_period_of` (`period_of`, `period_end`)
) ENGINE=InnoDB
