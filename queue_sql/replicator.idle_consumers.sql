CREATE OR REPLACE FUNCTION replicator.consumer_connected(p_consumer_name text)
RETURNS boolean
LANGUAGE sql STABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.consumer_connected(p_consumer_name)
--
--      Whether a session of the consumer daemon is connected to this
--      database: it sets application_name to 'replicator consumer NAME'
--      (consumer.py), which pg_stat_activity shows every role. A consumer busy with a long
--      initial copy polls no batch for as long, but is connected.
-- ----------------------------------------------------------------------
    SELECT EXISTS (SELECT 1 FROM pg_stat_activity
                   WHERE datname = current_database()
                     AND application_name = left('replicator consumer ' || p_consumer_name, 63));
$$;

CREATE OR REPLACE FUNCTION replicator.consumer_idle(c replicator.consumer)
RETURNS boolean
LANGUAGE sql STABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.consumer_idle(c)
--
--      Whether a consumer is idle: not seen (no next_batch,
--      finish_batch or set_consumer_position, which set its active_time)
--      for longer than its queue's consumer_idle_limit, and no session of
--      it connected.
-- ----------------------------------------------------------------------
    SELECT now() - c.active_time > q.queue_consumer_idle_limit
           AND NOT replicator.consumer_connected(c.consumer_name)
    FROM replicator.queue q WHERE q.queue_id = c.queue_id;
$$;

CREATE OR REPLACE FUNCTION replicator.drop_idle_temporary_consumers(p_queue_name text)
RETURNS SETOF text
LANGUAGE plpgsql AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.drop_idle_temporary_consumers(p_queue_name)
--
--      Unregisters the queue's temporary consumers that are idle
--      (replicator.consumer_idle): a `replicator consume` streaming to
--      stdout unregisters its own when it ends, so one left idle is one
--      whose process was killed. Durable consumers are never unregistered
--      here, however long idle: only `replicator queue unregister` does.
--      Called by maint, as the owner of schema replicator.
--
-- Returns:
--      the names of the consumers unregistered
-- ----------------------------------------------------------------------
DECLARE
    q replicator.queue := replicator.find_queue(p_queue_name);
BEGIN
    RETURN QUERY
        DELETE FROM replicator.consumer c
        WHERE c.queue_id = q.queue_id AND c.consumer_temporary AND replicator.consumer_idle(c)
        RETURNING c.consumer_name;
END;
$$;
