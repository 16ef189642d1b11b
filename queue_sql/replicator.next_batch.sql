CREATE OR REPLACE FUNCTION replicator.next_batch(p_queue_name text, p_consumer_name text)
RETURNS bigint
LANGUAGE plpgsql AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.next_batch(p_queue_name, p_consumer_name)
--
--      Opens the consumer's next batch: the events between its last tick
--      and the tick after it. A consumer has at most one open batch;
--      asking again returns the same one until replicator.finish_batch().
--
-- Returns:
--      the batch id, or NULL when no tick follows the consumer's position
-- ----------------------------------------------------------------------
DECLARE
    c replicator.consumer := replicator.find_consumer(p_queue_name, p_consumer_name);
    v_next bigint;
    v_batch bigint;
BEGIN
    IF c.batch_id IS NOT NULL THEN
        RETURN c.batch_id;
    END IF;
    SELECT tick_id INTO v_next FROM replicator.tick
    WHERE tick_queue = c.queue_id AND tick_id > c.last_tick ORDER BY tick_id LIMIT 1;
    IF NOT FOUND THEN
        UPDATE replicator.consumer SET active_time = now() WHERE consumer_id = c.consumer_id;
        RETURN NULL;
    END IF;
    UPDATE replicator.consumer
    SET batch_id = nextval('replicator.batch_id_seq'), next_tick = v_next,
        batch_start = now(), active_time = now()
    WHERE consumer_id = c.consumer_id
    RETURNING batch_id INTO v_batch;
    RETURN v_batch;
END;
$$;
