-- Give-backs that cannot match a max_id that went away and came back:
-- every fetch and give-back of dispenser raises dispenser_version, and a
-- give-back applies only if the row still has the version its giver's own
-- fetch left (not merely max_id = end, which another worker's fetch and
-- give-back can restore). Leaf's statements name their columns and never see
-- it: its fetches leave it as it is, which is safe (they only raise max_id,
-- and max_id comes back down only by a give-back of dispenser). NOT NULL with
-- a constant default: rows inserted by hand or by Leaf get 0, and adding it
-- rewrites no rows.
ALTER TABLE leaf_alloc ADD COLUMN IF NOT EXISTS dispenser_version bigint NOT NULL DEFAULT 0;
COMMENT ON COLUMN leaf_alloc.dispenser_version IS 'dispenser: raised by every fetch and give-back of dispenser; a give-back applies only at the version of its own fetch';
