CREATE OR REPLACE FUNCTION replicator.table_write_holders(p_table regclass, p_readers boolean DEFAULT false)
RETURNS integer[]
LANGUAGE sql STABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.table_write_holders(p_table, p_readers)
--
--      The sessions (pids) other than this one holding a lock on the table
--      that keeps writes out (a writer's, a DDL's; not a reader's, unless
--      p_readers: what keeps an ACCESS EXCLUSIVE lock out).
-- ----------------------------------------------------------------------
    SELECT coalesce(array_agg(DISTINCT l.pid ORDER BY l.pid), '{}')
    FROM pg_locks l
    WHERE l.locktype = 'relation' AND l.relation = p_table AND l.granted AND l.pid <> pg_backend_pid()
      AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
      AND (p_readers OR l.mode NOT IN ('AccessShareLock', 'RowShareLock'));
$$;

CREATE OR REPLACE FUNCTION replicator.alter_table(
    p_queue_name text,
    p_table text,
    p_mode text DEFAULT NULL,
    p_key text[] DEFAULT NULL,
    p_ignore text[] DEFAULT NULL,
    p_where text DEFAULT NULL,
    p_set_where boolean DEFAULT false,
    p_old_rows boolean DEFAULT NULL,
    p_capture text DEFAULT NULL)
RETURNS jsonb
LANGUAGE plpgsql AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.alter_table(p_queue_name, p_table, p_mode, p_key, p_ignore, p_where, p_set_where,
--                                   p_old_rows, p_capture)
--
--      Changes the capture settings of a captured table in place: checks
--      them as add_table does (replicator.check_capture_settings),
--      regenerates the capture function and queues an S event (kind
--      'altered', tag 'TABLE ALTER') with the new settings, ordered among
--      the row changes by the queue's event sequence: consumers apply the
--      changes before it with the old settings, those after it with the
--      new. The event asks targets to copy the table again ("copy": true)
--      only where rows or values they lack are needed: a new row filter
--      (rows enter or leave), a new key, columns no longer ignored. Columns
--      newly ignored are dropped from the replicas in place; a new mode
--      changes no row (consumers apply later events in it), nor do old rows
--      taken or dropped (the events after it carry them, or not), nor a
--      new capture kind (the same events, written by other triggers).
--      PostgreSQL's own checks decide who may: the role replacing the
--      capture function must own it (the role that added the table, or the
--      owner of schema replicator after an install) and may lock the table
--      (a write privilege on it, or its ownership). The table is locked against writes
--      (SHARE ROW EXCLUSIVE; readers go on) first: a transaction writing it
--      commits before, its events before the S event, or waits and is
--      captured with the new settings. The triggers stay: only the capture
--      function is replaced; but a new capture kind replaces the triggers,
--      and DROP TRIGGER takes ACCESS EXCLUSIVE: readers too wait for that
--      switch (tried as below, so at most 20 ms at a time). The lock is tried for 20 ms at a time, for 5
--      seconds: the application's writes queue behind a try for 20 ms at
--      most, never behind a long transaction holding the table, where a
--      statement_timeout of theirs could fail them. Past that, it is
--      refused naming the sessions holding the table; nothing is changed.
--
-- Parameters:
--      p_queue_name - queue
--      p_table      - the captured table (replicator.find_table)
--      p_mode       - 'full' or 'pk'; NULL keeps the mode
--      p_key        - key columns; NULL keeps the key
--      p_ignore     - the columns not captured (the whole list); NULL keeps them
--      p_where      - the row filter (NULL: none), when p_set_where
--      p_set_where  - whether p_where replaces the row filter
--      p_old_rows   - whether old rows are queued too; NULL keeps the setting
--      p_capture    - 'statement' or 'row'; NULL keeps the capture kind
--
-- Returns:
--      {"changed": [the settings changed: "mode", "key", "ignore", "where", "old_rows", "capture"],
--       "copy": whether targets copy the table again}; raises when nothing
--      changes
-- ----------------------------------------------------------------------
DECLARE
    t replicator.captured_table := replicator.find_table(p_queue_name, p_table);
    v_oid regclass;
    v_mode text;
    v_key text[];
    v_ignore text[];
    v_where text;
    v_old_rows boolean;
    v_capture text;
    v_lock text := 'SHARE ROW EXCLUSIVE';
    v_pk text[];
    v_changed text[] := '{}';
    v_copy boolean;
    v_holders integer[];
    v_deadline timestamptz;
    v_lock_timeout text;
