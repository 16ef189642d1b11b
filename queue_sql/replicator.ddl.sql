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
--      column names, attnums, types and nullability, key. Nullability
--      counts: a target relies on NOT NULL key columns (the SQLite target's
--      INSERT OR REPLACE; NULLs never conflict). A change of default alone
--      is not announced: it changes no stored value.
--
-- Parameters:
--      p_structure - a replicator.table_structure() result
--
-- Returns:
--      the structure reduced to what is compared
-- ----------------------------------------------------------------------
    SELECT jsonb_build_object(
        'schema', p_structure->'schema', 'name', p_structure->'name', 'key', p_structure->'key',
        'columns', (SELECT jsonb_agg(jsonb_build_object('name', c->'name', 'attnum', c->'attnum',
                                                        'type', c->'type', 'not_null', c->'not_null')
                                     ORDER BY (c->>'attnum')::int)
                    FROM jsonb_array_elements(p_structure->'columns') c));
$$;

CREATE OR REPLACE FUNCTION replicator.schema_event_data(t replicator.captured_table, p_tag text, p_sql text,
                                                         p_kind text)
RETURNS jsonb
LANGUAGE sql IMMUTABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.schema_event_data(t, p_tag, p_sql, p_kind)
--
--      The data of an S event: what ran (command tag, statement text),
--      what happened to the table (p_kind: 'created', 'altered'), and the
--      resulting structure with the captured columns in event value order.
--
-- Parameters:
--      t           - the captured table's record, as the event describes it
-- ----------------------------------------------------------------------
    SELECT jsonb_build_object(
        'kind', p_kind, 'tag', p_tag, 'sql', p_sql,
        'schema', t.table_schema, 'name', t.table_name, 'mode', t.table_mode,
        'key', to_jsonb(t.table_key),
        'columns', to_jsonb(ARRAY(SELECT c FROM unnest(t.table_columns) c WHERE c <> ALL (t.table_ignore))),
        'structure', t.table_structure);
$$;

CREATE OR REPLACE FUNCTION replicator.schema_event_data(p_table_id integer, p_tag text, p_sql text, p_kind text)
RETURNS jsonb
LANGUAGE sql STABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.schema_event_data(p_table_id, p_tag, p_sql, p_kind)
--
--      The data of an S event for a captured table as recorded.
-- ----------------------------------------------------------------------
    SELECT replicator.schema_event_data(t, p_tag, p_sql, p_kind)
    FROM replicator.captured_table t WHERE t.table_id = p_table_id;
$$;

CREATE OR REPLACE FUNCTION replicator.queue_copy_event(p_table_id integer, p_tag text, p_sql text)
RETURNS bigint
LANGUAGE sql AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.queue_copy_event(p_table_id, p_tag, p_sql)
--
--      Queues an S event of kind 'altered' with "copy": true for a
--      captured table: its rows changed without a row trigger firing (a
--      rewrite, a descendant attached, detached, dropped or truncated, a
--      capture that did not cover a descendant before an upgrade), so
--      targets copy the table again, within the snapshot rules of the
--      initial copy.
--
-- Parameters:
--      p_table_id  - replicator.captured_table id
--      p_tag       - command tag of the statement that changed the rows
--      p_sql       - its text (NULL when there is none)
--
-- Returns:
--      the event id
-- ----------------------------------------------------------------------
    SELECT replicator.insert_schema_event(p_table_id,
        replicator.schema_event_data(p_table_id, p_tag, p_sql, 'altered') || '{"copy": true}');
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

CREATE OR REPLACE FUNCTION replicator.table_record_now(p_table_id integer)
RETURNS replicator.captured_table
LANGUAGE plpgsql AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.table_record_now(p_table_id)
--
--      What a captured table's record becomes after DDL, read from the
--      catalog and written nowhere: names, columns, key (followed through
--      renames by attnum; a new primary key replaces a primary or automatic
--      key), ignored columns and structure. A change that would leave the
--      table without a usable key raises with the way out.
--
-- Parameters:
--      p_table_id  - replicator.captured_table id
--
-- Returns:
--      the record as it would be now; NULL when the table is gone
-- ----------------------------------------------------------------------
DECLARE
    t replicator.captured_table;
    v_schema text;
    v_name text;
    v_columns text[];
    v_pk text[];
    v_key text[];
    v_ignore text[];
    v_missing text;
    v_way_out text;
