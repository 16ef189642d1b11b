CREATE OR REPLACE FUNCTION replicator.insert_schema_event(p_table_id integer, p_data jsonb)
RETURNS bigint
LANGUAGE plpgsql AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.insert_schema_event(p_table_id, p_data)
--
--      Queues an S event for a captured table into its queue, from the
--      queue's event sequence: the schema change is ordered among the
--      row changes of the same transaction and of others.
--
-- Returns:
--      the event id
-- ----------------------------------------------------------------------
DECLARE
    v_queue integer;
    v_id bigint;
BEGIN
    SELECT queue_id INTO v_queue FROM replicator.captured_table WHERE table_id = p_table_id;
    EXECUTE format('INSERT INTO %s (ev_slot, ev_id, ev_type, ev_table, ev_data)'
                   ' VALUES ($1, nextval(%L), ''S'', $2, $3) RETURNING ev_id',
                   replicator.event_table(v_queue), replicator.event_id_seq(v_queue))
        INTO v_id USING replicator.current_slot(v_queue), p_table_id, p_data::json;
    RETURN v_id;
END;
$$;

CREATE OR REPLACE FUNCTION replicator.structure_signature(p_structure jsonb)
RETURNS jsonb
LANGUAGE sql IMMUTABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.structure_signature(p_structure)
--
--      The part of a table_structure() that targets depend on: names,
--      column names, attnums and types, key. A change of default or of
--      nullability alone is not announced.
-- ----------------------------------------------------------------------
    SELECT jsonb_build_object(
        'schema', p_structure->'schema', 'name', p_structure->'name', 'key', p_structure->'key',
        'columns', (SELECT jsonb_agg(jsonb_build_object('name', c->'name', 'attnum', c->'attnum',
                                                        'type', c->'type') ORDER BY (c->>'attnum')::int)
                    FROM jsonb_array_elements(p_structure->'columns') c));
$$;

CREATE OR REPLACE FUNCTION replicator.schema_event_data(p_table_id integer, p_tag text, p_sql text, p_kind text)
RETURNS jsonb
LANGUAGE sql STABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.schema_event_data(p_table_id, p_tag, p_sql, p_kind)
--
--      The data of an S event: what ran (command tag, statement text),
--      what happened to the table (p_kind: 'created', 'altered'), and the
--      resulting structure with the captured columns in event value order.
-- ----------------------------------------------------------------------
    SELECT jsonb_build_object(
        'kind', p_kind, 'tag', p_tag, 'sql', p_sql,
        'schema', t.table_schema, 'name', t.table_name, 'mode', t.table_mode,
        'key', to_jsonb(t.table_key),
        'columns', to_jsonb(ARRAY(SELECT c FROM unnest(t.table_columns) c WHERE c <> ALL (t.table_ignore))),
        'structure', t.table_structure)
    FROM replicator.captured_table t WHERE t.table_id = p_table_id;
$$;

CREATE OR REPLACE FUNCTION replicator.forget_table(p_table_id integer, p_tag text, p_sql text)
RETURNS void
LANGUAGE plpgsql AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.forget_table(p_table_id, p_tag, p_sql)
--
--      A captured table was dropped: queue an S event of kind 'dropped'
--      and stop capturing it.
-- ----------------------------------------------------------------------
DECLARE
    t replicator.captured_table;
BEGIN
    SELECT * INTO t FROM replicator.captured_table WHERE table_id = p_table_id;
    PERFORM replicator.insert_schema_event(p_table_id, jsonb_build_object(
        'kind', 'dropped', 'tag', p_tag, 'sql', p_sql, 'schema', t.table_schema, 'name', t.table_name));
    PERFORM replicator.drop_capture(p_table_id);
    DELETE FROM replicator.captured_table WHERE table_id = p_table_id;
END;
$$;

CREATE OR REPLACE FUNCTION replicator.sync_table(p_table_id integer, p_tag text, p_sql text)
RETURNS boolean
LANGUAGE plpgsql AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.sync_table(p_table_id, p_tag, p_sql)
--
--      Brings a captured table's record up to date with the catalog after
--      DDL: names, columns, key (followed through renames by attnum; a new
--      primary key replaces a primary or automatic key), ignored columns.
--      When anything targets depend on changed, regenerates the capture
--      function and queues an S event. A change that would leave the table
--      without a usable key aborts the DDL with the way out.
--
-- Returns:
--      true if an S event was queued
-- ----------------------------------------------------------------------
DECLARE
    t replicator.captured_table;
    v_schema text;
    v_name text;
    v_columns text[];
    v_pk text[];
    v_key text[];
    v_ignore text[];
    v_structure jsonb;
    v_missing text;
