CREATE OR REPLACE FUNCTION replicator.add_table(
    p_queue_name text,
    p_table text,
    p_mode text DEFAULT 'full',
    p_key text[] DEFAULT NULL,
    p_ignore text[] DEFAULT '{}',
    p_where text DEFAULT NULL,
    p_auto_key boolean DEFAULT false,
    p_old_rows boolean DEFAULT false,
    p_capture text DEFAULT 'statement')
RETURNS integer
LANGUAGE plpgsql AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.add_table(p_queue_name, p_table, p_mode, p_key, p_ignore, p_where,
--                                 p_auto_key, p_old_rows, p_capture)
--
--      Starts capturing a table into a queue: records it and generates its
--      capture function and triggers. Everything that could make a capture
--      fail is checked here, so that an application's write never does.
--      A partitioned table or an inheritance parent is captured with its
--      descendants (replicator.capture_tree): their rows are its rows; a
--      partition or inheritance child cannot be captured on its own
--      (replicator.check_capture_tree).
--
-- Parameters:
--      p_queue_name - queue
--      p_table      - 'schema.table' or 'table' (search_path), as regclass input
--      p_mode       - 'full' (rows) or 'pk' (keys; the consumer joins back)
--      p_key        - key columns; NULL means the primary key
--      p_ignore     - columns not captured; an update touching only them queues nothing
--      p_where      - SQL condition over the row's columns; rows outside are not queued
--      p_auto_key   - for a table without primary key or p_key, use every column
--                     that has an equality operator as the key (set semantics);
--                     used for tables created in a followed schema, whose primary
--                     key, if added later, replaces it
--      p_old_rows   - queue the old row of each UPDATE and DELETE too (full mode only),
--                     as REPLICA IDENTITY FULL does (ev_old: replicator.generate_capture)
--      p_capture    - 'statement' (a trigger a statement, over its transition tables) or
--                     'row' (a trigger a row, writing the same events: cheaper for
--                     single-row statements; replicator.generate_capture)
--
-- Returns:
--      the captured table id; adding a table twice to a queue is an error
-- ----------------------------------------------------------------------
DECLARE
    q replicator.queue := replicator.find_queue(p_queue_name);
    v_oid regclass;
    v_schema text;
    v_name text;
    v_kind "char";
    v_columns text[];
    v_pk text[];
    v_key text[];
    v_id integer;