BEGIN
    SELECT * INTO t FROM replicator.captured_table WHERE table_id = p_table_id;
    SELECT n.nspname, c.relname INTO v_schema, v_name
    FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = t.table_oid;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    v_way_out := format('remove the table from its queue first: replicator table remove %s %I.%I',
                        (SELECT queue_name FROM replicator.queue q WHERE q.queue_id = t.queue_id), v_schema, v_name);

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
            USING HINT = v_way_out;
    END IF;
    IF t.table_mode = 'pk' AND cardinality(replicator.nullable_key_columns(t.table_oid, v_key)) > 0 THEN
        -- rows are read back by their key, and a NULL never equals: they would vanish from targets
        RAISE EXCEPTION 'table %.% is captured in pk mode with key (%), whose columns must stay NOT NULL',
            v_schema, v_name, array_to_string(v_key, ', ')
            USING HINT = v_way_out;
    END IF;
    IF EXISTS (SELECT 1 FROM unnest(v_key) k WHERE k <> ALL (replicator.comparable_columns(t.table_oid))) THEN
        -- the capture compares keys (EXCEPT): a key column's new type must have equality
        RAISE EXCEPTION 'table %.% is captured with key (%), a column of which now has a type without equality',
            v_schema, v_name, array_to_string(v_key, ', ')
            USING HINT = v_way_out;
    END IF;
    t.table_schema := v_schema;
    t.table_name := v_name;
    t.table_columns := v_columns;
    t.table_key := v_key;
    t.table_ignore := v_ignore;
    t.table_structure := replicator.table_structure(t.table_oid, v_key);
    RETURN t;
END;
$$;

CREATE OR REPLACE FUNCTION replicator.store_table_record(t replicator.captured_table)
RETURNS void
LANGUAGE sql AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.store_table_record(t)
--
--      Records what replicator.table_record_now() found: names, columns,
--      key, ignored columns, structure. The capture function is generated
--      again by the caller.
-- ----------------------------------------------------------------------
    UPDATE replicator.captured_table SET
        table_schema = t.table_schema, table_name = t.table_name, table_columns = t.table_columns,
        table_key = t.table_key, table_ignore = t.table_ignore, key_is_pk = t.key_is_pk,
        key_is_auto = t.key_is_auto, table_structure = t.table_structure
    WHERE table_id = t.table_id;
$$;

CREATE OR REPLACE FUNCTION replicator.sync_table(p_table_id integer, p_tag text, p_sql text,
                                                 p_rewritten boolean DEFAULT false)
RETURNS boolean
LANGUAGE plpgsql AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.sync_table(p_table_id, p_tag, p_sql, p_rewritten)
--
--      Brings a captured table's record up to date with the catalog after
--      DDL (replicator.table_record_now). When anything targets depend on
--      changed, or the statement rewrote the table's rows, regenerates the
--      capture function and queues an S event. A change that would leave
--      the table without a usable key aborts the DDL with the way out.
--
-- Parameters:
--      p_table_id  - replicator.captured_table id
--      p_tag       - command tag of the statement
--      p_sql       - its text
--      p_rewritten - the statement rewrote the table's rows without row
--                    triggers (ALTER COLUMN ... TYPE ... USING, even to the
--                    same type; a volatile default): the S event carries
--                    "copy": true and targets copy the table again
--
-- Returns:
--      true if an S event was queued
-- ----------------------------------------------------------------------
DECLARE
    t replicator.captured_table;
    v_now replicator.captured_table := replicator.table_record_now(p_table_id);
BEGIN
    IF v_now IS NULL THEN
        PERFORM replicator.forget_table(p_table_id, p_tag, p_sql);
        RETURN true;
    END IF;
    SELECT * INTO t FROM replicator.captured_table WHERE table_id = p_table_id;
    IF replicator.structure_signature(v_now.table_structure) = replicator.structure_signature(t.table_structure)
       AND t.table_columns = v_now.table_columns AND NOT p_rewritten THEN
        RETURN false;
    END IF;
    PERFORM replicator.store_table_record(v_now);
    PERFORM replicator.generate_capture(p_table_id);
    IF p_rewritten THEN
        PERFORM replicator.queue_copy_event(p_table_id, p_tag, p_sql);
    ELSE
        PERFORM replicator.insert_schema_event(p_table_id,
            replicator.schema_event_data(p_table_id, p_tag, p_sql, 'altered'));
    END IF;
    RETURN true;
END;
$$;

