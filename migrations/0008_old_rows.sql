-- 0008_old_rows: old row images per table, as PostgreSQL's REPLICA IDENTITY FULL
-- (`replicator table add/alter --old-rows`). A table captured with them queues, with each
-- UPDATE's new rows and each D (deleted rows, and old keys an UPDATE did not keep), the old
-- rows in a column of their own, ev_old: a JSON array beside ev_data, item for item (null
-- for a new row whose key no old row had). Other tables leave it NULL, which costs no byte:
-- a row of up to 8 columns holding a NULL keeps its 24-byte header (the null bitmap takes
-- the header's padding byte).

ALTER TABLE replicator.captured_table ADD COLUMN table_old_rows boolean NOT NULL DEFAULT false;

DO $$
DECLARE
    v_queue integer;
BEGIN
    -- adding a nullable column without a default only changes the catalog (no rewrite)
    FOR v_queue IN SELECT queue_id FROM replicator.queue ORDER BY queue_id LOOP
        EXECUTE format('ALTER TABLE replicator.%I ADD COLUMN ev_old json', 'event_' || v_queue);
    END LOOP;
END $$;
