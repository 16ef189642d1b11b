CREATE OR REPLACE FUNCTION replicator.ddl_captured()
RETURNS boolean
LANGUAGE sql STABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.ddl_captured()
--
--      Whether DDL is captured as it runs: replicator's three event
--      triggers exist and are enabled (a superuser installed it). Else a
--      DDL run directly on a captured table is noticed afterwards, by its
--      capture function (replicator.capture_guard) or the ticker
--      (replicator.sync_drifted).
-- ----------------------------------------------------------------------
    SELECT count(*) = 3 FROM pg_event_trigger
    WHERE evtname IN ('replicator_ddl_command_end', 'replicator_sql_drop', 'replicator_table_rewrite')
      AND evtenabled <> 'D';
$$;

CREATE OR REPLACE FUNCTION replicator.catalog_rows(p_table regclass)
RETURNS xid[]
LANGUAGE sql STABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.catalog_rows(p_table)
--
--      The xmins of a table's pg_class row and of its columns' pg_attribute
--      rows. Every ALTER TABLE that changes a column (add, drop, rename,
--      type, nullability) or the table (rename, TRUNCATE, a rewrite) writes
--      a new version of one of them, with a new xmin.
-- ----------------------------------------------------------------------
    SELECT ARRAY(SELECT xmin FROM pg_class WHERE oid = p_table)
           || ARRAY(SELECT xmin FROM pg_attribute WHERE attrelid = p_table AND attnum > 0 ORDER BY attnum);
$$;

CREATE OR REPLACE FUNCTION replicator.capture_guard(p_table_id integer)
RETURNS text
LANGUAGE sql STABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.capture_guard(p_table_id)
--
--      Part of replicator.generate_capture(): the condition, checked at
--      every statement, under which the table's catalog rows are no longer
--      those the capture function was generated for. One index scan of
--      pg_attribute and one of pg_class (about 3 us a statement,
--      docs/benchmarks.md); without it, a column dropped or renamed
--      directly would make every application write fail, and one added
--      would go uncaptured. Empty where event triggers capture DDL as it
--      runs.
--
-- Returns:
--      a boolean expression, or NULL when no check is needed
-- ----------------------------------------------------------------------
    SELECT format('EXISTS (SELECT FROM pg_catalog.pg_class WHERE oid = %1$s AND xmin <> ALL (%2$L::xid[])'
                  ' UNION ALL SELECT FROM pg_catalog.pg_attribute WHERE attrelid = %1$s AND attnum > 0'
                  ' AND xmin <> ALL (%2$L::xid[]))', t.table_oid, t.table_catalog)
    FROM replicator.captured_table t
    WHERE t.table_id = p_table_id AND NOT replicator.ddl_captured();
$$;