BEGIN
    SELECT * INTO t FROM replicator.captured_table WHERE table_id = p_table_id;
    SELECT n.nspname, c.relname INTO v_schema, v_name
    FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = t.table_oid;
    IF NOT FOUND THEN
        PERFORM replicator.forget_table(p_table_id, p_tag, p_sql);
        RETURN true;
    END IF;

    v_columns := ARRAY(SELECT attname FROM pg_attribute
                       WHERE attrelid = t.table_oid AND attnum > 0 AND NOT attisdropped ORDER BY attnum);
    -- Follow key and ignored columns through renames by their attnum.
    v_key := ARRAY(SELECT a.attname
                   FROM unnest(t.table_key) WITH ORDINALITY AS k(name, ord)
                   JOIN jsonb_array_elements(t.table_structure->'columns') c ON c->>'name' = k.name
                   JOIN pg_attribute a ON a.attrelid = t.table_oid AND a.attnum = (c->>'attnum')::int
                                      AND NOT a.attisdropped
                   ORDER BY k.ord);
    v_ignore := ARRAY(SELECT a.attname
                      FROM unnest(t.table_ignore) AS i(name)
                      JOIN jsonb_array_elements(t.table_structure->'columns') c ON c->>'name' = i.name
                      JOIN pg_attribute a ON a.attrelid = t.table_oid AND a.attnum = (c->>'attnum')::int
                                         AND NOT a.attisdropped);
    v_pk := ARRAY(SELECT a.attname
                  FROM pg_index i
                  CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, ord)
                  JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
                  WHERE i.indrelid = t.table_oid AND i.indisprimary ORDER BY k.ord);
    -- key_is_pk: the key follows the primary key (kept on its columns while there is none);
    -- key_is_auto: every comparable column until a primary key appears; else a --key.
    IF (t.key_is_pk OR t.key_is_auto) AND cardinality(v_pk) > 0 THEN
        t.key_is_pk := true;
        t.key_is_auto := false;
        v_key := v_pk;
    ELSIF t.key_is_auto THEN
        v_key := replicator.comparable_columns(t.table_oid);
    ELSIF t.key_is_pk AND cardinality(v_key) = cardinality(t.table_key) AND NOT EXISTS (
              -- the primary key is gone: is the key still unique (a unique index on NOT NULL
              -- key columns)? Else duplicates of it would silently collapse on targets.
              SELECT 1 FROM pg_index i
              WHERE i.indrelid = t.table_oid AND i.indisunique AND i.indimmediate
                AND i.indpred IS NULL AND i.indexprs IS NULL
                AND NOT EXISTS (SELECT 1 FROM unnest(i.indkey) k(attnum)
                                JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
                                WHERE NOT a.attnotnull OR a.attname <> ALL (v_key))) THEN
        IF t.table_mode <> 'full' THEN
            RAISE EXCEPTION 'table %.% is captured in pk mode with key (%), which this statement leaves without a unique constraint',
                v_schema, v_name, array_to_string(t.table_key, ', ')
                USING HINT = 'replace the primary key in the same statement (ALTER TABLE ... DROP CONSTRAINT ..., '
                             'ADD PRIMARY KEY (...)), or keep a unique index on the key columns';
        END IF;
        -- Full mode: every comparable column becomes the key (as for a keyless table
        -- created in a followed schema) until a primary key is added again.
        t.key_is_pk := false;
        t.key_is_auto := true;
        v_key := replicator.comparable_columns(t.table_oid);
        RAISE WARNING 'replicator: %.% has no primary key any more: captured with every column as its key until one is added',
            v_schema, v_name;
    END IF;
    IF cardinality(v_key) = 0 OR (NOT t.key_is_auto AND v_key IS DISTINCT FROM v_pk
                                  AND cardinality(v_key) < cardinality(t.table_key)) THEN
        SELECT string_agg(k, ', ') INTO v_missing FROM unnest(t.table_key) k;
        RAISE EXCEPTION 'table %.% is captured with key (%), which this statement removes', v_schema, v_name, v_missing
            USING HINT = format('remove the table from its queue first: replicator table remove %s %s.%s',
                                (SELECT queue_name FROM replicator.queue q WHERE q.queue_id = t.queue_id),
                                v_schema, v_name);
    END IF;
    v_structure := replicator.table_structure(t.table_oid, v_key);

    IF replicator.structure_signature(v_structure) = replicator.structure_signature(t.table_structure)
       AND t.table_columns = v_columns THEN
        RETURN false;
    END IF;
    UPDATE replicator.captured_table
    SET table_schema = v_schema, table_name = v_name, table_columns = v_columns, table_key = v_key,
        table_ignore = v_ignore, key_is_pk = t.key_is_pk, key_is_auto = t.key_is_auto,
        table_structure = v_structure
    WHERE table_id = p_table_id;
    IF t.table_where IS NOT NULL THEN
        BEGIN
            EXECUTE format('SELECT 1 FROM %s WHERE (%s) LIMIT 0', t.table_oid::regclass, t.table_where);
        EXCEPTION WHEN OTHERS THEN
            RAISE EXCEPTION 'this statement breaks the row filter of %.% (%)', v_schema, v_name, SQLERRM
                USING HINT = 'remove the table from its queue and add it again with a new --where';
        END;
    END IF;
    PERFORM replicator.generate_capture(p_table_id);
    PERFORM replicator.insert_schema_event(p_table_id, replicator.schema_event_data(p_table_id, p_tag, p_sql, 'altered'));
    RETURN true;