CREATE OR REPLACE FUNCTION replicator.row_filter_scope(p_tag text)
RETURNS text
LANGUAGE sql IMMUTABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.row_filter_scope(p_tag)
--
--      Which row filters a command may break (replicator.check_row_filters).
--      A filter names its table's columns and may name functions,
--      operators, types, collations (schema-qualified) and, in a subquery,
--      other relations.
--
-- Parameters:
--      p_tag       - the command tag
--
-- Returns:
--      'touched'   - commands that change no object a filter of another
--                    table can name (CREATE TABLE, CREATE INDEX, GRANT,
--                    COMMENT, triggers, policies, ...; INSERT, UPDATE,
--                    DELETE): the filters of the tables they touched;
--      'relations' - ALTER or DROP of a table, view or sequence: those,
--                    and the filters that read other relations;
--      'all'       - anything else (functions, operators, types, domains,
--                    schemas, extensions, casts, DROP OWNED; under
--                    `replicator execute` DO, CALL, SELECT and EXECUTE,
--                    which may run any DDL; an unknown tag): every filter
-- ----------------------------------------------------------------------
    SELECT CASE
        WHEN p_tag ~ '^(ALTER|DROP) (TABLE|VIEW|MATERIALIZED VIEW|FOREIGN TABLE|SEQUENCE)$' THEN 'relations'
        WHEN p_tag ~ '^(CREATE|ALTER|DROP) (INDEX|TRIGGER|RULE|POLICY|STATISTICS|PUBLICATION|SUBSCRIPTION'
                     '|EVENT TRIGGER|SERVER|USER MAPPING|FOREIGN DATA WRAPPER)$'
          OR p_tag ~ '^CREATE (TABLE|TABLE AS|FOREIGN TABLE|VIEW|MATERIALIZED VIEW|SEQUENCE|SCHEMA|TYPE|DOMAIN)$'
          OR p_tag IN ('SELECT INTO', 'COMMENT', 'GRANT', 'REVOKE', 'SECURITY LABEL', 'ALTER DEFAULT PRIVILEGES',
                       'REFRESH MATERIALIZED VIEW', 'REINDEX', 'IMPORT FOREIGN SCHEMA', 'CLUSTER', 'VACUUM',
                       'ANALYZE', 'TRUNCATE TABLE', 'LOCK TABLE', 'INSERT', 'UPDATE', 'DELETE', 'MERGE',
                       'COPY', 'VALUES', 'TABLE', 'PREPARE', 'DEALLOCATE', 'SET', 'RESET', 'SHOW', 'NOTIFY',
                       'LISTEN', 'UNLISTEN')
            THEN 'touched'
        ELSE 'all'
    END;
$$;

CREATE OR REPLACE FUNCTION replicator.check_row_filters(p_touched oid[], p_scope text)
RETURNS void
LANGUAGE plpgsql AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.check_row_filters(p_touched, p_scope)
--
--      After DDL (event trigger, or replicator.sync_all): checks the row
--      filters the command may have broken as add_table checks them, as
--      the capture function runs them (replicator.row_filter_error). A
--      statement that broke one (a column dropped, renamed or given a type
--      whose operators lie outside pg_catalog; a function it names dropped)
--      is refused, rolled back with the way out, instead of making every
--      later application write to the table fail.
--
--      A check plans a query over the filtered table, taking an ACCESS
--      SHARE lock on it: only the filters the command can reach are
--      checked (replicator.row_filter_scope), so a DDL elsewhere (CREATE
--      TEMP TABLE, CREATE INDEX, GRANT...) never waits behind a lock on a
--      filtered table, nor deadlocks with another DDL over it.
--
-- Parameters:
--      p_touched   - relations the command touched (their filters are
--                    checked whatever the scope)
--      p_scope     - replicator.row_filter_scope of the command: 'touched',
--                    'relations' (also filters reading other relations:
--                    the words SELECT, TABLE or regclass), 'all'
-- ----------------------------------------------------------------------
DECLARE
    r record;
    v_error text;
BEGIN
    FOR r IN
        SELECT t.table_oid, t.table_where, n.nspname, c.relname, q.queue_name
        FROM replicator.captured_table t
        JOIN pg_class c ON c.oid = t.table_oid
        JOIN pg_namespace n ON n.oid = c.relnamespace
        JOIN replicator.queue q ON q.queue_id = t.queue_id
        WHERE t.table_where IS NOT NULL
          AND (p_scope = 'all' OR t.table_oid = ANY (p_touched)
               OR (p_scope = 'relations' AND t.table_where ~* '\m(select|table|regclass)\M'))
        ORDER BY t.table_id
    LOOP
        v_error := replicator.row_filter_error(r.table_oid, r.table_where);
        IF v_error IS NOT NULL THEN
            RAISE EXCEPTION 'this statement breaks the row filter of %.% (%): remove the table from its queue (replicator table remove % %) and add it again with a new --where',
                r.nspname, r.relname, v_error, r.queue_name, format('%I.%I', r.nspname, r.relname)
                USING HINT = 'remove the table from its queue and add it again with a new --where';
        END IF;
    END LOOP;
END;
$$;

CREATE OR REPLACE FUNCTION replicator.warned(p_relation oid)
RETURNS boolean
LANGUAGE sql STABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.warned(p_relation)
--
--      Whether replicator.warn_once has warned about the relation in this
--      transaction (setting replicator.warned): under `replicator
--      execute`, later statements of a script skip the work that would
--      only lead to the same warning.
--
-- Parameters:
--      p_relation  - the relation
--
-- Returns:
--      true if a warning about it was raised in this transaction
-- ----------------------------------------------------------------------
    SELECT coalesce(p_relation::text = ANY (string_to_array(current_setting('replicator.warned', true), ',')),
                    false);
