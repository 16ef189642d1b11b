CREATE OR REPLACE FUNCTION replicator.ddl_captured()
RETURNS boolean
LANGUAGE sql STABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.ddl_captured()
--
--      Whether DDL is captured as it runs: replicator's three event
--      triggers exist and are enabled (a superuser installed it). Else a
--      DDL run directly on a captured table is noticed afterwards, by its
--      capture function (replicator.capture_guard) or before a tick
--      (replicator.sync_drifted).
-- ----------------------------------------------------------------------
    SELECT count(*) = 3 FROM pg_event_trigger
    WHERE evtname IN ('replicator_ddl_command_end', 'replicator_sql_drop', 'replicator_table_rewrite')
      AND evtenabled <> 'D';
$$;

CREATE OR REPLACE FUNCTION replicator.catalog_rows(p_table regclass, OUT xmins xid[], OUT tids tid[])
LANGUAGE sql STABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.catalog_rows(p_table)
--
--      The versions of the catalog rows a capture depends on: its table's
--      columns (pg_attribute) and its primary key (pg_index). Every ALTER
--      that adds, drops, renames or retypes a column, changes its
--      nullability or replaces the primary key writes a new version of one
--      of them: a new xmin, or (in the transaction that wrote the last
--      one) a new ctid.
--
-- Returns:
--      xmins       - their xmins, columns in attnum order, then the key's
--      tids        - their ctids, in the same order
-- ----------------------------------------------------------------------
    WITH r AS (
        SELECT xmin, ctid, attnum AS ord FROM pg_attribute WHERE attrelid = p_table AND attnum > 0
        UNION ALL
        SELECT xmin, ctid, 32767 FROM pg_index WHERE indrelid = p_table AND indisprimary)
    SELECT ARRAY(SELECT xmin FROM r ORDER BY ord), ARRAY(SELECT ctid FROM r ORDER BY ord);
$$;

CREATE OR REPLACE FUNCTION replicator.tree_storage(p_table regclass)
RETURNS jsonb
LANGUAGE sql STABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.tree_storage(p_table)
--
--      The storage (relfilenode) of a captured table and of each of its
--      descendants (replicator.capture_tree), by oid: a rewrite gives a
--      member new storage (a partitioned table has none of its own).
-- ----------------------------------------------------------------------
    SELECT coalesce(jsonb_object_agg(d::oid, c.relfilenode), '{}')
    FROM replicator.capture_tree(p_table) d JOIN pg_class c ON c.oid = d;
$$;

CREATE OR REPLACE FUNCTION replicator.tree_member_gone(p_storage jsonb)
RETURNS boolean
LANGUAGE sql STABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.tree_member_gone(p_storage)
--
--      Whether a member of a capture tree, as replicator.tree_storage()
--      recorded it, is gone from the catalog (dropped, with its rows).
-- ----------------------------------------------------------------------
    -- found by pg_class's oid index (an anti-join was planned as a scan of all of pg_class)
    SELECT (SELECT count(*) FROM pg_class WHERE oid = ANY (ARRAY(SELECT jsonb_object_keys(p_storage)::oid)))
           < (SELECT count(*) FROM jsonb_object_keys(p_storage));
$$;

