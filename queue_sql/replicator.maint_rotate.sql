CREATE OR REPLACE FUNCTION replicator.rotation_blockers(p_queue_name text)
RETURNS TABLE (kind text, name text, detail text)
LANGUAGE plpgsql STABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.rotation_blockers(p_queue_name)
--
--      What keeps the queue from truncating its oldest event table: every
--      transaction that could have written into the previous table must be
--      finished and every consumer's position must be past all of them.
--
-- Returns:
--      rows of (kind, name, detail): kind 'switch' (the last switch is not
--      complete), 'tick' (no tick since the switch, so no consumer can get
--      past its transactions, and the consumers are not named: the ticker
--      is blamed when none runs (replicator.ticker_info) or the last tick
--      is older than the queue's idle period and a minute; else, as after
--      every switch on an idle queue, the queue is waiting for its next
--      tick, which is said only once rotation is due), 'consumer' (a consumer's
--      last tick does not see every such transaction) or 'transaction' (a
--      session still running one)
-- ----------------------------------------------------------------------
DECLARE
    q replicator.queue := replicator.find_queue(p_queue_name);
    v_last replicator.tick;
BEGIN
    IF q.queue_switch_step2 IS NULL THEN
        RETURN QUERY SELECT 'switch'::text, q.queue_name,
            'the last switch is waiting for replicator maint to complete it'::text;
        RETURN;
    END IF;
    SELECT * INTO v_last FROM replicator.tick WHERE tick_queue = q.queue_id ORDER BY tick_id DESC LIMIT 1;
    -- taken before the txid that completed the switch: no tick since
    IF txid_snapshot_xmax(v_last.tick_snapshot) <= q.queue_switch_step2
       AND EXISTS (SELECT 1 FROM replicator.consumer c WHERE c.queue_id = q.queue_id)
    THEN
        IF NOT EXISTS (SELECT 1 FROM replicator.ticker_info() ti WHERE ti.running)
           OR now() - v_last.tick_time > q.queue_ticker_idle_period + interval '1 minute'
        THEN
            RETURN QUERY SELECT 'tick'::text, q.queue_name,
                format('no tick since the switch at %s (the last, tick %s, was taken %s ago): is `replicator ticker` '
                       'running?', date_trunc('second', q.queue_switch_time), v_last.tick_id,
                       date_trunc('second', now() - v_last.tick_time));
        ELSIF now() - q.queue_switch_time >= q.queue_rotation_period THEN
            RETURN QUERY SELECT 'tick'::text, q.queue_name,
                format('waiting for the next tick after the switch at %s (the last, tick %s, was taken %s ago; '
                       'an idle queue ticks every %s)', date_trunc('second', q.queue_switch_time), v_last.tick_id,
                       date_trunc('second', now() - v_last.tick_time), q.queue_ticker_idle_period);
        END IF;
    ELSE
        RETURN QUERY
            SELECT 'consumer'::text, c.consumer_name,
                   format('at tick %s of %s (%s ago): not past the transactions of the previous table',
                          c.last_tick, t.tick_time, date_trunc('second', now() - t.tick_time))
            FROM replicator.consumer c
            JOIN replicator.tick t ON t.tick_queue = c.queue_id AND t.tick_id = c.last_tick
            WHERE c.queue_id = q.queue_id AND txid_snapshot_xmin(t.tick_snapshot) < q.queue_switch_step2;
    END IF;
    -- backend_xid is 32 bits; compare by age, which wraps correctly.
    RETURN QUERY
        SELECT 'transaction'::text, format('pid %s', a.pid),
               format('%s transaction open since %s by %s: %s', a.state, a.xact_start, a.usename,
                      left(regexp_replace(a.query, '\s+', ' ', 'g'), 80))
        FROM pg_stat_activity a
        WHERE a.backend_xid IS NOT NULL
          AND age(a.backend_xid) > (replicator.txid_horizon() - q.queue_switch_step2);
END;
$$;