$$;

CREATE OR REPLACE FUNCTION replicator.warn_once(p_relation oid, p_message text)
RETURNS void
LANGUAGE plpgsql AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.warn_once(p_relation, p_message)
--
--      Raises p_message as a WARNING, unless one was raised about the
--      relation before in this transaction (under `replicator execute`,
--      every statement of a script looks at the relations it touched so
--      far).
--
-- Parameters:
--      p_relation  - the relation the warning is about
--      p_message   - the warning
-- ----------------------------------------------------------------------
BEGIN
    IF replicator.warned(p_relation) THEN
        RETURN;
    END IF;
    RAISE WARNING '%', p_message;
    PERFORM set_config('replicator.warned',
                       concat_ws(',', nullif(current_setting('replicator.warned', true), ''), p_relation::text), true);
END;
$$;

CREATE OR REPLACE FUNCTION replicator.follow_new_tables(p_tag text, p_sql text, p_new oid[] DEFAULT '{}',
                                                        p_queue_id integer DEFAULT NULL)
RETURNS integer
LANGUAGE plpgsql AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.follow_new_tables(p_tag, p_sql, p_new, p_queue_id)
--
--      Captures the tables of followed schemas that are not captured yet
--      (created since), queueing an S event of kind 'created' for each.
--      Rows a CREATE TABLE AS put in before capture began reach consumers
--      through their initial copy of the new table.
--
--      Partitions and inheritance children are not looked at: their rows
--      are their root's (replicator.capture_tree), captured with it when
--      the queue captures the root; when it does not, a child cannot be
--      captured on its own (replicator.check_capture_tree). Such a child
--      among p_new gets a warning saying why, once: it is never retried.
--
-- Parameters:
--      p_tag       - command tag of the statement
--      p_sql       - its text
--      p_new       - relations the statement created or touched (or, for
--                    replicator.follow_schema, the schema's tables): a
--                    table among them that the queue cannot capture is
--                    warned about; others are retried silently
--      p_queue_id  - only this queue's followed schemas (NULL: every queue's)
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
        SELECT q.queue_name, s.schema_name, s.schema_mode, c.oid, c.relname,
               EXISTS (SELECT 1 FROM pg_index WHERE indrelid = c.oid AND indisprimary) AS has_primary_key
        FROM replicator.captured_schema s
        JOIN replicator.queue q ON q.queue_id = s.queue_id
        JOIN pg_namespace n ON n.nspname = s.schema_name
        JOIN pg_class c ON c.relnamespace = n.oid AND c.relkind IN ('r', 'p') AND NOT c.relispartition
        WHERE NOT EXISTS (SELECT 1 FROM replicator.captured_table t
                          WHERE t.queue_id = s.queue_id AND t.table_oid = c.oid)
          AND NOT EXISTS (SELECT 1 FROM pg_inherits h WHERE h.inhrelid = c.oid)
          AND (p_queue_id IS NULL OR s.queue_id = p_queue_id)
        ORDER BY c.oid
    LOOP
        -- Tables refused are tried again at every DDL (one may have gained a column),
        -- but warned about only by the statement that made or touched them.
        IF cardinality(replicator.comparable_columns(r.oid)) = 0 THEN
            IF r.oid = ANY (p_new) THEN
                PERFORM replicator.warn_once(r.oid, format(
                    'replicator: %s.%s has no column usable as a key and is not captured', r.schema_name, r.relname));
            END IF;
            CONTINUE;
        END IF;
        -- A keyless table is captured whole (full mode): rows without a reliable key
        -- cannot be read back. A table that cannot be captured (refused; another role's,
        -- whose triggers the owner may not make; locked past the ticker's lock_timeout)
        -- must not fail the DDL, nor the tick.
        BEGIN
            v_id := replicator.add_table(
                r.queue_name, format('%I.%I', r.schema_name, r.relname),
                CASE WHEN r.has_primary_key THEN r.schema_mode ELSE 'full' END,
                NULL, '{}', NULL, true);
        EXCEPTION WHEN OTHERS THEN
            IF r.oid = ANY (p_new) THEN
                PERFORM replicator.warn_once(r.oid, format('replicator: %s.%s is not captured: %s',
                                                           r.schema_name, r.relname, SQLERRM));
            END IF;
            CONTINUE;
        END;
        PERFORM replicator.insert_schema_event(v_id, replicator.schema_event_data(v_id, p_tag, p_sql, 'created'));
        IF NOT r.has_primary_key THEN
            PERFORM replicator.warn_once(r.oid, format(
                'replicator: %s.%s has no primary key: captured with every comparable column as its key,'
                ' so identical rows are one row on targets (add a primary key to keep them apart)',
                r.schema_name, r.relname));
        END IF;
        v_count := v_count + 1;
    END LOOP;
    -- after the tables just captured: a child of one of them is captured with it.
    FOR r IN
        SELECT q.queue_name, s.schema_name, c.oid, c.relname
        FROM replicator.captured_schema s
        JOIN replicator.queue q ON q.queue_id = s.queue_id
        JOIN pg_namespace n ON n.nspname = s.schema_name
        JOIN pg_class c ON c.relnamespace = n.oid AND c.relkind IN ('r', 'p') AND NOT c.relispartition
        WHERE c.oid = ANY (p_new)
          AND EXISTS (SELECT 1 FROM pg_inherits h WHERE h.inhrelid = c.oid)
          AND NOT EXISTS (SELECT 1 FROM replicator.captured_table t
                          WHERE t.queue_id = s.queue_id
                            AND t.table_oid IN (SELECT replicator.capture_ancestors(c.oid)))
          AND NOT replicator.warned(c.oid)
        ORDER BY c.oid
    LOOP
        BEGIN
            PERFORM replicator.check_capture_tree(r.oid::regclass, '{}', r.queue_name);
        EXCEPTION WHEN raise_exception THEN
            PERFORM replicator.warn_once(r.oid, format('replicator: %s.%s is not captured: %s',
                                                       r.schema_name, r.relname, SQLERRM));
        END;
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
    RETURN replicator.follow_new_tables('FOLLOW SCHEMA', NULL,
                                        ARRAY(SELECT c.oid FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                                              WHERE n.nspname = p_schema));
END;
$$;

CREATE OR REPLACE FUNCTION replicator.unfollow_schema(p_queue_name text, p_schema text)
RETURNS void
LANGUAGE plpgsql AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.unfollow_schema(p_queue_name, p_schema)
--
--      Stops following a schema: tables created in it later are not
--      captured. Its tables captured so far stay captured (remove_table
--      them one by one).
--
-- Parameters:
--      p_queue_name    - the queue
--      p_schema        - a schema the queue follows
-- ----------------------------------------------------------------------
DECLARE
    q replicator.queue := replicator.find_queue(p_queue_name);
BEGIN
    DELETE FROM replicator.captured_schema WHERE queue_id = q.queue_id AND schema_name = p_schema;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'queue "%" does not follow schema %', p_queue_name, p_schema;
    END IF;
END;
$$;

CREATE OR REPLACE FUNCTION replicator.sync_partitions(p_table_id integer, p_tag text, p_sql text,
                                                       p_check boolean DEFAULT true)
RETURNS boolean
LANGUAGE plpgsql AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.sync_partitions(p_table_id, p_tag, p_sql, p_check)
--
--      After DDL, for a captured table: checks its capture tree
--      (replicator.check_capture_tree: the exception rolls the DDL back),
--      and when its descendants (replicator.capture_tree) are no longer
--      the tables that carry its capture triggers (a partition created,
--      attached or detached; an inheritance child created, INHERIT, NO
--      INHERIT), generates its capture again. A table that joined or left
--      the tree with rows moved them into or out of the table without a
--      row trigger firing: an S event (kind 'altered', "copy": true) then
--      makes targets copy the table again.
--
-- Parameters:
--      p_table_id  - replicator.captured_table id
--      p_tag       - command tag of the statement
--      p_sql       - its text
--      p_check     - check the tree even if its members did not change
--                    (the statement touched it: DROP NOT NULL on a
--                    descendant's key column changes no member); false:
--                    only a tree whose members changed is checked
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
    v_key text[];
    v_queue text;
BEGIN
    SELECT t.table_oid, t.table_key, q.queue_name INTO v_oid, v_key, v_queue
    FROM replicator.captured_table t
    JOIN pg_class c ON c.oid = t.table_oid
    JOIN replicator.queue q ON q.queue_id = t.queue_id
    WHERE t.table_id = p_table_id;
    IF NOT FOUND THEN
        RETURN false;   -- dropped
    END IF;
    IF p_check THEN
        PERFORM replicator.check_capture_tree(v_oid, v_key, v_queue, p_table_id);
    END IF;
    v_tree := ARRAY(SELECT d FROM replicator.capture_tree(v_oid) d ORDER BY d);
    v_triggered := ARRAY(SELECT tgrelid FROM pg_trigger
                         WHERE tgname = '_replicator_' || p_table_id || '_ins'
                           AND tgfoid = to_regprocedure(replicator.capture_function(p_table_id) || '()')
                         ORDER BY tgrelid);
    IF v_tree = v_triggered THEN
        RETURN false;
    END IF;
    IF NOT p_check THEN
        PERFORM replicator.check_capture_tree(v_oid, v_key, v_queue, p_table_id);
    END IF;
    FOR v_moved IN SELECT x FROM unnest(v_tree) x WHERE x <> ALL (v_triggered)
                   UNION ALL SELECT x FROM unnest(v_triggered) x WHERE x <> ALL (v_tree) LOOP
        -- (a dropped one is gone from both: replicator.sql_drop_trigger asks for the copy)
        IF (SELECT relkind FROM pg_class WHERE oid = v_moved) = 'r' AND NOT v_rows THEN
            EXECUTE format('SELECT EXISTS (SELECT 1 FROM %s)', v_moved::regclass) INTO v_rows;
        END IF;
    END LOOP;
    PERFORM replicator.generate_capture(p_table_id);
    IF v_rows THEN
        PERFORM replicator.queue_copy_event(p_table_id, p_tag, p_sql);
    END IF;
    RETURN true;
END;
$$;

CREATE OR REPLACE FUNCTION replicator.table_rewrite_trigger()
RETURNS event_trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.table_rewrite_trigger()
--
--      Event trigger at table_rewrite: notes the table an ALTER TABLE is
--      about to rewrite when its values may change (a column's type
--      conversion, even to the same type with USING; a volatile default),
--      not when only the storage does (SET LOGGED/UNLOGGED, SET ACCESS
--      METHOD). No row trigger sees the new values: the ddl_command_end
--      trigger that follows takes the note (replicator.take_rewrites) and
--      asks targets to copy the table again. The note lives in a
--      transaction-local setting, so it rolls back with the DDL.
-- ----------------------------------------------------------------------
BEGIN
    -- reason bits (AT_REWRITE_*): 2 a default value, 4 a column rewrite
    IF pg_event_trigger_table_rewrite_reason() & 6 <> 0 THEN
        PERFORM set_config('replicator.rewritten',
                           concat_ws(',', nullif(current_setting('replicator.rewritten', true), ''),
                                     pg_event_trigger_table_rewrite_oid()::text), true);
    END IF;
END;
$$;

CREATE OR REPLACE FUNCTION replicator.take_rewrites()
RETURNS oid[]
LANGUAGE plpgsql AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.take_rewrites()
--
--      The tables replicator.table_rewrite_trigger noted since the last
--      call, and forgets them.
--
-- Returns:
--      their oids, '{}' if none
-- ----------------------------------------------------------------------
DECLARE
    v_oids oid[] := string_to_array(nullif(current_setting('replicator.rewritten', true), ''), ',')::oid[];
BEGIN
    PERFORM set_config('replicator.rewritten', '', true);
    RETURN coalesce(v_oids, '{}');
END;
$$;

CREATE OR REPLACE FUNCTION replicator.rewritten_tables(p_oids oid[])
RETURNS integer[]
LANGUAGE sql STABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.rewritten_tables(p_oids)
--
--      The captured tables whose rows are in the given relations: the
--      relations themselves, or the captured tables whose capture trees
--      they belong to (a rewrite of a partitioned table or inheritance
--      parent rewrites its descendants).
--
-- Parameters:
--      p_oids      - relations whose rows were rewritten
--
-- Returns:
--      replicator.captured_table ids
-- ----------------------------------------------------------------------
    SELECT coalesce(array_agg(DISTINCT t.table_id), '{}')
    FROM unnest(p_oids) r(oid)
    CROSS JOIN LATERAL replicator.capture_ancestors(r.oid) a(relid)
    JOIN replicator.captured_table t ON t.table_oid = a.relid;
$$;

CREATE OR REPLACE FUNCTION replicator.captured_storage()
RETURNS TABLE (relid oid, relfilenode oid, table_oid oid)
LANGUAGE sql STABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.captured_storage()
--
--      Where the rows of captured tables (and of their descendants,
--      replicator.capture_tree) are stored. `replicator execute` compares
--      it before and after each statement: a relation whose relfilenode
--      changed was rewritten (an ALTER TABLE ... TYPE ... USING, even to
--      the same type), or truncated; one that vanished was dropped, and
--      took its rows out of the captured table.
--
-- Returns:
--      one row per relation holding rows of a captured table, with the
--      oid of that captured table
-- ----------------------------------------------------------------------
    SELECT DISTINCT c.oid, c.relfilenode, t.table_oid
    FROM replicator.captured_table t
    CROSS JOIN LATERAL replicator.capture_tree(t.table_oid) p(relid)
    JOIN pg_class c ON c.oid = p.relid
    WHERE c.relkind = 'r';
$$;

CREATE OR REPLACE FUNCTION replicator.touched_capture_trees(p_rels oid[])
RETURNS integer[]
LANGUAGE sql STABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.touched_capture_trees(p_rels)
--
--      The captured tables whose capture trees a DDL on some relations may
--      have changed: the captured ones among the relations and their
--      ancestors (a partition or child created, attached, INHERIT, a column
--      of a descendant made nullable), and those whose capture triggers
--      are on the relations (DETACH, NO INHERIT: no longer descendants).
--
-- Parameters:
--      p_rels      - relations the DDL touched
--
-- Returns:
--      replicator.captured_table ids, in order
-- ----------------------------------------------------------------------
    SELECT coalesce(array_agg(id ORDER BY id), '{}') FROM (
        SELECT t.table_id
        FROM unnest(p_rels) r(oid) CROSS JOIN LATERAL replicator.capture_ancestors(r.oid) a(relid)
        JOIN replicator.captured_table t ON t.table_oid = a.relid
        UNION
        SELECT t.table_id
        FROM unnest(p_rels) r(oid) JOIN pg_trigger tg ON tg.tgrelid = r.oid
        JOIN replicator.captured_table t ON tg.tgname = '_replicator_' || t.table_id || '_ins') x(id);
$$;

CREATE OR REPLACE FUNCTION replicator.locked_relations()
RETURNS oid[]
LANGUAGE sql STABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.locked_relations()
--
--      The relations this transaction has touched with DDL so far, for
--      `replicator execute` (no event trigger reports them): those it
--      holds a lock on stronger than ROW EXCLUSIVE, the strongest a DML
--      statement takes. Every ALTER, CREATE ... PARTITION OF / INHERITS,
--      ATTACH, DETACH, INHERIT, DROP takes one on what it changes (a
--      dropped relation keeps its lock), held to the end of the
--      transaction: a relation touched by an earlier statement of the
--      script stays in the set.
--
-- Returns:
--      relation oids
-- ----------------------------------------------------------------------
    SELECT coalesce(array_agg(DISTINCT l.relation), '{}')
    FROM pg_locks l
    WHERE l.locktype = 'relation' AND l.pid = pg_backend_pid() AND l.granted
      AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
      AND l.mode IN ('ShareUpdateExclusiveLock', 'ShareLock', 'ShareRowExclusiveLock', 'ExclusiveLock',
                     'AccessExclusiveLock');
$$;

CREATE OR REPLACE FUNCTION replicator.sync_all(p_tag text, p_sql text, p_rewritten oid[] DEFAULT '{}')
RETURNS integer
LANGUAGE plpgsql AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.sync_all(p_tag, p_sql, p_rewritten)
--
--      After a statement run by `replicator execute` (where no event
--      trigger does it): forgets dropped captured tables, syncs the others
--      (and their capture trees), checks the row filters the statement
--      may have broken, captures new tables of followed schemas. What the
--      statement touched is what the script holds DDL locks on
--      (replicator.locked_relations): only those capture trees are checked
--      (and any whose members changed), so a tree the script leaves alone
--      never fails it.
--
-- Parameters:
--      p_tag       - command tag of the statement
--      p_sql       - its text
--      p_rewritten - relations whose rows the statement rewrote (their
--                    relfilenode changed, see replicator.captured_storage),
--                    and captured tables a dropped descendant left
--
-- Returns:
--      the number of S events queued
-- ----------------------------------------------------------------------
DECLARE
    v_id integer;
    v_count integer := 0;
    v_rewritten integer[] := replicator.rewritten_tables(p_rewritten);
    v_touched oid[] := replicator.locked_relations();
    v_trees integer[] := replicator.touched_capture_trees(v_touched);
BEGIN
    FOR v_id IN SELECT table_id FROM replicator.captured_table ORDER BY table_id LOOP
        -- the tree first: a regenerated capture would hide a descendant that moved
        PERFORM replicator.sync_partitions(v_id, p_tag, p_sql, v_id = ANY (v_trees));
        IF replicator.sync_table(v_id, p_tag, p_sql, v_id = ANY (v_rewritten)) THEN
            v_count := v_count + 1;
        END IF;
    END LOOP;
    PERFORM replicator.check_row_filters(v_touched, replicator.row_filter_scope(p_tag));
    RETURN v_count + replicator.follow_new_tables(p_tag, p_sql, v_touched);
END;
$$;

CREATE OR REPLACE FUNCTION replicator.ddl_command_end_trigger()
RETURNS event_trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.ddl_command_end_trigger()
--
--      Event trigger at ddl_command_end: syncs the capture trees
--      (replicator.sync_partitions) of the captured tables whose partitions
--      or inheritance descendants the command may have changed, then the
--      captured tables the command touched (directly, or through one of
--      their indexes), their captured inheritance descendants (a recursing
--      ALTER TABLE reports the table it names only; only tables captured
--      before inheritance children were refused can be such), the captured
--      tables whose rows it rewrote (noted by
--      replicator.table_rewrite_trigger), captures tables created in
--      followed schemas, and checks the row filters it may have broken
--      (replicator.check_row_filters). Runs in the DDL's own transaction, so the S
--      events commit or roll back with it. The DDL replicator itself runs
--      (capture functions, triggers) is skipped.
-- ----------------------------------------------------------------------
DECLARE
    v_id integer;
    v_sql text := current_query();
    v_rewritten integer[] := '{}';
    v_touched oid[];
    v_created oid[];
BEGIN
    IF current_setting('replicator.in_ddl', true) = 'on' THEN
        RETURN;
    END IF;
    PERFORM set_config('replicator.in_ddl', 'on', true);
    -- only when there is a note: an install drops and creates replicator's functions
    -- under this trigger
    IF current_setting('replicator.rewritten', true) <> '' THEN
        v_rewritten := replicator.rewritten_tables(replicator.take_rewrites());
    END IF;
    -- What the command touched: relations, or their indexes.
    SELECT coalesce(array_agg(DISTINCT coalesce(i.indrelid, c.oid)), '{}'),
           coalesce(array_agg(DISTINCT c.oid) FILTER (WHERE cmd.command_tag = 'CREATE TABLE'), '{}')
    INTO v_touched, v_created
    FROM pg_event_trigger_ddl_commands() cmd
    JOIN pg_class c ON cmd.classid = 'pg_class'::regclass AND c.oid = cmd.objid
    LEFT JOIN pg_index i ON i.indexrelid = c.oid;
    -- Capture trees first (a regenerated capture would hide a descendant that
    -- moved), of commands that can change a tree (CREATE ... INHERITS /
    -- PARTITION OF, ALTER): replicator.touched_capture_trees. A tree that could
    -- miss changes aborts the command.
    IF tg_tag IN ('CREATE TABLE', 'ALTER TABLE', 'CREATE FOREIGN TABLE', 'ALTER FOREIGN TABLE') THEN
        FOREACH v_id IN ARRAY replicator.touched_capture_trees(
                ARRAY(SELECT c.oid FROM pg_class c WHERE c.oid = ANY (v_touched) AND c.relkind IN ('r', 'p', 'f'))) LOOP
            PERFORM replicator.sync_partitions(v_id, tg_tag, v_sql);
        END LOOP;
    END IF;
    FOR v_id IN
        WITH RECURSIVE touched(oid) AS (
            SELECT unnest(v_touched)
            UNION
            SELECT h.inhrelid FROM touched JOIN pg_inherits h ON h.inhparent = touched.oid)
        SELECT t.table_id FROM touched JOIN replicator.captured_table t ON t.table_oid = touched.oid
        UNION
        SELECT unnest(v_rewritten)
        ORDER BY 1
    LOOP
        PERFORM replicator.sync_table(v_id, tg_tag, v_sql, v_id = ANY (v_rewritten));
    END LOOP;
    IF tg_tag IN ('CREATE TABLE', 'CREATE TABLE AS', 'SELECT INTO', 'ALTER TABLE') THEN
        PERFORM replicator.follow_new_tables(tg_tag, v_sql, v_created);
    END IF;
    PERFORM replicator.check_row_filters(v_touched, replicator.row_filter_scope(tg_tag));
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
--      (S event of kind 'dropped') and no longer captured. A dropped
--      descendant of a captured table (a partition, an inheritance child;
--      found by the capture triggers dropped with it) took its rows out of
--      the table without a row trigger firing: an S event (kind 'altered',
--      "copy": true) makes targets copy the table again.
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
    FOR v_id IN
        SELECT DISTINCT t.table_id
        FROM pg_event_trigger_dropped_objects() d
        JOIN replicator.captured_table t
          ON d.address_names[3] = '_replicator_' || t.table_id || '_ins'
        WHERE d.classid = 'pg_trigger'::regclass
          -- with its table (not a trigger dropped alone: generate_capture, remove_table)
          AND EXISTS (SELECT 1 FROM pg_event_trigger_dropped_objects() r
                      WHERE r.classid = 'pg_class'::regclass AND r.objsubid = 0
                        AND r.address_names = d.address_names[1:2])
          AND EXISTS (SELECT 1 FROM pg_class c WHERE c.oid = t.table_oid)
        ORDER BY t.table_id
    LOOP
        PERFORM replicator.queue_copy_event(v_id, tg_tag, current_query());
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
    IF NOT EXISTS (SELECT 1 FROM pg_event_trigger WHERE evtname = 'replicator_table_rewrite') THEN
        CREATE EVENT TRIGGER replicator_table_rewrite ON table_rewrite
            EXECUTE PROCEDURE replicator.table_rewrite_trigger();
    END IF;
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