CREATE OR REPLACE FUNCTION replicator.capture_drift(p_table_id integer, p_op text)
RETURNS text
LANGUAGE plpgsql AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.capture_drift(p_table_id, p_op)
--
--      Follows a DDL that no event trigger saw, from inside the first
--      statement on the table after it (its capture function's guard) or
--      from the ticker. It never fails the statement it runs in:
--      - the table's record as it is now (replicator.table_record_now)
--        differs in what targets depend on: an S event of kind 'altered'
--        with the new structure is queued, ordered before this statement's
--        rows; with "copy": true where the rows were rewritten (the storage
--        changed in the transaction that last changed a column: ALTER
--        COLUMN ... TYPE ... USING, to the same type too), so targets copy
--        the table again;
--      - the record and the capture function are brought up to date when
--        no other transaction is doing it (a try-lock, never a wait: the
--        application's transaction must not block on another); else the
--        next statement does it again;
--      - the key is gone, or the row filter no longer runs: the capture is
--        suspended (replicator.suspend_capture) rather than failing every
--        write, and consumers stop at its event with the way out.
--      A partitioned table has no storage of its own: a rewrite to the
--      same types of its partitions is not seen without event triggers.
--
-- Parameters:
--      p_table_id  - replicator.captured_table id
--      p_op        - TG_OP of the statement; NULL from the ticker
--
-- Returns:
--      the statement capturing this statement's rows in the table's new
--      structure (replicator.capture_chunked_sql, the slot as $1), or NULL
--      when there is none to run (TRUNCATE, ticker, capture suspended)
-- ----------------------------------------------------------------------
DECLARE
    t replicator.captured_table;
    v_now replicator.captured_table;
    v_error text;
    v_rewritten boolean;
BEGIN
    SELECT * INTO t FROM replicator.captured_table WHERE table_id = p_table_id;
    IF NOT FOUND OR t.table_suspended IS NOT NULL THEN
        RETURN NULL;
    END IF;
    BEGIN
        v_now := replicator.table_record_now(p_table_id);
        IF v_now IS NULL THEN
            -- dropped (the ticker's call: a statement on the table sees it)
            PERFORM replicator.forget_table(p_table_id, 'DROP TABLE', NULL);
            RETURN NULL;
        END IF;
        v_error := replicator.row_filter_error(v_now.table_oid, v_now.table_where);
        IF v_error IS NOT NULL THEN
            RAISE EXCEPTION 'its row filter (--where %) fails: %', v_now.table_where, v_error;
        END IF;
    EXCEPTION
        WHEN lock_not_available THEN
            RETURN NULL;   -- the ticker's lock_timeout: tried again at its next pass
        WHEN OTHERS THEN
            PERFORM replicator.suspend_capture(p_table_id, SQLERRM);
            RETURN NULL;
    END;
    v_rewritten := pg_relation_filenode(t.table_oid) IS DISTINCT FROM t.table_filenode
        AND EXISTS (SELECT FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
                    WHERE a.attrelid = t.table_oid AND a.attnum > 0 AND a.xmin = c.xmin);
    IF v_rewritten OR t.table_columns IS DISTINCT FROM v_now.table_columns
       OR replicator.structure_signature(v_now.table_structure)
          IS DISTINCT FROM replicator.structure_signature(t.table_structure) THEN
        PERFORM replicator.insert_schema_event(p_table_id,
            replicator.schema_event_data(v_now, 'UNSEEN DDL', NULL, 'altered')
            || jsonb_build_object('copy', v_rewritten, 'unseen', true));
    END IF;
    IF pg_try_advisory_xact_lock(2026112501, p_table_id) THEN
        BEGIN
            UPDATE replicator.captured_table SET
                table_schema = v_now.table_schema, table_name = v_now.table_name,
                table_columns = v_now.table_columns, table_key = v_now.table_key,
                table_ignore = v_now.table_ignore, key_is_pk = v_now.key_is_pk, key_is_auto = v_now.key_is_auto,
                table_structure = v_now.table_structure
            WHERE table_id = p_table_id;
            PERFORM replicator.generate_capture(p_table_id, true);
        EXCEPTION WHEN OTHERS THEN
            -- a REPEATABLE READ transaction that cannot update the record: left to the next statement
            NULL;
        END;
    END IF;
    IF p_op IN ('INSERT', 'UPDATE', 'DELETE') THEN
        RETURN replicator.capture_chunked_sql(v_now, p_op, '$1');
    END IF;
    RETURN NULL;
END;
$$;

CREATE OR REPLACE FUNCTION replicator.suspend_capture(p_table_id integer, p_reason text)
RETURNS void
LANGUAGE plpgsql AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.suspend_capture(p_table_id, p_reason)
--
--      A DDL that no event trigger saw left a captured table without what
--      its capture needs (its key, or a row filter that runs). Rather than
--      fail every application write, its capture stops: an S event of kind
--      'suspended' tells consumers why and the way out (remove the table
--      from the queue and add it again: it is copied again), and the
--      capture function is made one that captures nothing.
--
-- Parameters:
--      p_table_id  - replicator.captured_table id
--      p_reason    - what is wrong, for people
-- ----------------------------------------------------------------------
DECLARE
    t replicator.captured_table;
    v_queue text;
BEGIN
    SELECT * INTO t FROM replicator.captured_table WHERE table_id = p_table_id;
    SELECT queue_name INTO v_queue FROM replicator.queue WHERE queue_id = t.queue_id;
    PERFORM replicator.insert_schema_event(p_table_id, jsonb_build_object(
        'kind', 'suspended', 'schema', t.table_schema, 'name', t.table_name,
        'reason', format('a DDL run without replicator (no event triggers) changed %I.%I: %s',
                         t.table_schema, t.table_name, p_reason),
        'hint', format('remove the table from the queue and add it again (it is copied again): '
                       'replicator table remove %s %s, then replicator table add %s %s with its options',
                       v_queue, format('%I.%I', t.table_schema, t.table_name),
                       v_queue, format('%I.%I', t.table_schema, t.table_name))));
    IF pg_try_advisory_xact_lock(2026112501, p_table_id) THEN
        BEGIN
            UPDATE replicator.captured_table SET table_suspended = p_reason WHERE table_id = p_table_id;
            PERFORM replicator.generate_capture(p_table_id, true);
        EXCEPTION WHEN OTHERS THEN
            NULL;
        END;
    END IF;
END;
$$;

CREATE OR REPLACE FUNCTION replicator.sync_drifted(p_queue_id integer)
RETURNS integer
LANGUAGE plpgsql AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.sync_drifted(p_queue_id)
--
--      Called by the ticker where no event trigger captures DDL: follows
--      the DDL run directly on a queue's captured tables that no statement
--      has written since (replicator.capture_drift), so targets learn of a
--      column added, renamed or dropped, or a table renamed or dropped,
--      without waiting for the next write; and captures the tables created
--      in followed schemas since (replicator.follow_new_tables: their rows
--      reach targets by the initial copy).
--
-- Returns:
--      the number of tables followed or newly captured
-- ----------------------------------------------------------------------
DECLARE
    v_id integer;
    v_count integer := 0;
    v_lock_timeout text := current_setting('lock_timeout');
BEGIN
    IF replicator.ddl_captured() THEN
        RETURN 0;
    END IF;
    -- a table locked by a DDL in progress is left to a later pass: ticks never wait for it
    PERFORM set_config('lock_timeout', '50ms', true);
    FOR v_id IN
        SELECT t.table_id FROM replicator.captured_table t
        WHERE t.queue_id = p_queue_id AND t.table_suspended IS NULL AND t.table_catalog IS NOT NULL
          AND replicator.catalog_rows(t.table_oid) IS DISTINCT FROM t.table_catalog
        ORDER BY t.table_id
    LOOP
        -- not while an application's statement is following the same change
        IF pg_try_advisory_xact_lock(2026112501, v_id) THEN
            PERFORM replicator.capture_drift(v_id, NULL);
            v_count := v_count + 1;
        END IF;
    END LOOP;
    -- tables created in a followed schema since
    v_count := v_count + replicator.follow_new_tables('UNSEEN DDL', NULL);
    PERFORM set_config('lock_timeout', v_lock_timeout, true);
    RETURN v_count;
END;
$$;

CREATE OR REPLACE FUNCTION replicator.follow_unseen_ddl(p_queue_name text DEFAULT NULL)
RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.follow_unseen_ddl(p_queue_name)
--
--      replicator.sync_drifted for one queue or all, in a transaction of
--      its own before a tick (the ticker calls it too, but its own events
--      are not in the tick it makes): a consumer catching up to a tick
--      sees the DDL run directly before it. Harmless to call at any time.
--
-- Parameters:
--      p_queue_name - a queue; NULL for every queue
--
-- Returns:
--      the number of tables followed or newly captured
-- ----------------------------------------------------------------------
DECLARE
    v_count integer := 0;
    v_queue integer;
BEGIN
    FOR v_queue IN SELECT queue_id FROM replicator.queue
                   WHERE p_queue_name IS NULL OR queue_id = (replicator.find_queue(p_queue_name)).queue_id
                   ORDER BY queue_id LOOP
        v_count := v_count + replicator.sync_drifted(v_queue);
    END LOOP;
    RETURN v_count;
END;
$$;