CREATE OR REPLACE FUNCTION replicator.capture_guard(p_table_id integer)
RETURNS text
LANGUAGE sql STABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.capture_guard(p_table_id)
--
--      Part of replicator.generate_capture(): the condition, checked at
--      every statement, under which the catalog rows of the table's
--      columns and primary key are no longer those the capture function was
--      generated for (replicator.catalog_rows): one index scan of
--      pg_attribute (about 3 us a statement, docs/benchmarks.md), and the
--      primary key from the relation cache (pg_get_replica_identity_index,
--      the primary key while the replica identity is the default; else one
--      more index scan, of pg_index). Without it, a column dropped or
--      renamed directly would make every application write fail, and one
--      added would go uncaptured. The table's own pg_class row is left to
--      the ticker (replicator.sync_drifted): TRUNCATE, GRANT, VACUUM FULL
--      write it, and a rename changes no captured value.
--
-- Returns:
--      a boolean expression
-- ----------------------------------------------------------------------
    SELECT CASE WHEN c.relreplident = 'd' THEN
               format('coalesce(pg_catalog.pg_get_replica_identity_index(%s)::oid, 0) <> %s OR ',
                      t.table_oid, coalesce(pg_get_replica_identity_index(t.table_oid)::oid, 0))
           ELSE '' END
           || format('EXISTS (SELECT FROM pg_catalog.pg_attribute WHERE attrelid = %1$s AND attnum > 0'
                     ' AND (xmin <> ALL (%2$L::xid[]) OR ctid <> ALL (%3$L::tid[]))%4$s)',
                     t.table_oid, t.table_catalog_xmins, t.table_catalog_tids,
                     CASE WHEN c.relreplident = 'd' THEN ''
                          WHEN cardinality(pk.xmins) = 0 THEN format(   -- one added
                              ' UNION ALL SELECT FROM pg_catalog.pg_index WHERE indrelid = %s AND indisprimary',
                              t.table_oid)
                          ELSE format(                                  -- it dropped, or another
                              ' UNION ALL SELECT WHERE NOT EXISTS (SELECT FROM pg_catalog.pg_index'
                              ' WHERE indrelid = %s AND indisprimary AND xmin = %L AND ctid = %L)',
                              t.table_oid, pk.xmins[1], pk.tids[1]) END)
    FROM replicator.captured_table t
    JOIN pg_class c ON c.oid = t.table_oid
    -- the primary key's row is the last of catalog_rows(), where there is one
    LEFT JOIN LATERAL (SELECT ARRAY(SELECT xmin FROM pg_index WHERE indrelid = t.table_oid AND indisprimary) AS xmins,
                              ARRAY(SELECT ctid FROM pg_index WHERE indrelid = t.table_oid AND indisprimary) AS tids
                      ) pk ON true
    WHERE t.table_id = p_table_id;
$$;

