CREATE OR REPLACE FUNCTION replicator.set_consumer_copy(
    p_queue_name text, p_consumer_name text, p_table text, p_rows bigint, p_estimated_rows bigint)
RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.set_consumer_copy(p_queue_name, p_consumer_name, p_table,
--                                        p_rows, p_estimated_rows)
--
--      Records the copy a consumer of the calling role's (see
--      replicator.check_consumer_owner()) is running, for `replicator
--      status`: called every few seconds during a copy, and with NULL
--      when it ends. The copy's start is kept while the table stays the
--      same.
--
-- Parameters:
--      p_table             - the table being copied (schema.table); NULL: no copy runs
--      p_rows              - rows copied so far
--      p_estimated_rows    - the table's row estimate; NULL if unknown
-- ----------------------------------------------------------------------
DECLARE
    c replicator.consumer := replicator.find_consumer(p_queue_name, p_consumer_name);
BEGIN
    IF p_table IS NULL THEN
        DELETE FROM replicator.consumer_copy WHERE consumer_id = c.consumer_id;
        RETURN;
    END IF;
    INSERT INTO replicator.consumer_copy AS cc (consumer_id, copy_table, copy_rows, copy_estimated_rows,
                                                copy_started, copy_updated)
    VALUES (c.consumer_id, p_table, p_rows, p_estimated_rows, now(), now())
    ON CONFLICT (consumer_id) DO UPDATE
    SET copy_table = excluded.copy_table, copy_rows = excluded.copy_rows,
        copy_estimated_rows = excluded.copy_estimated_rows, copy_updated = excluded.copy_updated,
        copy_started = CASE WHEN cc.copy_table = excluded.copy_table THEN cc.copy_started
                            ELSE excluded.copy_started END;
END;
$$;

CREATE OR REPLACE FUNCTION replicator.consumer_copy_info()
RETURNS TABLE (queue_name text, consumer_name text, table_name text, rows bigint, estimated_rows bigint,
               started timestamptz, updated timestamptz, rows_per_second double precision,
               seconds_since_update double precision)
LANGUAGE sql STABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.consumer_copy_info()
--
--      One row per consumer copying a table: the table, rows copied and
--      the estimate, when the copy started and when the consumer last
--      said so (a row not updated for long is a consumer that died
--      mid-copy: it clears it when it starts again), the copy's rate
--      from its start to that update, and the seconds since it.
-- ----------------------------------------------------------------------
    SELECT q.queue_name, c.consumer_name, cc.copy_table, cc.copy_rows, cc.copy_estimated_rows,
           cc.copy_started, cc.copy_updated,
           cc.copy_rows / nullif(extract(epoch FROM cc.copy_updated - cc.copy_started), 0)::double precision,
           extract(epoch FROM clock_timestamp() - cc.copy_updated)::double precision
    FROM replicator.consumer_copy cc
    JOIN replicator.consumer c ON c.consumer_id = cc.consumer_id
    JOIN replicator.queue q ON q.queue_id = c.queue_id
    ORDER BY q.queue_name, c.consumer_name;
$$;
