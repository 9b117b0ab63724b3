-- dispenser_region: dispenser's table of the region settings of a
-- store per region (tagmodel.Regions, docs/regions.md): one row at most, id
-- 1.
CREATE TABLE IF NOT EXISTS `dispenser_region` (
  `id` tinyint NOT NULL,
  `regions` int NOT NULL,
  `region` int NOT NULL,
  PRIMARY KEY (`id`)
) ENGINE=InnoDB