CREATE OR REPLACE FUNCTION replicator.lock_table_record(p_table_id integer)
RETURNS boolean
LANGUAGE plpgsql AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.lock_table_record(p_table_id)
--
--      Takes the right to record a change of a captured table that no
--      event trigger saw (replicator.capture_drift, suspend_capture,
--      sync_drifted): a lock on its captured_table row, never waited for
--      (SKIP LOCKED), so that no application statement waits for another.
--      A row lock, which only the owner may take (UPDATE privilege), where
--      any role could hold an advisory key for ever. Not in a SERIALIZABLE
--      transaction (the ticker records it then: an update of the record
--      would make the application's transactions conflict), nor in a
--      REPEATABLE READ one whose snapshot predates the record's last change.
--
-- Returns:
--      true if this transaction may record the change
-- ----------------------------------------------------------------------
BEGIN
    IF current_setting('transaction_isolation') = 'serializable' THEN
        RETURN false;
    END IF;
    PERFORM FROM replicator.captured_table WHERE table_id = p_table_id FOR NO KEY UPDATE SKIP LOCKED;
    RETURN FOUND;
EXCEPTION WHEN serialization_failure THEN
    RETURN false;
END;
$$;

CREATE OR REPLACE FUNCTION replicator.capture_drift(p_table_id integer, p_op text)
RETURNS text
LANGUAGE plpgsql AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.capture_drift(p_table_id, p_op)
--
--      Follows a DDL that no event trigger saw, from inside the first
--      statements on the table after it (its capture function's guard) or
--      before a tick (replicator.sync_drifted):
--      - the table's record as it is now (replicator.table_record_now)
--        differs in what targets depend on: an S event of kind 'altered'
--        (tag 'UNSEEN DDL') with the new structure is queued, ordered before
--        this statement's rows, once per transaction; with "copy": true
--        when the rows were rewritten (a member of the capture tree has new
--        storage and a column changed: ALTER COLUMN ... TYPE ... USING, to
--        the same type too) or a member of the tree is gone with its rows,
--        so targets copy the table again. Only the transaction that records
--        the change asks for the copy: one that rolls back leaves the
--        record as it was, and the change is seen again;
--      - the record and the capture function are brought up to date by the
--        transaction that gets the lock on the record (replicator.lock_table_record,
--        never a wait) and may update the
--        record (not SERIALIZABLE: the ticker does it then); the others
--        capture in the new layout by dynamic SQL until it commits;
--      - the key is gone or has no equality any more, or the row filter no
--        longer runs: the capture is suspended (replicator.suspend_capture)
--        rather than failing every write, and consumers stop at its event
--        with the way out.
--      Inside an application's statement nothing here waits for a lock but
--      on the table itself (a DDL in progress on it); a lock timeout or a
--      cancel the application set is raised as it would be without
--      replicator.
--
-- Parameters:
--      p_table_id  - replicator.captured_table id
--      p_op        - TG_OP of the statement; NULL before a tick
--
-- Returns:
--      the statement capturing this statement's rows in the table's new
--      structure (replicator.capture_chunked_sql, the slot as $1; for a row
--      capture, this row's: NEW as $2, OLD as $3), or NULL
--      when there is none to run (TRUNCATE, before a tick, capture
--      suspended)
-- ----------------------------------------------------------------------
DECLARE
    t replicator.captured_table;
    v_now replicator.captured_table;
    v_error text;
    v_changed boolean;
    v_copy boolean;
    v_recording boolean;
    v_data jsonb;
    v_announced text := 'replicator.announced_' || p_table_id;
BEGIN
    SELECT * INTO t FROM replicator.captured_table WHERE table_id = p_table_id;
    IF NOT FOUND OR t.table_suspended IS NOT NULL THEN
        RETURN NULL;
    END IF;
    BEGIN
        v_now := replicator.table_record_now(p_table_id);
        IF v_now IS NULL THEN
            -- dropped (before a tick: a statement on the table sees it)
            PERFORM replicator.forget_table(p_table_id, 'DROP TABLE', NULL);
            RETURN NULL;
        END IF;
        v_error := replicator.row_filter_error(v_now.table_oid, v_now.table_where);
        IF v_error IS NOT NULL THEN
            RAISE EXCEPTION 'its row filter (--where %) fails: %', v_now.table_where, v_error;
        END IF;
    EXCEPTION
        WHEN lock_not_available OR deadlock_detected OR serialization_failure OR query_canceled THEN
            IF p_op IS NULL THEN
                RETURN NULL;   -- before a tick: tried again at the next one
            END IF;
            RAISE;
        WHEN OTHERS THEN
            PERFORM replicator.suspend_capture(p_table_id, SQLERRM);
            RETURN NULL;
    END;

    v_recording := replicator.lock_table_record(p_table_id);
    v_copy := v_recording AND (
        replicator.tree_member_gone(t.table_storage)
        OR (replicator.tree_storage(t.table_oid) IS DISTINCT FROM t.table_storage
            AND EXISTS (SELECT FROM pg_attribute WHERE attrelid = t.table_oid AND attnum > 0
                        AND (xmin <> ALL (t.table_catalog_xmins) OR ctid <> ALL (t.table_catalog_tids)))));
    v_changed := t.table_columns IS DISTINCT FROM v_now.table_columns
        OR replicator.structure_signature(v_now.table_structure)
           IS DISTINCT FROM replicator.structure_signature(t.table_structure);
    IF v_copy OR v_changed THEN
        v_data := replicator.schema_event_data(v_now, 'UNSEEN DDL', NULL, 'altered') || jsonb_build_object('copy', v_copy);
        -- one S event a transaction; later statements' rows follow it in the queue
        IF v_copy OR current_setting(v_announced, true) IS DISTINCT FROM md5(v_data::text) THEN
            PERFORM replicator.insert_schema_event(p_table_id, v_data);
            PERFORM set_config(v_announced, md5(v_data::text), true);
        END IF;
    END IF;
    IF v_recording THEN
        BEGIN
            PERFORM replicator.store_table_record(v_now);
            PERFORM replicator.generate_capture(p_table_id, true);
        EXCEPTION
            WHEN serialization_failure THEN
                NULL;   -- REPEATABLE READ, the record changed since the snapshot: left to the next statement
            WHEN OTHERS THEN
                -- never the application's error: this statement is still captured, the next one records
                RAISE WARNING 'replicator: could not record the change of %.%: %', v_now.table_schema,
                    v_now.table_name, SQLERRM;
        END;
    END IF;
    IF p_op IN ('INSERT', 'UPDATE', 'DELETE') AND v_now.table_capture = 'row' THEN
        -- one row, as the row capture queues it: a key change's old row is left out
        -- (no D) while another row holds its key (a key swap)
        RETURN replicator.capture_chunked_sql(v_now, p_op, '$1', '(SELECT ($2).*)',
            CASE WHEN p_op = 'UPDATE'
                 THEN format('(SELECT ($3).* WHERE %s OR NOT EXISTS (SELECT FROM %s%s))',
                             replicator.capture_row_key_kept(v_now, '($2)', '($3)'), v_now.table_oid::regclass,
                             replicator.capture_row_holders(v_now, '($3)'))
                 ELSE '(SELECT ($3).*)' END);
    ELSIF p_op IN ('INSERT', 'UPDATE', 'DELETE') THEN
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
--      capture function is made one that captures nothing, by the
--      transaction that gets the lock on the record (the others queue the event too,
--      once a transaction).
--
-- Parameters:
--      p_table_id  - replicator.captured_table id
--      p_reason    - what is wrong, for people
-- ----------------------------------------------------------------------
DECLARE
    t replicator.captured_table;
    v_queue text;
    v_name text;
    v_announced text := 'replicator.announced_' || p_table_id;
BEGIN
    IF current_setting(v_announced, true) = 'suspended' THEN
        RETURN;
    END IF;
    SELECT * INTO t FROM replicator.captured_table WHERE table_id = p_table_id;
    SELECT queue_name INTO v_queue FROM replicator.queue WHERE queue_id = t.queue_id;
    v_name := format('%I.%I', t.table_schema, t.table_name);
    PERFORM replicator.insert_schema_event(p_table_id, jsonb_build_object(
        'kind', 'suspended', 'schema', t.table_schema, 'name', t.table_name,
        'reason', format('a DDL run without replicator (no event triggers) changed %s: %s', v_name, p_reason),
        'hint', format('remove the table from the queue and add it again (it is copied again): '
                       'replicator table remove %s %s, then replicator table add %s %s with its options',
                       v_queue, v_name, v_queue, v_name)));
    PERFORM set_config(v_announced, 'suspended', true);
    IF replicator.lock_table_record(p_table_id) THEN
        BEGIN
            UPDATE replicator.captured_table SET table_suspended = p_reason WHERE table_id = p_table_id;
            PERFORM replicator.generate_capture(p_table_id, true);
        EXCEPTION
            WHEN serialization_failure THEN
                NULL;   -- REPEATABLE READ: the next statement suspends it
            WHEN OTHERS THEN
                RAISE WARNING 'replicator: could not suspend the capture of %.%: %', t.table_schema, t.table_name,
                    SQLERRM;
        END;
    END IF;
END;
$$;

CREATE OR REPLACE FUNCTION replicator.drifted_tables(p_queue_id integer, p_unseen boolean)
RETURNS SETOF replicator.captured_table
LANGUAGE sql STABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.drifted_tables(p_queue_id, p_unseen)
--
--      The tables of a queue that replicator.sync_drifted has something
--      to follow for: those whose capture function's guard no longer
--      matches whether event triggers capture DDL, and where none do,
--      those that DDL changed since their record was written: dropped or
--      renamed, their catalog rows changed, a member of their tree gone,
--      or their descendants no longer those their triggers are on
--      (replicator.sync_partitions). Reads the catalogs only, in one
--      query: a ticker runs it before every tick, and a function called
--      per table was planned per table (about 1 ms a table).
--
-- Parameters:
--      p_queue_id  - the queue
--      p_unseen    - true when no event trigger captures DDL
--                    (NOT replicator.ddl_captured())
--
-- Returns:
--      their captured_table rows, in table_id order
-- ----------------------------------------------------------------------
    SELECT t.* FROM replicator.captured_table t
    WHERE t.queue_id = p_queue_id AND t.table_suspended IS NULL
      AND (t.table_guarded <> p_unseen
           OR p_unseen AND (
               NOT EXISTS (SELECT FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                           WHERE c.oid = t.table_oid AND n.nspname::text = t.table_schema
                             AND c.relname::text = t.table_name)
               OR (SELECT (c.xmins, c.tids) FROM replicator.catalog_rows(t.table_oid) c)
                  IS DISTINCT FROM (t.table_catalog_xmins, t.table_catalog_tids)
               OR replicator.tree_member_gone(t.table_storage)
               OR ARRAY(SELECT d FROM replicator.capture_tree(t.table_oid) d ORDER BY d)
                  IS DISTINCT FROM replicator.triggered_tree(t.table_id)))
    ORDER BY t.table_id;
$$;

CREATE OR REPLACE FUNCTION replicator.sync_drifted(p_queue_id integer)
RETURNS integer
LANGUAGE plpgsql AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.sync_drifted(p_queue_id)
--
--      Before a tick (replicator.follow_unseen_ddl): brings the capture of
--      a queue's tables up to date with DDL that no event trigger saw and
--      no statement followed (replicator.capture_drift), so targets learn
--      of a column added, renamed or dropped, a primary key replaced, a
--      table renamed or dropped, without waiting for the next write; makes
--      the triggers of partitions and inheritance children created,
--      attached or detached since (replicator.sync_partitions, which asks
--      for a copy when one brought or took rows); and captures the tables
--      created in the queue's followed schemas (replicator.follow_new_tables:
--      their rows reach targets by the initial copy). Also generates again
--      a capture function whose guard (replicator.capture_guard) no longer
--      matches whether event triggers capture DDL (they were disabled,
--      dropped, or created since). A table locked by a DDL in progress, or
--      one that cannot be followed now, is left to a later tick: ticks
--      never wait for it (lock_timeout 50ms). The catalogs are read first,
--      and a table's record locked (a write: a transaction id, WAL) only
--      when it has something to follow: an idle pass writes nothing.
--
-- Returns:
--      the number of tables followed, generated again or newly captured
-- ----------------------------------------------------------------------
DECLARE
    t replicator.captured_table;
    v_count integer := 0;
    v_lock_timeout text := current_setting('lock_timeout');
    v_unseen boolean := NOT replicator.ddl_captured();
BEGIN
    PERFORM set_config('lock_timeout', '50ms', true);
    -- the catalogs read first: a record is locked (a write: a transaction id, WAL) only when needed
    FOR t IN SELECT * FROM replicator.drifted_tables(p_queue_id, v_unseen) LOOP
        -- not while an application's statement is following the same change; checked again locked
        CONTINUE WHEN NOT replicator.lock_table_record(t.table_id);
        BEGIN
            IF v_unseen AND (
                   -- dropped, or renamed
                   NOT EXISTS (SELECT FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                               WHERE c.oid = t.table_oid AND n.nspname::text = t.table_schema
                                 AND c.relname::text = t.table_name)
                   OR (SELECT (c.xmins, c.tids) FROM replicator.catalog_rows(t.table_oid) c)
                      IS DISTINCT FROM (t.table_catalog_xmins, t.table_catalog_tids)
                   OR replicator.tree_member_gone(t.table_storage)) THEN
                PERFORM replicator.capture_drift(t.table_id, NULL);
                v_count := v_count + 1;
            ELSIF t.table_guarded <> v_unseen THEN
                PERFORM replicator.generate_capture(t.table_id, true);
                v_count := v_count + 1;
            END IF;
            IF v_unseen AND EXISTS (SELECT FROM replicator.captured_table
                                    WHERE table_id = t.table_id AND table_suspended IS NULL)
               AND EXISTS (SELECT FROM pg_class WHERE oid = t.table_oid)
               AND replicator.sync_partitions(t.table_id, 'UNSEEN DDL', NULL, false) THEN
                v_count := v_count + 1;
            END IF;
        EXCEPTION
            WHEN lock_not_available OR deadlock_detected OR serialization_failure THEN
                NULL;   -- tried again before the next tick
            WHEN raise_exception THEN
                -- the tree now holds what capture cannot follow (replicator.check_capture_tree)
                PERFORM replicator.suspend_capture(t.table_id, SQLERRM);
            WHEN OTHERS THEN
                -- (a child of another role's, whose triggers the owner may not make): ticks go on
                RAISE WARNING 'replicator: %.% not followed yet: %', t.table_schema, t.table_name, SQLERRM;
        END;
    END LOOP;
    IF v_unseen THEN
        -- tables created in the queue's followed schemas since
        v_count := v_count + replicator.follow_new_tables('UNSEEN DDL', NULL, '{}', p_queue_id,
                                                          replicator.capture_chunk());
    END IF;
    PERFORM set_config('lock_timeout', v_lock_timeout, true);
    RETURN v_count;
END;
$$;

CREATE OR REPLACE FUNCTION replicator.follow_unseen_ddl(p_queue_name text DEFAULT NULL)
RETURNS integer
LANGUAGE plpgsql AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.follow_unseen_ddl(p_queue_name)
--
--      replicator.sync_drifted for one queue or all, run by the ticker
--      (replicator.source.Source.tick) in a transaction of its own before
--      it ticks, so that the tick includes what it queued. Runs as its
--      caller (the installing owner): consumers are not granted it, since
--      it captures tables and makes triggers.
--
-- Parameters:
--      p_queue_name - a queue; NULL for every queue
--
-- Returns:
--      the number of tables followed, generated again or newly captured
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