BEGIN
    IF t.table_suspended IS NOT NULL THEN
        RAISE EXCEPTION 'the capture of %.% is suspended (%): remove the table from the queue and add it again',
            t.table_schema, t.table_name, t.table_suspended;
    END IF;
    v_oid := to_regclass(quote_ident(t.table_schema) || '.' || quote_ident(t.table_name));
    IF v_oid IS NULL THEN
        RAISE EXCEPTION 'table %.% does not exist any more', t.table_schema, t.table_name;
    END IF;
    -- Tries of 20 ms each: the application's writes queue behind a try for 20 ms at most
    -- (never behind a long transaction), and a table written without a pause still
    -- frees its lock between two writes, which a NOWAIT alone would seldom catch.
    IF p_capture <> t.table_capture THEN
        v_lock := 'ACCESS EXCLUSIVE';   -- the triggers are replaced (DROP TRIGGER)
    END IF;
    v_lock_timeout := current_setting('lock_timeout');
    v_deadline := clock_timestamp() + interval '5 seconds';
    LOOP
        BEGIN
            PERFORM set_config('lock_timeout', '20ms', true);
            EXECUTE format('LOCK TABLE %s IN %s MODE', v_oid, v_lock);
            EXIT;
        EXCEPTION WHEN lock_not_available THEN
            IF clock_timestamp() >= v_deadline THEN
                v_holders := replicator.table_write_holders(v_oid, v_lock = 'ACCESS EXCLUSIVE');
                RAISE EXCEPTION USING MESSAGE = format(
                    'table %s.%s was held by writers at every try for 5s (%s): nothing was changed; retry once a '
                    'long transaction among them has ended, or when the table is written less', t.table_schema,
                    t.table_name,
                    coalesce(CASE WHEN cardinality(v_holders) > 1 THEN 'pids ' ELSE 'pid ' END
                             || nullif(array_to_string(v_holders, ', '), ''), 'sessions that ended meanwhile'));
            END IF;
            PERFORM pg_sleep(0.01);   -- a clear window for the writes that queued behind the try
        END;
    END LOOP;
    PERFORM set_config('lock_timeout', v_lock_timeout, true);
    -- read again under the lock: a DDL committed meanwhile changed the record
    t := replicator.find_table(p_queue_name, p_table);
    v_mode := coalesce(p_mode, t.table_mode);
    v_key := coalesce(nullif(p_key, '{}'), t.table_key);
    v_ignore := coalesce(p_ignore, t.table_ignore);
    v_where := CASE WHEN p_set_where THEN p_where ELSE t.table_where END;
    v_old_rows := coalesce(p_old_rows, t.table_old_rows);
    v_capture := coalesce(p_capture, t.table_capture);
    IF v_mode <> t.table_mode THEN v_changed := array_append(v_changed, 'mode'); END IF;
    IF v_key <> t.table_key THEN v_changed := array_append(v_changed, 'key'); END IF;
    IF NOT (v_ignore @> t.table_ignore AND v_ignore <@ t.table_ignore) THEN v_changed := array_append(v_changed, 'ignore'); END IF;
    IF v_where IS DISTINCT FROM t.table_where THEN v_changed := array_append(v_changed, 'where'); END IF;
    IF v_old_rows <> t.table_old_rows THEN v_changed := array_append(v_changed, 'old_rows'); END IF;
    IF v_capture <> t.table_capture THEN v_changed := array_append(v_changed, 'capture'); END IF;
    IF cardinality(v_changed) = 0 THEN
        RAISE EXCEPTION 'table %.% of queue "%" already has these settings: nothing to change',
            t.table_schema, t.table_name, p_queue_name;
    END IF;
    IF 'key' = ANY (v_changed) THEN
        PERFORM replicator.check_capture_tree(v_oid, v_key, p_queue_name, t.table_id);
    END IF;
    PERFORM replicator.check_capture_settings(v_oid, v_mode, v_key, v_ignore, v_where, v_old_rows, v_capture);

    v_pk := ARRAY(SELECT a.attname
                  FROM pg_index i
                  CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, ord)
                  JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
                  WHERE i.indrelid = v_oid AND i.indisprimary ORDER BY k.ord);
    UPDATE replicator.captured_table
    SET table_mode = v_mode, table_key = v_key, key_is_pk = v_key = v_pk,
        key_is_auto = key_is_auto AND NOT 'key' = ANY (v_changed),
        table_ignore = v_ignore, table_where = v_where, table_structure = replicator.table_structure(v_oid, v_key),
        table_old_rows = v_old_rows, table_capture = v_capture
    WHERE table_id = t.table_id;
    PERFORM replicator.generate_capture(t.table_id, NOT 'capture' = ANY (v_changed));
    -- rows a target lacks: a new filter's, a new key's (rows it merged), a column no longer ignored
    v_copy := 'where' = ANY (v_changed) OR 'key' = ANY (v_changed) OR NOT (t.table_ignore <@ v_ignore);
    PERFORM replicator.insert_schema_event(t.table_id,
        replicator.schema_event_data(t.table_id, 'TABLE ALTER', NULL, 'altered') || jsonb_build_object('copy', v_copy));
    RETURN jsonb_build_object('changed', to_jsonb(v_changed), 'copy', v_copy);
END;
$$;
