CREATE OR REPLACE FUNCTION replicator.finish_batch(p_batch_id bigint)
RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.finish_batch(p_batch_id)
--
--      Closes a batch of a consumer of the calling role's (see
--      replicator.check_consumer_owner()): the consumer's position moves
--      to the batch's tick.
--
-- Returns:
--      true if the batch was open
-- ----------------------------------------------------------------------
DECLARE
    c replicator.consumer;
BEGIN
    SELECT * INTO c FROM replicator.consumer WHERE batch_id = p_batch_id FOR UPDATE;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    PERFORM replicator.check_consumer_owner(c);
    UPDATE replicator.consumer
    SET last_tick = next_tick, next_tick = NULL, batch_id = NULL, batch_start = NULL,
        active_time = now()
    WHERE consumer_id = c.consumer_id;
    RETURN true;
END;
$$;

CREATE OR REPLACE FUNCTION replicator.set_consumer_position(
    p_queue_name text, p_consumer_name text, p_tick_id bigint)
RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.set_consumer_position(p_queue_name, p_consumer_name, p_tick_id)
--
--      Moves a consumer of the calling role's (see
--      replicator.check_consumer_owner()) to a tick and drops its open
--      batch. A target that stores its position with its data calls this
--      on start, so a crash between the target's commit and finish_batch
--      neither loses nor repeats a batch.
--
-- Parameters:
--      p_tick_id   - the tick the target has applied up to
-- ----------------------------------------------------------------------
DECLARE
    c replicator.consumer := replicator.find_consumer(p_queue_name, p_consumer_name);
BEGIN
    IF NOT EXISTS (SELECT 1 FROM replicator.tick WHERE tick_queue = c.queue_id AND tick_id = p_tick_id) THEN
        RAISE EXCEPTION 'tick % of queue "%" no longer exists: the target is older than the queue keeps; rebuild it in place with replicator consume % --target ... --consumer % --recopy',
            p_tick_id, p_queue_name, p_queue_name, p_consumer_name;
    END IF;
    UPDATE replicator.consumer
    SET last_tick = p_tick_id, next_tick = NULL, batch_id = NULL, batch_start = NULL, active_time = now()
    WHERE consumer_id = c.consumer_id;
END;
$$;
