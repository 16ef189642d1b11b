CREATE OR REPLACE FUNCTION replicator.queue_info()
RETURNS TABLE (queue_name text, ntables integer, current_table integer, rotation_period interval,
               last_switch timestamptz, last_tick bigint, last_tick_time timestamptz,
               last_event_id bigint, events_since_tick bigint, tables integer, consumers integer,
               last_tick_age double precision, ticker_running boolean, rotation_overdue interval,
               consumer_idle_limit interval)
LANGUAGE sql STABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.queue_info()
--
--      One row per queue: its rotation state, its latest tick (and its age
--      in seconds) and how many events were queued since; whether a ticker
--      daemon is running (replicator.ticker_info); how long ago its
--      rotation fell due (NULL when it is not due: the period has not
--      passed since the last switch).
-- ----------------------------------------------------------------------
    SELECT q.queue_name, q.queue_ntables, replicator.current_slot(q.queue_id), q.queue_rotation_period,
           q.queue_switch_time, t.tick_id, t.tick_time, replicator.last_event_id(q.queue_id),
           replicator.last_event_id(q.queue_id) - coalesce(t.tick_event_seq, 0),
           (SELECT count(*)::integer FROM replicator.captured_table ct WHERE ct.queue_id = q.queue_id),
           (SELECT count(*)::integer FROM replicator.consumer c WHERE c.queue_id = q.queue_id),
           extract(epoch FROM clock_timestamp() - t.tick_time)::double precision,
           EXISTS (SELECT 1 FROM replicator.ticker_info() ti WHERE ti.running),
           nullif(greatest(now() - q.queue_switch_time - q.queue_rotation_period, interval '0'), interval '0'),
           q.queue_consumer_idle_limit
    FROM replicator.queue q
    LEFT JOIN LATERAL (SELECT * FROM replicator.tick t WHERE t.tick_queue = q.queue_id
                       ORDER BY t.tick_id DESC LIMIT 1) t ON true
    ORDER BY q.queue_name;
$$;

CREATE OR REPLACE FUNCTION replicator.consumer_info()
RETURNS TABLE (queue_name text, consumer_name text, owner name, last_tick bigint, batch_open boolean,
               lag_ticks bigint, lag_events bigint, lag_seconds double precision,
               last_seen timestamptz, idle_seconds double precision, idle boolean, connected boolean,
               temporary boolean)
LANGUAGE sql STABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.consumer_info()
--
--      One row per consumer with the role it belongs to and its lag:
--      ticks and events not yet consumed, and the age of the position it
--      is at (seconds since its last tick was taken, minus nothing: an
--      idle queue ticks every idle period, so an up-to-date consumer lags
--      at most that). last_seen and idle_seconds: when it last asked for a
--      batch or finished one; idle: longer ago than its queue's
--      consumer_idle_limit, and not connected (replicator.consumer_idle);
--      temporary: unregistered by maint once idle.
-- ----------------------------------------------------------------------
    SELECT q.queue_name, c.consumer_name, c.consumer_owner, c.last_tick, c.batch_id IS NOT NULL,
           coalesce(lt.tick_id - c.last_tick, 0),
           greatest(replicator.last_event_id(q.queue_id) - ct.tick_event_seq, 0),
           extract(epoch FROM clock_timestamp() - ct.tick_time)::double precision,
           c.active_time,
           extract(epoch FROM clock_timestamp() - c.active_time)::double precision,
           replicator.consumer_idle(c),
           replicator.consumer_connected(c),
           c.consumer_temporary
    FROM replicator.consumer c
    JOIN replicator.queue q ON q.queue_id = c.queue_id
    JOIN replicator.tick ct ON ct.tick_queue = c.queue_id AND ct.tick_id = c.last_tick
    LEFT JOIN LATERAL (SELECT max(t.tick_id) AS tick_id FROM replicator.tick t
                       WHERE t.tick_queue = q.queue_id) lt ON true
    ORDER BY q.queue_name, c.consumer_name;
$$;

CREATE OR REPLACE FUNCTION replicator.table_info(p_queue_name text DEFAULT NULL)
RETURNS TABLE (queue_name text, table_id integer, table_name text, mode text, key text[],
               ignore text[], row_filter text, columns text[], table_oid oid, structure jsonb,
               suspended text, old_rows boolean, capture text)
