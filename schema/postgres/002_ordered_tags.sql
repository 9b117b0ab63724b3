-- Ordered tags: a tag whose IDs increase across all workers, not only within
-- each. The column is nullable and has no default, so the table stays Leaf's:
-- Leaf's statements name their columns and never see it, its rows (and rows
-- from before this migration) hold NULL, and NULL reads as not ordered.
-- Adding a nullable column without a default rewrites no rows.
ALTER TABLE leaf_alloc ADD COLUMN IF NOT EXISTS ordered boolean;
COMMENT ON COLUMN leaf_alloc.ordered IS 'dispenser: IDs increase across all workers (true); NULL or false: a plain tag';
