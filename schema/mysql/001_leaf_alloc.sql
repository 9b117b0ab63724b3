-- leaf_alloc: Meituan Leaf's own CREATE TABLE of leaf_alloc
-- (scripts/leaf_alloc.sql in Leaf's repository), word for word but for IF
-- NOT EXISTS: Migrate leaves an existing table, Leaf's or anybody's, as it
-- is. Its character set and collation are the database's: create the
-- database with COLLATE utf8mb4_bin so that tags differing only in case
-- are different tags, as everywhere else in dispenser (with a
-- case-insensitive collation they are one row, and creating the second
-- fails with tagmodel.ErrTagExists).
CREATE TABLE IF NOT EXISTS `leaf_alloc` (
  `biz_tag` varchar(128)  NOT NULL DEFAULT '',
  `max_id` bigint(20) NOT NULL DEFAULT '1',
  `step` int(11) NOT NULL,
  `description` varchar(256)  DEFAULT NULL,
  `update_time` timestamp NOT NULL DEFAULT CURRENT_TIMESTAMP ON UPDATE CURRENT_TIMESTAMP,
  PRIMARY KEY (`biz_tag`)
) ENGINE=InnoDB
