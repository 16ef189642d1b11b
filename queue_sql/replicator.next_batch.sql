CREATE OR REPLACE FUNCTION replicator.next_batch(
    p_queue_name text,
    p_consumer_name text,
    p_max_events bigint DEFAULT NULL)
RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.next_batch(p_queue_name, p_consumer_name)
--
--      Opens the consumer's next batch: the events between its last tick
--      and a later tick. A consumer has at most one open batch; asking
--      again returns the same one until replicator.finish_batch().
--
--      A batch normally spans one tick. With p_max_events, a consumer that
--      is behind takes several ticks at once, as many as keep the batch
--      under p_max_events events (at least one tick): any two ticks bound a
--      valid batch, and fewer, larger batches cost less per event.
--
-- Parameters:
--      p_queue_name    - queue
--      p_consumer_name - registered consumer of the calling role's
--                        (replicator.check_consumer_owner())
--      p_max_events    - merge ticks up to this many events (NULL: one tick)
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
    SELECT coalesce(max(t.tick_id) FILTER (WHERE t.tick_event_seq - l.tick_event_seq <= p_max_events),
                    min(t.tick_id))
    INTO v_next
    FROM replicator.tick t
    JOIN replicator.tick l ON l.tick_queue = c.queue_id AND l.tick_id = c.last_tick
    WHERE t.tick_queue = c.queue_id AND t.tick_id > c.last_tick;
    IF v_next IS NULL THEN
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
