-- Workers ask which tags changed since their last look (update_time, set by
-- every fetch, give-back and update); the index keeps that cheap however many
-- tags the table holds. Leaf does not mind an extra index.
CREATE INDEX IF NOT EXISTS leaf_alloc_update_time ON leaf_alloc (update_time);