CREATE OR REPLACE FUNCTION replicator.txid_horizon()
RETURNS bigint
LANGUAGE sql STABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.txid_horizon()
--
--      The txid horizon now (xmax of the current snapshot), without
--      assigning a txid to the caller.
-- ----------------------------------------------------------------------
    SELECT txid_snapshot_xmax(txid_current_snapshot());
$$;

CREATE OR REPLACE FUNCTION replicator.maint_rotate_step1(p_queue_name text)
RETURNS boolean
LANGUAGE plpgsql AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.maint_rotate_step1(p_queue_name)
--
--      Switches the queue to its next event table once the rotation period
--      has passed, TRUNCATEing that table first. It holds the oldest events;
--      they may go only when no consumer can still need them, which is when
--      every consumer's last tick sees every transaction below
--      queue_switch_step2 (all writers into the tables before the current
--      one). Commit, then run replicator.maint_rotate_step2().
--
--      The slot sequence is set last: writers read it outside MVCC, so any
--      writer that still inserts into the old table read it before the
--      switch and has a txid below the step2 txid taken after this commits.
--
-- Returns:
--      true if the queue switched tables
-- ----------------------------------------------------------------------
DECLARE
    q replicator.queue := replicator.find_queue(p_queue_name);
    v_next integer;
BEGIN
    SELECT * INTO q FROM replicator.queue WHERE queue_id = q.queue_id FOR UPDATE;
    IF q.queue_switch_step2 IS NULL
       OR now() - q.queue_switch_time < q.queue_rotation_period
       OR EXISTS (SELECT 1 FROM replicator.rotation_blockers(p_queue_name) WHERE kind <> 'transaction')
    THEN
        RETURN false;
    END IF;
    v_next := (replicator.current_slot(q.queue_id) + 1) % q.queue_ntables;
    EXECUTE 'TRUNCATE ' || replicator.event_partition(q.queue_id, v_next);
    UPDATE replicator.queue
    SET queue_switch_time = now(), queue_switch_step1 = txid_current(), queue_switch_step2 = NULL
    WHERE queue_id = q.queue_id;
    PERFORM setval(replicator.event_slot_seq(q.queue_id), v_next, true);
    RETURN true;
END;
$$;

CREATE OR REPLACE FUNCTION replicator.maint_rotate_step2()
RETURNS integer
LANGUAGE plpgsql AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.maint_rotate_step2()
--
--      Completes switches: records, in a transaction that began after the
--      switch committed, the txid below which every writer into the
--      previous table lies.
--
-- Returns:
--      the number of queues completed
-- ----------------------------------------------------------------------
DECLARE
    v_count integer;
BEGIN
    UPDATE replicator.queue SET queue_switch_step2 = txid_current()
    WHERE queue_switch_step2 IS NULL;
    GET DIAGNOSTICS v_count = ROW_COUNT;
    RETURN v_count;
END;
$$;

CREATE OR REPLACE FUNCTION replicator.maint_tick_cleanup(p_queue_name text)
RETURNS integer
LANGUAGE plpgsql AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.maint_tick_cleanup(p_queue_name)
--
--      Deletes ticks no consumer can need: those before the oldest
--      consumer position (the latest tick is always kept).
--
-- Returns:
--      the number of ticks deleted
-- ----------------------------------------------------------------------
DECLARE
    q replicator.queue := replicator.find_queue(p_queue_name);
    v_keep bigint;
    v_count integer;
BEGIN
    SELECT least(min(c.last_tick), (SELECT max(tick_id) FROM replicator.tick WHERE tick_queue = q.queue_id))
    INTO v_keep FROM replicator.consumer c WHERE c.queue_id = q.queue_id;
    IF v_keep IS NULL THEN
        SELECT max(tick_id) INTO v_keep FROM replicator.tick WHERE tick_queue = q.queue_id;
    END IF;
    DELETE FROM replicator.tick WHERE tick_queue = q.queue_id AND tick_id < v_keep;
    GET DIAGNOSTICS v_count = ROW_COUNT;
    RETURN v_count;
END;
$$;