BEGIN
    BEGIN
        v_oid := to_regclass(p_table);
        IF v_oid IS NULL THEN
            -- from PostgreSQL 16, to_regclass returns NULL for a name it cannot parse
            -- too, where earlier versions raised: parse_ident raises on all of them
            PERFORM parse_ident(p_table);
        END IF;
    EXCEPTION WHEN invalid_name OR syntax_error OR invalid_parameter_value THEN
        RAISE EXCEPTION 'invalid table name: % (a name with spaces, capitals or punctuation is written quoted, as in SQL: s."Edge Case")', p_table;
    END;
    IF v_oid IS NULL THEN
        RAISE EXCEPTION 'table % does not exist', p_table;
    END IF;
    SELECT n.nspname, c.relname, c.relkind INTO v_schema, v_name, v_kind
    FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = v_oid;
    IF v_kind NOT IN ('r', 'p') THEN
        RAISE EXCEPTION '% is not a table', p_table;
    END IF;
    IF v_schema = 'replicator' THEN
        RAISE EXCEPTION 'tables of schema replicator cannot be captured';
    END IF;
    IF EXISTS (SELECT 1 FROM replicator.captured_table
               WHERE queue_id = q.queue_id AND table_schema = v_schema AND table_name = v_name) THEN
        RAISE EXCEPTION 'table %.% is already in queue "%"', v_schema, v_name, p_queue_name;
    END IF;

    v_columns := ARRAY(SELECT attname FROM pg_attribute
                       WHERE attrelid = v_oid AND attnum > 0 AND NOT attisdropped ORDER BY attnum);
    v_pk := ARRAY(SELECT a.attname
                  FROM pg_index i
                  CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, ord)
                  JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
                  WHERE i.indrelid = v_oid AND i.indisprimary ORDER BY k.ord);
    v_key := coalesce(nullif(p_key, '{}'), nullif(v_pk, '{}'));
    IF v_key IS NULL AND p_auto_key THEN
        v_key := nullif(replicator.comparable_columns(v_oid), '{}');
    END IF;
    -- a partition or inheritance child, or a tree whose capture could miss a change
    PERFORM replicator.check_capture_tree(v_oid, coalesce(v_key, '{}'), p_queue_name);
    IF v_key IS NULL THEN
        RAISE EXCEPTION 'table %.% has no primary key: give the key columns with --key COL,...', v_schema, v_name;
    END IF;
    PERFORM replicator.check_capture_settings(v_oid, p_mode, v_key, p_ignore, p_where, p_old_rows, p_capture);

    IF EXISTS (SELECT 1 FROM replicator.capture_tree(v_oid) d WHERE d <> v_oid)
       AND (SELECT relkind FROM pg_class WHERE oid = v_oid) = 'r' THEN
        RAISE WARNING 'replicator: %.% is captured with its inheritance descendants; PostgreSQL enforces its key (%) on each table alone: keep keys unique across them (e.g. from one sequence), or rows sharing a key collapse into one on targets',
            v_schema, v_name, array_to_string(v_key, ', ');
    END IF;

    INSERT INTO replicator.captured_table
        (queue_id, table_schema, table_name, table_mode, table_key, key_is_pk, key_is_auto,
         table_ignore, table_where, table_columns, table_oid, table_structure, table_old_rows, table_capture)
    VALUES (q.queue_id, v_schema, v_name, p_mode, v_key, v_key = v_pk,
            p_auto_key AND nullif(p_key, '{}') IS NULL AND nullif(v_pk, '{}') IS NULL,
            coalesce(p_ignore, '{}'), p_where, v_columns, v_oid, replicator.table_structure(v_oid, v_key),
            coalesce(p_old_rows, false), p_capture)
    RETURNING table_id INTO v_id;
    PERFORM replicator.generate_capture(v_id);
    RETURN v_id;
END;
$$;

CREATE OR REPLACE FUNCTION replicator.sees_every_row(p_table regclass)
RETURNS boolean
LANGUAGE sql STABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.sees_every_row(p_table)
--
--      Whether no row-level security policy of the table applies to the
--      current role, as PostgreSQL decides it: the role is superuser or
--      has BYPASSRLS, or the table has row security off, or the role has
--      the privileges of its owner and the owner is not forced.
--
-- Parameters:
--      p_table     - the table
--
-- Returns:
--      true when every row of the table is visible to the current role
-- ----------------------------------------------------------------------
    SELECT r.rolsuper OR r.rolbypassrls OR NOT c.relrowsecurity
           OR (NOT c.relforcerowsecurity AND pg_has_role(current_user, c.relowner, 'USAGE'))
    FROM pg_class c, pg_roles r
    WHERE c.oid = p_table AND r.rolname = current_user;
$$;

CREATE OR REPLACE FUNCTION replicator.check_capture_settings(p_table regclass, p_mode text, p_key text[],
                                                             p_ignore text[], p_where text,
                                                             p_old_rows boolean DEFAULT false,
                                                             p_capture text DEFAULT 'statement')
RETURNS void
LANGUAGE plpgsql AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.check_capture_settings(p_table, p_mode, p_key, p_ignore, p_where, p_old_rows,
--                                               p_capture)
--
--      Checks the settings of a table's capture, as add_table is given
--      them and alter_table changes them: everything about them that
--      could make a capture fail, so that an application's write never
--      does.
--
-- Parameters:
--      p_table     - the table
--      p_mode      - 'full' or 'pk'
--      p_key       - the key columns (resolved: never NULL)
--      p_ignore    - columns not captured
--      p_where     - the row filter, or NULL
--      p_old_rows  - whether old rows are queued too
--      p_capture   - 'statement' or 'row'
--
-- Returns:
--      nothing; raises naming the first setting at fault
-- ----------------------------------------------------------------------
DECLARE
    v_schema text;
    v_name text;
    v_columns text[];
    v_bad text;
