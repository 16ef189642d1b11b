CREATE OR REPLACE FUNCTION replicator.consumer_connected(c replicator.consumer)
RETURNS boolean
LANGUAGE sql STABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.consumer_connected(c)
--
--      Whether the session that last registered the consumer (its daemon
--      registers it at every connect: replicator.register_consumer records
--      the session) is still connected to this database: the same pid, of
--      the same session user, with the application_name it had then. Only
--      these columns of pg_stat_activity (and datid) are shown every role.
--      A name alone would not do: one consumer name may serve two queues,
--      and any role may set any application_name. A consumer busy with a
--      long initial copy polls no batch for as long, but is connected. A
--      consumer registered before sessions were recorded (consumer_pid
--      NULL: a daemon started by an older version) goes by the
--      application_name its daemon sets, 'replicator consumer NAME'.
-- ----------------------------------------------------------------------
    SELECT CASE WHEN c.consumer_pid IS NULL THEN
               EXISTS (SELECT 1 FROM pg_stat_activity a
                       WHERE a.datname = current_database()
                         AND a.application_name = left('replicator consumer ' || c.consumer_name, 63))
           ELSE
               EXISTS (SELECT 1 FROM pg_stat_activity a
                       WHERE a.datid = (SELECT oid FROM pg_database WHERE datname = current_database())
                         AND a.pid = c.consumer_pid
                         AND a.usesysid = c.consumer_usesysid
                         AND a.application_name IS NOT DISTINCT FROM c.consumer_application_name)
           END;
$$;

CREATE OR REPLACE FUNCTION replicator.consumer_idle(c replicator.consumer)
RETURNS boolean
LANGUAGE sql STABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.consumer_idle(c)
--
--      Whether a consumer is idle: not seen (no next_batch,
--      finish_batch or set_consumer_position, which set its active_time)
--      for longer than its queue's consumer_idle_limit, and its session
--      not connected (replicator.consumer_connected).
-- ----------------------------------------------------------------------
    SELECT now() - c.active_time > q.queue_consumer_idle_limit
           AND NOT replicator.consumer_connected(c)
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
