CREATE OR REPLACE FUNCTION replicator.drop_queue(p_queue_name text)
RETURNS void
LANGUAGE plpgsql AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.drop_queue(p_queue_name)
--
--      Drops a queue with its capture triggers, event tables, sequences,
--      ticks and consumers. Application tables are not touched.
--
-- Parameters:
--      p_queue_name    - queue to drop
-- ----------------------------------------------------------------------
DECLARE
    q replicator.queue := replicator.find_queue(p_queue_name);
    v_table_id integer;
BEGIN
    FOR v_table_id IN SELECT table_id FROM replicator.captured_table WHERE queue_id = q.queue_id LOOP
        PERFORM replicator.drop_capture(v_table_id);
    END LOOP;
    EXECUTE 'DROP TABLE IF EXISTS ' || replicator.event_table(q.queue_id);
    EXECUTE 'DROP SEQUENCE IF EXISTS ' || replicator.event_id_seq(q.queue_id);
    EXECUTE 'DROP SEQUENCE IF EXISTS ' || replicator.event_slot_seq(q.queue_id);
    DELETE FROM replicator.queue WHERE queue_id = q.queue_id;
END;
$$;