BEGIN
    SELECT n.nspname, c.relname INTO v_schema, v_name
    FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = p_table;
    IF p_mode IS NULL OR p_mode NOT IN ('full', 'pk') THEN
        RAISE EXCEPTION 'mode must be full or pk, not %', coalesce(p_mode, 'NULL');
    END IF;
    IF p_capture IS NULL OR p_capture NOT IN ('statement', 'row') THEN
        RAISE EXCEPTION 'capture must be statement or row, not %', coalesce(p_capture, 'NULL');
    END IF;
    IF p_capture = 'row' AND (SELECT relkind FROM pg_class WHERE oid = p_table) = 'p' THEN
        -- PostgreSQL clones a partitioned table's row triggers onto its partitions, and an
        -- UPDATE moving a row between partitions fires a DELETE and an INSERT there
        RAISE EXCEPTION 'table %.% is partitioned: capture it by statement (--capture statement)', v_schema, v_name;
    END IF;
    IF p_capture = 'row' AND NOT replicator.sees_every_row(p_table) THEN
        -- a row capture's key lookups run as this role (the capture function's owner): rows its
        -- policies hide would make a key swap queue the deletes of keys that rows still hold
        RAISE EXCEPTION 'table %.% has row-level security that applies to role %: capture it by statement '
                        '(--capture statement), or as a role with BYPASSRLS', v_schema, v_name, current_user;
    END IF;
    v_columns := ARRAY(SELECT attname FROM pg_attribute
                       WHERE attrelid = p_table AND attnum > 0 AND NOT attisdropped ORDER BY attnum);
    SELECT string_agg(c, ', ') INTO v_bad FROM unnest(p_key || coalesce(p_ignore, '{}')) c WHERE c <> ALL (v_columns);
    IF v_bad IS NOT NULL THEN
        RAISE EXCEPTION 'table %.% has no column %', v_schema, v_name, v_bad;
    END IF;
    SELECT string_agg(c, ', ') INTO v_bad FROM unnest(p_key) c WHERE c = ANY (p_ignore);
    IF v_bad IS NOT NULL THEN
        RAISE EXCEPTION 'key column % cannot be ignored', v_bad;
    END IF;
    -- Keys are compared with EXCEPT in the capture function: they need an equality operator.
    BEGIN
        EXECUTE format('SELECT %1$s FROM %2$s WHERE false EXCEPT SELECT %1$s FROM %2$s WHERE false',
                       (SELECT string_agg(quote_ident(k), ', ') FROM unnest(p_key) k), p_table);
    EXCEPTION WHEN undefined_function THEN
        RAISE EXCEPTION 'key of %.% cannot be compared (%): choose other --key columns', v_schema, v_name, SQLERRM;
    END;
    v_bad := replicator.row_filter_error(p_table, p_where);
    IF v_bad IS NOT NULL THEN
        RAISE EXCEPTION 'invalid row filter for %.%: % (use bare column names; schema-qualify functions, types and tables)',
            v_schema, v_name, v_bad;
    END IF;
    IF p_mode = 'pk' AND p_old_rows THEN
        -- pk mode queues keys: the consumer reads rows back as they are when it runs, no old row
        RAISE EXCEPTION 'table %.%: old rows (--old-rows) need full mode, not pk mode (which queues keys only)',
            v_schema, v_name;
    END IF;
    IF p_mode = 'pk' AND cardinality(replicator.nullable_key_columns(p_table, p_key)) > 0 THEN
        RAISE EXCEPTION 'table %.%: pk mode needs NOT NULL key columns (the consumer joins back on them)',
            v_schema, v_name;
    END IF;
END;
$$;

CREATE OR REPLACE FUNCTION replicator.comparable_columns(p_table regclass)
RETURNS text[]
LANGUAGE sql STABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.comparable_columns(p_table)
--
--      Columns of a table whose type has a default btree or hash operator
--      class, i.e. can be compared for equality; the automatic key of a
--      keyless table.
-- ----------------------------------------------------------------------
    SELECT coalesce(array_agg(a.attname::text ORDER BY a.attnum), '{}')
    FROM pg_attribute a
    JOIN pg_type t ON t.oid = a.atttypid
    WHERE a.attrelid = p_table AND a.attnum > 0 AND NOT a.attisdropped
      AND EXISTS (SELECT 1 FROM pg_opclass oc JOIN pg_am am ON am.oid = oc.opcmethod
                  WHERE am.amname IN ('btree', 'hash') AND oc.opcdefault
                    AND (oc.opcintype = CASE WHEN t.typtype = 'd' THEN t.typbasetype ELSE t.oid END
                         OR (oc.opcintype = 'anyarray'::regtype AND t.typcategory = 'A')
                         OR (oc.opcintype = 'anyenum'::regtype AND t.typtype = 'e')
                         OR (oc.opcintype = 'text'::regtype AND t.typcategory = 'S')));