END;
$$;

CREATE OR REPLACE FUNCTION replicator.follow_new_tables(p_tag text, p_sql text)
RETURNS integer
LANGUAGE plpgsql AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.follow_new_tables(p_tag, p_sql)
--
--      Captures the tables of followed schemas that are not captured yet
--      (created since), queueing an S event of kind 'created' for each.
--      Rows a CREATE TABLE AS put in before capture began reach consumers
--      through their initial copy of the new table.
--
-- Returns:
--      the number of tables now captured
-- ----------------------------------------------------------------------
DECLARE
    r record;
    v_id integer;
    v_count integer := 0;
BEGIN
    FOR r IN
        SELECT q.queue_name, s.schema_name, s.schema_mode, c.oid, c.relname
        FROM replicator.captured_schema s
        JOIN replicator.queue q ON q.queue_id = s.queue_id
        JOIN pg_namespace n ON n.nspname = s.schema_name
        JOIN pg_class c ON c.relnamespace = n.oid AND c.relkind IN ('r', 'p') AND NOT c.relispartition
        WHERE NOT EXISTS (SELECT 1 FROM replicator.captured_table t
                          WHERE t.queue_id = s.queue_id AND t.table_oid = c.oid)
        ORDER BY c.oid
    LOOP
        IF cardinality(replicator.comparable_columns(r.oid)) = 0 THEN
            RAISE WARNING 'replicator: %.% has no column usable as a key and is not captured', r.schema_name, r.relname;
            CONTINUE;
        END IF;
        -- A keyless table is captured whole (full mode): rows without a reliable key
        -- cannot be read back. A table that cannot be captured must not fail the DDL.
        BEGIN
            v_id := replicator.add_table(
                r.queue_name, format('%I.%I', r.schema_name, r.relname),
                CASE WHEN EXISTS (SELECT 1 FROM pg_index WHERE indrelid = r.oid AND indisprimary)
                     THEN r.schema_mode ELSE 'full' END,
                NULL, '{}', NULL, true);
        EXCEPTION WHEN raise_exception THEN
            RAISE WARNING 'replicator: %.% is not captured: %', r.schema_name, r.relname, SQLERRM;
            CONTINUE;
        END;
        PERFORM replicator.insert_schema_event(v_id, replicator.schema_event_data(v_id, p_tag, p_sql, 'created'));
        v_count := v_count + 1;
    END LOOP;
    RETURN v_count;
END;
$$;

