CREATE OR REPLACE FUNCTION replicator.ticker(p_queue_name text, p_force boolean DEFAULT false)
RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.ticker(p_queue_name, p_force)
--
--      Inserts a tick, the snapshot that closes a batch, when one is due:
--      queue_ticker_max_count events since the last tick, or some events and
--      queue_ticker_max_lag, or queue_ticker_idle_period with none.
--
--      Safe to run concurrently: the lock on the queue's row comes first
--      (a ticker that finds it taken returns at once) and every
--      statement after it takes a fresh snapshot (READ COMMITTED), so a
--      second ticker sees the first one's tick and its snapshot is newer.
--      Must not run in a REPEATABLE READ or SERIALIZABLE transaction. A
--      transaction that makes a tick commits synchronously.
--
-- Parameters:
--      p_queue_name - queue
--      p_force      - tick even if none is due
--
-- Returns:
--      the new tick id, or NULL when no tick was due or another ticker
--      holds the queue
-- ----------------------------------------------------------------------
DECLARE
    q replicator.queue := replicator.find_queue(p_queue_name);
    v_last replicator.tick;
    v_event_seq bigint;
    v_tick_id bigint;
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'replicator.ticker() must run in a READ COMMITTED transaction';
    END IF;
    -- The queue's row, locked first; a row lock, not an advisory one: it takes UPDATE on
    -- replicator.queue, which only the owner has, where any role that may connect could
    -- hold an advisory key and stop every ticker.
    PERFORM FROM replicator.queue WHERE queue_id = q.queue_id FOR NO KEY UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    SELECT * INTO v_last FROM replicator.tick
    WHERE tick_queue = q.queue_id ORDER BY tick_id DESC LIMIT 1;
    v_event_seq := replicator.last_event_id(q.queue_id);
    IF NOT p_force AND v_last.tick_id IS NOT NULL
       AND v_event_seq - v_last.tick_event_seq < q.queue_ticker_max_count
       AND NOT (v_event_seq > v_last.tick_event_seq
                AND clock_timestamp() - v_last.tick_time >= q.queue_ticker_max_lag)
       AND clock_timestamp() - v_last.tick_time < q.queue_ticker_idle_period
    THEN
        RETURN NULL;
    END IF;
    v_tick_id := coalesce(v_last.tick_id, 0) + 1;
    INSERT INTO replicator.tick (tick_queue, tick_id, tick_time, tick_snapshot, tick_event_seq)
    VALUES (q.queue_id, v_tick_id, clock_timestamp(), txid_current_snapshot(), v_event_seq);
    -- The tick commits durably whatever the session's setting: with synchronous_commit
    -- off, a crash could lose a tick a consumer has applied, and the same tick id would
    -- then be made again with another snapshot. Flushing the tick's commit flushes
    -- every commit before it, so what the tick shows survives too.
    PERFORM set_config('synchronous_commit', 'on', true);
    RETURN v_tick_id;
END;
$$;

CREATE OR REPLACE FUNCTION replicator.ticker()
RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.ticker()
--
--      Runs the ticker on every queue.
--
-- Returns:
--      the number of ticks inserted
-- ----------------------------------------------------------------------
DECLARE
    v_name text;
    v_count integer := 0;
BEGIN
    FOR v_name IN SELECT queue_name FROM replicator.queue ORDER BY queue_id LOOP
        IF replicator.ticker(v_name) IS NOT NULL THEN
            v_count := v_count + 1;
        END IF;
    END LOOP;
    RETURN v_count;
END;
$$;