LANGUAGE sql STABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.table_info(p_queue_name)
--
--      Tables captured by one queue (or all queues when NULL), with the
--      structure targets create their copies from. "columns" lists the
--      captured columns in the order of the values in full-mode events;
--      "suspended" why capture stopped (replicator.suspend_capture), if it did;
--      "old_rows" whether updates and deletes queue their old rows too;
--      "capture" its capture kind, 'statement' or 'row'.
-- ----------------------------------------------------------------------
    SELECT q.queue_name, t.table_id, t.table_schema || '.' || t.table_name, t.table_mode,
           t.table_key, t.table_ignore, t.table_where,
           ARRAY(SELECT c FROM unnest(t.table_columns) c WHERE c <> ALL (t.table_ignore)), t.table_oid,
           replicator.table_structure(t.table_oid, t.table_key), t.table_suspended, t.table_old_rows,
           t.table_capture
    FROM replicator.captured_table t
    JOIN replicator.queue q ON q.queue_id = t.queue_id
    WHERE p_queue_name IS NULL OR q.queue_name = p_queue_name
    ORDER BY q.queue_name, t.table_id;
$$;

CREATE OR REPLACE FUNCTION replicator.schema_info(p_queue_name text DEFAULT NULL)
RETURNS TABLE (queue_name text, schema_name text, mode text, since timestamptz)
LANGUAGE sql STABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.schema_info(p_queue_name)
--
--      Schemas followed by one queue (or all queues when NULL): tables
--      created in them are captured, in the given mode, from their first row.
-- ----------------------------------------------------------------------
    SELECT q.queue_name, s.schema_name, s.schema_mode, s.schema_added
    FROM replicator.captured_schema s
    JOIN replicator.queue q ON q.queue_id = s.queue_id
    WHERE p_queue_name IS NULL OR q.queue_name = p_queue_name
    ORDER BY q.queue_name, s.schema_name;
$$;

CREATE OR REPLACE FUNCTION replicator.statement_sizes(p_queue_name text DEFAULT NULL, p_sample integer DEFAULT 10000)
RETURNS TABLE (queue_name text, table_id integer, statements bigint, rows_per_statement double precision)
LANGUAGE plpgsql STABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.statement_sizes(p_queue_name, p_sample)
--
--      How many rows the statements on each captured table change, read
--      from the queue itself: which capture kind fits it (a row capture
--      for tables written a row or two at a time, docs/benchmarks.md). A
--      bounded read: the first p_sample row events (I, U, D) of the
--      current event table and as many of the one before, in their
--      physical order, whatever the queue holds. A statement capture
--      writes an event per statement (per 1000 rows; a key change's U and
--      D are two): its rows per statement are items per event. A row
--      capture writes an event per row: a statement is a run of events of
--      one transaction and type in ev_id order, so successive statements
--      of one kind in a transaction count as one (an upper bound).
--
-- Parameters:
--      p_queue_name - one queue, or all when NULL
--      p_sample     - row events read from each of the two event tables
--
-- Returns:
--      a row per table with events in the sample: statements counted,
--      their mean rows
-- ----------------------------------------------------------------------
DECLARE
    q replicator.queue;
    v_slot integer;
BEGIN
    FOR q IN SELECT * FROM replicator.queue WHERE p_queue_name IS NULL OR replicator.queue.queue_name = p_queue_name
             ORDER BY replicator.queue.queue_name LOOP
        v_slot := replicator.current_slot(q.queue_id);
        RETURN QUERY EXECUTE format($q$
            WITH e AS (
                (SELECT ev_id, ev_txid, ev_table, ev_type, ev_data FROM %1$s WHERE ev_type IN ('I', 'U', 'D') LIMIT %3$s)
                UNION ALL
                (SELECT ev_id, ev_txid, ev_table, ev_type, ev_data FROM %2$s WHERE ev_type IN ('I', 'U', 'D') LIMIT %3$s)),
            s AS (
                SELECT e.ev_table,
                       CASE WHEN t.table_capture = 'row' THEN 1 ELSE json_array_length(e.ev_data) END AS n,
                       t.table_capture = 'statement' OR lag(e.ev_type) OVER w IS DISTINCT FROM e.ev_type AS first
                FROM e JOIN replicator.captured_table t ON t.table_id = e.ev_table
                WINDOW w AS (PARTITION BY e.ev_table, e.ev_txid ORDER BY e.ev_id))
            SELECT %4$L::text, ev_table, count(*) FILTER (WHERE first),
                   sum(n)::double precision / count(*) FILTER (WHERE first)
            FROM s GROUP BY ev_table ORDER BY ev_table$q$,
            replicator.event_partition(q.queue_id, v_slot),
            replicator.event_partition(q.queue_id, (v_slot + q.queue_ntables - 1) % q.queue_ntables),
            p_sample, q.queue_name);
    END LOOP;
END;
$$;
