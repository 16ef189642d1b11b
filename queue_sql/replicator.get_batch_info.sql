CREATE OR REPLACE FUNCTION replicator.get_batch_info(
    p_batch_id bigint,
    OUT queue_id integer,
    OUT queue_name text,
    OUT consumer_name text,
    OUT prev_tick_id bigint,
    OUT tick_id bigint,
    OUT prev_tick_time timestamptz,
    OUT tick_time timestamptz,
    OUT prev_snapshot txid_snapshot,
    OUT cur_snapshot txid_snapshot,
    OUT prev_event_seq bigint,
    OUT cur_event_seq bigint)
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.get_batch_info(p_batch_id)
--
--      Describes an open batch of a consumer of the calling role's (see
--      replicator.check_consumer_owner()): its consumer and the two ticks
--      bounding it. replicator.batch_event_sql() reads a batch through it.
--
-- Returns:
--      one row; raises when no consumer has that batch open (another
--      session of the same consumer closed it: two daemons of one consumer)
-- ----------------------------------------------------------------------
DECLARE
    c replicator.consumer;
BEGIN
    SELECT * INTO c FROM replicator.consumer WHERE batch_id = p_batch_id;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'batch % is not open: another session of its consumer finished it, moved or unregistered the consumer; run one daemon per consumer', p_batch_id;
    END IF;
    PERFORM replicator.check_consumer_owner(c);
    SELECT q.queue_id, q.queue_name, c.consumer_name, pt.tick_id, ct.tick_id,
           pt.tick_time, ct.tick_time, pt.tick_snapshot, ct.tick_snapshot,
           pt.tick_event_seq, ct.tick_event_seq
    INTO queue_id, queue_name, consumer_name, prev_tick_id, tick_id,
         prev_tick_time, tick_time, prev_snapshot, cur_snapshot, prev_event_seq, cur_event_seq
    FROM replicator.queue q
    JOIN replicator.tick pt ON pt.tick_queue = q.queue_id AND pt.tick_id = c.last_tick
    JOIN replicator.tick ct ON ct.tick_queue = q.queue_id AND ct.tick_id = c.next_tick
    WHERE q.queue_id = c.queue_id;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'batch % is not open', p_batch_id;
    END IF;
END;
$$;
