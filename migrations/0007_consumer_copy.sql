-- 0007_consumer_copy: the table a consumer is copying, for `replicator status`. A consumer
-- writes its row from its own connection every few seconds while a copy runs
-- (replicator.set_consumer_copy()) and deletes it when the copy ends; a consumer killed
-- mid-copy leaves its row until it starts again, and status shows how old the row is.

CREATE TABLE replicator.consumer_copy (
    consumer_id         integer PRIMARY KEY REFERENCES replicator.consumer ON DELETE CASCADE,
    copy_table          text NOT NULL,         -- schema.table, as captured
    copy_rows           bigint NOT NULL,       -- rows copied so far
    copy_estimated_rows bigint,                -- the table's row estimate (pg_class.reltuples); NULL if unknown
    copy_started        timestamptz NOT NULL,
    copy_updated        timestamptz NOT NULL
);