CREATE OR REPLACE FUNCTION replicator.follow_schema(p_queue_name text, p_schema text, p_mode text DEFAULT 'full')
RETURNS integer
LANGUAGE plpgsql AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.follow_schema(p_queue_name, p_schema, p_mode)
--
--      Captures every table of a schema into a queue, now and as they are
--      created (by the DDL event trigger, or by replicator execute).
--
-- Returns:
--      the number of tables captured by this call
-- ----------------------------------------------------------------------
DECLARE
    q replicator.queue := replicator.find_queue(p_queue_name);
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = p_schema) THEN
        RAISE EXCEPTION 'schema % does not exist', p_schema;
    END IF;
    IF p_schema = 'replicator' THEN
        RAISE EXCEPTION 'schema replicator cannot be captured';
    END IF;
    INSERT INTO replicator.captured_schema (queue_id, schema_name, schema_mode)
    VALUES (q.queue_id, p_schema, p_mode)
    ON CONFLICT (queue_id, schema_name) DO UPDATE SET schema_mode = excluded.schema_mode;
    RETURN replicator.follow_new_tables('FOLLOW SCHEMA', NULL);
END;
$$;

CREATE OR REPLACE FUNCTION replicator.sync_partitions(p_table_id integer, p_tag text, p_sql text)
RETURNS boolean
LANGUAGE plpgsql AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.sync_partitions(p_table_id, p_tag, p_sql)
--
--      After DDL, for a captured partitioned table: when its partitions are
--      no longer the tables that carry its capture triggers (a partition
--      created, attached or detached), generates its capture again. A
--      partition attached or detached with rows moved them into or out of
--      the table without a row trigger firing: an S event (kind 'altered',
--      "copy": true) then makes targets copy the table again.
--
-- Returns:
--      true if the capture was generated again
-- ----------------------------------------------------------------------
DECLARE
    v_oid oid;
    v_tree oid[];
    v_triggered oid[];
    v_moved oid;
    v_rows boolean := false;
BEGIN
    SELECT t.table_oid INTO v_oid FROM replicator.captured_table t
    JOIN pg_class c ON c.oid = t.table_oid AND c.relkind = 'p'
    WHERE t.table_id = p_table_id;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    v_tree := ARRAY(SELECT relid FROM pg_partition_tree(v_oid) ORDER BY relid);
    v_triggered := ARRAY(SELECT tgrelid FROM pg_trigger
                         WHERE tgname = '_replicator_' || p_table_id || '_ins'
                           AND tgfoid = to_regprocedure(replicator.capture_function(p_table_id) || '()')
                         ORDER BY tgrelid);
    IF v_tree = v_triggered THEN
        RETURN false;
    END IF;
    FOR v_moved IN SELECT x FROM unnest(v_tree) x WHERE x <> ALL (v_triggered)
                   UNION ALL SELECT x FROM unnest(v_triggered) x WHERE x <> ALL (v_tree) LOOP
        IF (SELECT relkind FROM pg_class WHERE oid = v_moved) = 'r' AND NOT v_rows THEN
            EXECUTE format('SELECT EXISTS (SELECT 1 FROM %s)', v_moved::regclass) INTO v_rows;
        END IF;
    END LOOP;
    PERFORM replicator.generate_capture(p_table_id);
    IF v_rows THEN
        PERFORM replicator.insert_schema_event(p_table_id,
            replicator.schema_event_data(p_table_id, p_tag, p_sql, 'altered') || '{"copy": true}');
    END IF;
    RETURN true;
END;
$$;

CREATE OR REPLACE FUNCTION replicator.sync_all(p_tag text, p_sql text)
RETURNS integer
LANGUAGE plpgsql AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.sync_all(p_tag, p_sql)
--
--      After a statement run by `replicator execute` (where no event
--      trigger does it): forgets dropped captured tables, syncs the others
--      (and their partitions), captures new tables of followed schemas.
--
-- Returns:
--      the number of S events queued
-- ----------------------------------------------------------------------
DECLARE
    v_id integer;
    v_count integer := 0;
BEGIN
    FOR v_id IN SELECT table_id FROM replicator.captured_table ORDER BY table_id LOOP
        IF replicator.sync_table(v_id, p_tag, p_sql) THEN
            v_count := v_count + 1;
        END IF;
        PERFORM replicator.sync_partitions(v_id, p_tag, p_sql);
    END LOOP;
    RETURN v_count + replicator.follow_new_tables(p_tag, p_sql);