$$;

CREATE OR REPLACE FUNCTION replicator.nullable_key_columns(p_table regclass, p_key text[])
RETURNS text[]
LANGUAGE sql STABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.nullable_key_columns(p_table, p_key)
--
--      The key columns of a table that may be NULL. A table captured in pk
--      mode needs none: the consumer reads rows back by their key, and a
--      NULL never equals (add_table refuses such a table, sync_table a DDL
--      that makes a key column nullable).
--
-- Parameters:
--      p_table     - the table
--      p_key       - its key columns
--
-- Returns:
--      those without NOT NULL, in column order; '{}' if none
-- ----------------------------------------------------------------------
    SELECT coalesce(array_agg(attname::text ORDER BY attnum), '{}')
    FROM pg_attribute
    WHERE attrelid = p_table AND attname = ANY (p_key) AND NOT attnotnull AND NOT attisdropped;
$$;

CREATE OR REPLACE FUNCTION replicator.row_filter_error(p_table regclass, p_where text)
RETURNS text
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
SET bytea_output = 'hex' SET extra_float_digits = 1 SET IntervalStyle = 'postgres'
SET standard_conforming_strings = on SET TimeZone = 'UTC' SET DateStyle = 'ISO, MDY' AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.row_filter_error(p_table, p_where)
--
--      Checks a row filter (--where) as the generated capture function
--      runs it: with search_path pinned to pg_catalog, pg_temp and the
--      capture function's output settings (the SET clauses above), over the
--      table's rows aliased n and o as the transition tables are (so only
--      bare column names resolve). Used by add_table, and by sync_table
--      after every DDL that changes the table: a filter that no longer
--      parses or resolves would make application writes fail.
--
--      No statement of the filter runs: the query is opened as a cursor
--      and closed unread, which parses, analyses and plans it (and starts
--      its executor, reading no row: LIMIT 0); planning may evaluate the
--      filter's immutable and stable functions, as the capture would. A cursor takes one statement:
--      a filter that stacks statements after the query ("true) LIMIT 0;
--      DROP TABLE t; SELECT (1") is refused before any of them runs, where
--      EXECUTE would run them all. That the filter is one expression, and
--      no `)` of it closes the query's, is checked before it reaches the
--      server (replicator.source.check_row_filter); this function is the
--      server's own guard for callers of the SQL functions. Literals are
--      read as the capture function reads them: strings with
--      standard_conforming_strings on (as that check reads them), times in
--      UTC, dates in ISO/MDY order.
--      ONLY: a partitioned table's partitions are not locked (the check
--      runs inside application statements too, replicator.capture_drift);
--      a lock or cancel error says nothing of the filter and is raised.
--
-- Parameters:
--      p_table     - the captured table
--      p_where     - the filter; NULL is no filter
--
-- Returns:
--      NULL when the filter is valid (or NULL), else the error message
-- ----------------------------------------------------------------------
DECLARE
    v_cursor refcursor;
BEGIN
    IF p_where IS NOT NULL THEN
        OPEN v_cursor NO SCROLL FOR EXECUTE
            format('SELECT 1 FROM ONLY %1$s n WHERE (%2$s) UNION ALL SELECT 1 FROM ONLY %1$s o WHERE (%2$s) LIMIT 0',
                   p_table, p_where);
        CLOSE v_cursor;
    END IF;
    RETURN NULL;
EXCEPTION
    WHEN invalid_cursor_definition THEN   -- "cannot open multi-query plan as cursor"
        RETURN 'it is not one expression (' || SQLERRM || ')';
    WHEN lock_not_available OR deadlock_detected OR serialization_failure OR query_canceled THEN
        RAISE;   -- says nothing of the filter: the caller tries again
    WHEN OTHERS THEN
        RETURN SQLERRM;
END;
$$;
