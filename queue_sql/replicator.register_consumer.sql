CREATE OR REPLACE FUNCTION replicator.register_consumer(p_queue_name text, p_consumer_name text)
RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.register_consumer(p_queue_name, p_consumer_name)
--
--      Subscribes a consumer to a queue. A new consumer starts at the
--      queue's latest tick (a tick is made if the queue has none): it
--      receives the events of transactions not visible in that tick.
--      Registering again changes nothing.
--
-- Returns:
--      the consumer's last tick
-- ----------------------------------------------------------------------
DECLARE
    q replicator.queue := replicator.find_queue(p_queue_name);
    v_tick bigint;
BEGIN
    IF p_consumer_name IS NULL OR p_consumer_name = '' THEN
        RAISE EXCEPTION 'consumer name must not be empty';
    END IF;
    SELECT last_tick INTO v_tick FROM replicator.consumer
    WHERE queue_id = q.queue_id AND consumer_name = p_consumer_name;
    IF FOUND THEN
        RETURN v_tick;
    END IF;
    SELECT max(tick_id) INTO v_tick FROM replicator.tick WHERE tick_queue = q.queue_id;
    IF v_tick IS NULL THEN
        v_tick := replicator.ticker(p_queue_name, true);
    END IF;
    IF v_tick IS NULL THEN
        -- Another ticker holds the queue and is making its first tick: wait for it.
        PERFORM pg_advisory_xact_lock(2026112201, q.queue_id);
        SELECT max(tick_id) INTO v_tick FROM replicator.tick WHERE tick_queue = q.queue_id;
        IF v_tick IS NULL THEN
            v_tick := replicator.ticker(p_queue_name, true);
        END IF;
    END IF;
    INSERT INTO replicator.consumer (queue_id, consumer_name, last_tick)
    VALUES (q.queue_id, p_consumer_name, v_tick)
    ON CONFLICT (queue_id, consumer_name) DO NOTHING;
    RETURN (SELECT last_tick FROM replicator.consumer
            WHERE queue_id = q.queue_id AND consumer_name = p_consumer_name);
END;
$$;

CREATE OR REPLACE FUNCTION replicator.unregister_consumer(p_queue_name text, p_consumer_name text)
RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.unregister_consumer(p_queue_name, p_consumer_name)
--
--      Removes a consumer; it no longer holds back rotation.
--
-- Returns:
--      true if the consumer existed
-- ----------------------------------------------------------------------
DECLARE
    q replicator.queue := replicator.find_queue(p_queue_name);
BEGIN
    DELETE FROM replicator.consumer WHERE queue_id = q.queue_id AND consumer_name = p_consumer_name;
    RETURN FOUND;
END;
$$;

CREATE OR REPLACE FUNCTION replicator.find_consumer(p_queue_name text, p_consumer_name text)
RETURNS replicator.consumer
LANGUAGE plpgsql AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.find_consumer(p_queue_name, p_consumer_name)
--
--      Looks up and locks a consumer row.
--
-- Returns:
--      the consumer row; raises when it is not registered
-- ----------------------------------------------------------------------
DECLARE
    q replicator.queue := replicator.find_queue(p_queue_name);
    c replicator.consumer;
BEGIN
    SELECT * INTO c FROM replicator.consumer
    WHERE queue_id = q.queue_id AND consumer_name = p_consumer_name FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'consumer "%" is not registered on queue "%"', p_consumer_name, p_queue_name;
    END IF;
    RETURN c;
END;
$$;