END;
$$;

CREATE OR REPLACE FUNCTION replicator.ddl_command_end_trigger()
RETURNS event_trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.ddl_command_end_trigger()
--
--      Event trigger at ddl_command_end: syncs the captured tables the
--      command touched (directly, or through one of their indexes), the
--      partitions of captured partitioned tables, and captures tables
--      created in followed schemas. Runs in the DDL's own
--      transaction, so the S events commit or roll back with it. The DDL
--      replicator itself runs (capture functions, triggers) is skipped.
-- ----------------------------------------------------------------------
DECLARE
    v_id integer;
    v_sql text := current_query();
BEGIN
    IF current_setting('replicator.in_ddl', true) = 'on' THEN
        RETURN;
    END IF;
    PERFORM set_config('replicator.in_ddl', 'on', true);
    FOR v_id IN
        SELECT DISTINCT t.table_id
        FROM pg_event_trigger_ddl_commands() cmd
        JOIN pg_class c ON cmd.classid = 'pg_class'::regclass AND c.oid = cmd.objid
        LEFT JOIN pg_index i ON i.indexrelid = c.oid
        JOIN replicator.captured_table t ON t.table_oid = coalesce(i.indrelid, c.oid)
        ORDER BY t.table_id
    LOOP
        PERFORM replicator.sync_table(v_id, tg_tag, v_sql);
    END LOOP;
    -- captured partitioned tables the command gave or took a partition
    FOR v_id IN
        SELECT DISTINCT t.table_id
        FROM pg_event_trigger_ddl_commands() cmd
        JOIN pg_class c ON cmd.classid = 'pg_class'::regclass AND c.oid = cmd.objid AND c.relkind IN ('r', 'p')
        CROSS JOIN LATERAL pg_partition_ancestors(c.oid) a
        JOIN replicator.captured_table t ON t.table_oid = a.relid
        ORDER BY t.table_id
    LOOP
        PERFORM replicator.sync_partitions(v_id, tg_tag, v_sql);
    END LOOP;
    IF tg_tag IN ('CREATE TABLE', 'CREATE TABLE AS', 'SELECT INTO', 'ALTER TABLE') THEN
        PERFORM replicator.follow_new_tables(tg_tag, v_sql);
    END IF;
    PERFORM set_config('replicator.in_ddl', 'off', true);
END;
$$;

CREATE OR REPLACE FUNCTION replicator.sql_drop_trigger()
RETURNS event_trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.sql_drop_trigger()
--
--      Event trigger at sql_drop: a dropped captured table is announced
--      (S event of kind 'dropped') and no longer captured.
-- ----------------------------------------------------------------------
DECLARE
    v_id integer;
BEGIN
    IF current_setting('replicator.in_ddl', true) = 'on' THEN
        RETURN;
    END IF;
    PERFORM set_config('replicator.in_ddl', 'on', true);
    FOR v_id IN
        SELECT t.table_id
        FROM pg_event_trigger_dropped_objects() d
        JOIN replicator.captured_table t ON t.table_oid = d.objid
        WHERE d.classid = 'pg_class'::regclass AND d.objsubid = 0
        ORDER BY t.table_id
    LOOP
        PERFORM replicator.forget_table(v_id, tg_tag, current_query());
    END LOOP;
    PERFORM set_config('replicator.in_ddl', 'off', true);
END;
$$;

CREATE OR REPLACE FUNCTION replicator.create_event_triggers()
RETURNS void
LANGUAGE plpgsql AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.create_event_triggers()
--
--      Creates the DDL event triggers (needs superuser). Idempotent.
-- ----------------------------------------------------------------------
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_event_trigger WHERE evtname = 'replicator_ddl_command_end') THEN
        CREATE EVENT TRIGGER replicator_ddl_command_end ON ddl_command_end
            EXECUTE PROCEDURE replicator.ddl_command_end_trigger();
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_event_trigger WHERE evtname = 'replicator_sql_drop') THEN
        CREATE EVENT TRIGGER replicator_sql_drop ON sql_drop
            EXECUTE PROCEDURE replicator.sql_drop_trigger();
    END IF;
END;
$$;
