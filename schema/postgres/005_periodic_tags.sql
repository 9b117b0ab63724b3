-- Periodic tags: a tag whose numbers start again every day, month or year.
-- Nothing is reset: each period is a row of its own, named tag=KEY (KEY is
-- YYYYMMDD, YYYYMM or YYYY in the tag's time zone), created on the period's
-- first fetch from the tag row's max_id and step. All columns are nullable
-- without a default, so the table stays Leaf's: Leaf's statements name
-- their columns and never see them, its rows (and rows from before this
-- migration) hold NULL, which reads as a tag without a reset period, and
-- adding them rewrites no rows.
ALTER TABLE leaf_alloc ADD COLUMN IF NOT EXISTS reset_period text;
ALTER TABLE leaf_alloc ADD COLUMN IF NOT EXISTS time_zone text;
ALTER TABLE leaf_alloc ADD COLUMN IF NOT EXISTS number_format text;
ALTER TABLE leaf_alloc ADD COLUMN IF NOT EXISTS retention_days integer;
ALTER TABLE leaf_alloc ADD COLUMN IF NOT EXISTS periods_pruned_until timestamptz;
ALTER TABLE leaf_alloc ADD COLUMN IF NOT EXISTS period_of varchar(128);
ALTER TABLE leaf_alloc ADD COLUMN IF NOT EXISTS period_end timestamptz;
COMMENT ON COLUMN leaf_alloc.reset_period IS 'dispenser, on a tag row: day, month or year: each period is a row of its own (tag=KEY); NULL: no reset period. Never changes once set';
COMMENT ON COLUMN leaf_alloc.time_zone IS 'dispenser, on a tag row: IANA time zone its periods are counted in; NULL: UTC';
COMMENT ON COLUMN leaf_alloc.number_format IS 'dispenser, on a tag row: number format template such as ORD-{date:20060102}-{seq:6}; NULL: none';
COMMENT ON COLUMN leaf_alloc.retention_days IS 'dispenser, on a tag row: days a period row is kept after its period ended; NULL: 7';
COMMENT ON COLUMN leaf_alloc.periods_pruned_until IS 'dispenser, on a tag row: latest end of a period row pruned; no period ending at or before it is created again';
COMMENT ON COLUMN leaf_alloc.period_of IS 'dispenser, on a period row (tag=KEY): the tag it belongs to; NULL on tag rows';
COMMENT ON COLUMN leaf_alloc.period_end IS 'dispenser, on a period row: when its period ends; pruned retention_days of its tag after it';
-- Pruning finds the period rows that ended long enough ago through this
-- index; tag rows (period_end NULL) are not in it.
CREATE INDEX IF NOT EXISTS leaf_alloc_period_end ON leaf_alloc (period_end) WHERE period_end IS NOT NULL;
