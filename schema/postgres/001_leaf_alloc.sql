-- The sequence table of Meituan Leaf's segment mode: one row per business
-- tag; max_id is where the next segment starts. IF NOT EXISTS keeps the data
-- of a team moving off Leaf that already has this table.
CREATE TABLE IF NOT EXISTS leaf_alloc (
    biz_tag     varchar(128) PRIMARY KEY,
    max_id      bigint       NOT NULL DEFAULT 1,
    step        int          NOT NULL,
    description varchar(256),
    update_time timestamptz  NOT NULL DEFAULT now()
);
