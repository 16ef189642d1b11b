CREATE OR REPLACE FUNCTION replicator.capture_row_json(p_alias text, p_columns text[], p_table regclass)
RETURNS text
LANGUAGE sql STABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.capture_row_json(p_alias, p_columns, p_table)
--
--      SQL expression encoding some columns of a row of p_table as a JSON
--      array of values in the given order: the compact row encoding (column
--      names travel once, in the table's structure, not in every event).
--      Capture triggers, the initial copy and the PK-only join-back all use
--      it, so a target decodes one format.
--
--      Values are JSON scalars as json_build_array renders them, except
--      json/jsonb, arrays and composites, which travel as their JSON text in
--      a string, so a target stores PostgreSQL's own rendering unchanged,
--      and bytea, which travels as '\x' and its hex digits whatever the
--      session's bytea_output (see replicator.capture_needs_settings).
--      A column the table no longer has reads as NULL (a consumer reading
--      back rows of a structure it has not caught up with yet).
--
-- Parameters:
--      p_alias     - range variable the columns belong to
--      p_columns   - column names, in encoding order
--      p_table     - the table the columns belong to (for their types)
--
-- Returns:
--      'json_build_array(a."c1", a."c2")'; tables wider than a function's
--      100 arguments go through VARIADIC json[]
-- ----------------------------------------------------------------------
    WITH cols AS (
        SELECT c.ord,
               CASE
                   WHEN a.attnum IS NULL THEN 'NULL'
                   WHEN bt.typname IN ('json', 'jsonb') THEN format('%I.%I::pg_catalog.text', p_alias, c.col)
                   WHEN bt.oid = 'pg_catalog.bytea'::regtype
                       THEN format($e$(E'\\x' OPERATOR(pg_catalog.||) pg_catalog.encode(%I.%I, 'hex'))$e$,
                                 p_alias, c.col)
                   WHEN bt.typcategory IN ('A', 'C') THEN format('pg_catalog.to_json(%I.%I)::pg_catalog.text', p_alias, c.col)
                   ELSE format('%I.%I', p_alias, c.col)
               END AS expr
        FROM unnest(p_columns) WITH ORDINALITY AS c(col, ord)
        LEFT JOIN pg_attribute a ON a.attrelid = p_table AND a.attname = c.col AND NOT a.attisdropped
        LEFT JOIN pg_type t ON t.oid = a.atttypid
        LEFT JOIN pg_type bt ON bt.oid = CASE WHEN t.typtype = 'd' THEN t.typbasetype ELSE t.oid END)
    SELECT CASE WHEN cardinality(p_columns) <= 100 THEN
        'pg_catalog.json_build_array(' || (SELECT string_agg(expr, ', ' ORDER BY ord) FROM cols) || ')'
    ELSE
        'pg_catalog.json_build_array(VARIADIC ARRAY[' ||
            (SELECT string_agg('pg_catalog.to_json(' || expr || ')', ', ' ORDER BY ord) FROM cols)
            || ']::pg_catalog.json[])'
    END;
$$;

CREATE OR REPLACE FUNCTION replicator.capture_needs_settings(p_columns text[], p_table regclass)
RETURNS boolean
LANGUAGE sql STABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.capture_needs_settings(p_columns, p_table)
--
--      Whether the capture encoding (replicator.capture_row_json) of these
--      columns depends on the session's output settings bytea_output,
--      extra_float_digits or IntervalStyle, which the capture function then
--      pins with SET clauses (each costs a setting and its restore at every
--      call of the trigger: about 1 us per statement, bin/bench-capture).
--
--      False only when every column's type (through domains; for arrays,
--      their element type) is one whose JSON rendering no such setting
--      changes: integers, oid, numeric, the string types, bool, date and
--      time types other than interval (json_build_array renders dates and
--      timestamps in ISO 8601 whatever DateStyle), uuid, json/jsonb, the
--      network and bit string types and enums; plus bytea, which
--      capture_row_json encodes explicitly as hex, but not inside arrays.
--      Anything else (float4/float8, interval, bytea[], composites, ranges,
--      geometric types, types of extensions) needs them.
--
-- Parameters:
--      p_columns   - the columns the capture encodes
--      p_table     - their table
-- ----------------------------------------------------------------------
    WITH RECURSIVE col AS (
        SELECT a.atttypid AS typ, true AS top
        FROM pg_attribute a
        WHERE a.attrelid = p_table AND a.attname = ANY (p_columns) AND NOT a.attisdropped
    ), base AS (
        -- each type down through domains and to the element of an array
        SELECT typ, top FROM col
        UNION ALL
        SELECT CASE WHEN t.typtype = 'd' THEN t.typbasetype ELSE t.typelem END,
               top AND t.typtype = 'd'
        FROM base b JOIN pg_type t ON t.oid = b.typ
        WHERE t.typtype = 'd' OR (t.typcategory = 'A' AND t.typelem <> 0)
    )
    SELECT coalesce(bool_or(NOT (
               t.typtype = 'e'
               OR t.typtype = 'd'
               OR (t.typcategory = 'A' AND t.typelem <> 0)
               OR (t.typnamespace = 'pg_catalog'::regnamespace
                   AND (t.typname IN ('int2', 'int4', 'int8', 'oid', 'numeric', 'text', 'varchar', 'bpchar',
                                      'name', 'char', 'bool', 'date', 'time', 'timetz', 'timestamp',
                                      'timestamptz', 'uuid', 'json', 'jsonb', 'inet', 'cidr', 'macaddr',
                                      'macaddr8', 'bit', 'varbit')
                        OR (t.typname = 'bytea' AND b.top))))), false)
    FROM base b JOIN pg_type t ON t.oid = b.typ;
$$;

CREATE OR REPLACE FUNCTION replicator.capture_function(p_table_id integer)
RETURNS text
LANGUAGE sql STABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.capture_function(p_table_id)
--
--      Name of the generated capture function of a captured table.
-- ----------------------------------------------------------------------
    SELECT 'replicator.' || quote_ident('capture_' || p_table_id);
$$;

CREATE OR REPLACE FUNCTION replicator.capture_fast_insert(
    p_queue_id integer, p_cols text, p_row text, p_rows text, p_check text)
RETURNS text
LANGUAGE sql STABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.capture_fast_insert(p_queue_id, p_cols, p_row, p_rows, p_check)
--
--      Part of replicator.generate_capture(): the PL/pgSQL writing the rows
--      of a statement of up to 1000 rows as one event, with one aggregate
--      over at most 1001 rows. FOUND is false when there are no rows, more
--      than 1000, or p_check is false. The event goes straight into the
--      current partition (a CASE arm per partition, needing no tuple
--      routing) when the queue has at most 8, else through the parent.
--
-- Parameters:
--      p_queue_id  - the queue
--      p_cols      - the event table's columns, in their order
--      p_row       - their values; {slot} stands for the slot, items are s.r
--      p_rows      - the query of the items, as "r"
--      p_check     - more HAVING conditions, starting with ' AND ', or ''
-- ----------------------------------------------------------------------
    WITH q AS (SELECT queue_ntables AS n FROM replicator.queue WHERE queue_id = p_queue_id),
    stmt AS (
        SELECT i, 'INSERT INTO ' || CASE WHEN i < 0 THEN replicator.event_table(p_queue_id)
                                         ELSE replicator.event_partition(p_queue_id, i) END
                  || ' (' || p_cols || ') SELECT '
                  || replace(p_row, '{slot}', CASE WHEN i < 0 THEN 'capture.v_slot' ELSE i || '::smallint' END)
                  || ' FROM (' || p_rows || ' LIMIT 1001) s HAVING count(*) BETWEEN 1 AND 1000' || p_check || ';' AS sql
        FROM q, generate_series(-1, CASE WHEN q.n <= 8 THEN q.n - 1 ELSE -1 END) i)
    SELECT CASE WHEN count(*) = 1 THEN min(sql)
           ELSE 'CASE v_slot'
                || string_agg(E'\n        WHEN ' || i || E' THEN\n            ' || sql, '' ORDER BY i) FILTER (WHERE i >= 0)
                || E'\n        ELSE\n            ' || min(sql) FILTER (WHERE i < 0)
                || E'\n        END CASE;'
           END
    FROM stmt;
$$;

CREATE OR REPLACE FUNCTION replicator.capture_event_row(p_queue_id integer, p_table_id integer,
                                                         OUT cols text, OUT row_values text)
LANGUAGE sql STABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.capture_event_row(p_queue_id, p_table_id)
--
--      Part of replicator.generate_capture(): the event row a capture
--      writes, with every column of the event table in its order, so that
--      INSERT ... SELECT needs no projection on top of the aggregate;
--      columns not set here get their default.
--
-- Returns:
--      cols        - the event table's columns, quoted, in their order
--      row_values  - their values: placeholders {slot}, {type} and {old}
--                    (ev_old: NULL, or the old rows of tables with
--                    table_old_rows), items aggregated from s.r
-- ----------------------------------------------------------------------
    SELECT string_agg(quote_ident(a.attname), ', ' ORDER BY a.attnum),
           string_agg(CASE a.attname
                          WHEN 'ev_id' THEN format('pg_catalog.nextval(%L::pg_catalog.regclass)',
                                                   replicator.event_id_seq(p_queue_id))
                          -- the defaults, schema-qualified (a row capture runs under the writer's search_path)
                          WHEN 'ev_txid' THEN 'pg_catalog.txid_current()'
                          WHEN 'ev_time' THEN 'pg_catalog.now()'
                          WHEN 'ev_table' THEN p_table_id::text
                          WHEN 'ev_slot' THEN '{slot}'
                          WHEN 'ev_type' THEN '{type}::pg_catalog."char"'
                          WHEN 'ev_data' THEN 'json_agg(s.r)'
                          WHEN 'ev_old' THEN '{old}'
                          ELSE coalesce(pg_get_expr(d.adbin, d.adrelid), 'NULL')
                      END, ', ' ORDER BY a.attnum)
    FROM pg_attribute a
    LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
    WHERE a.attrelid = replicator.event_table(p_queue_id)::regclass AND a.attnum > 0 AND NOT a.attisdropped;
$$;

CREATE OR REPLACE FUNCTION replicator.capture_chunked_sql(t replicator.captured_table, p_op text, p_slot text,
                                                          p_new text DEFAULT 'new_rows',
                                                          p_old text DEFAULT 'old_rows')
RETURNS text
LANGUAGE plpgsql STABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.capture_chunked_sql(t, p_op, p_slot, p_new, p_old)
--
--      Part of replicator.generate_capture(): the statement capturing any
--      number of rows of one INSERT, UPDATE or DELETE, one event per 1000
--      items (so that a statement touching millions of rows never builds a
--      JSON value past PostgreSQL's 1 GB limit), through the parent event
--      table. An UPDATE queues its new rows as U and, as D, the old keys
--      no new row kept. The capture of a table whose structure changed
--      behind it runs it too (replicator.capture_drift).
--
--      With old rows (table_old_rows), each item's old row goes into
--      ev_old at the item's place: a D's the deleted row; a U's the old
--      row of the same key (null when no old row had it: the new row of a
--      key change). An UPDATE pairs its old and new rows by key, grouping
--      both by the key columns as EXCEPT compares them (NULLs equal): a key
--      with a new row is a U (with the old row of that key, if any), a key
--      with only an old row a D. Each old row is so the old row of one
--      item, and each item's old row is the row the key had before.
--
-- Parameters:
--      t           - the captured table's record: columns, key, ignored
--                    columns, row filter and mode
--      p_op        - 'INSERT', 'UPDATE' or 'DELETE'
--      p_slot      - the expression of the current slot
--      p_new       - the new rows, as a FROM item: the transition table
--                    new_rows, or a row capture's one row
--      p_old       - the old rows, likewise
--
-- Returns:
--      one INSERT statement over the new rows (aliased n) and old rows (o)
-- ----------------------------------------------------------------------
DECLARE
    v_oid regclass := t.table_oid;
    v_tracked text[] := ARRAY(SELECT c FROM unnest(t.table_columns) c WHERE c <> ALL (t.table_ignore));
    v_filter text := coalesce('(' || t.table_where || ')', 'true');
    v_payload_n text;
    v_payload_o text;
    v_changed text := '';
    v_event record := replicator.capture_event_row(t.queue_id, t.table_id);
    v_old boolean := t.table_old_rows AND t.table_mode = 'full';
    v_insert text;
BEGIN
    v_payload_n := replicator.capture_row_json('n',
        CASE t.table_mode WHEN 'full' THEN v_tracked ELSE t.table_key END, v_oid);
    v_payload_o := replicator.capture_row_json('o', t.table_key, v_oid);
    v_insert := 'INSERT INTO ' || replicator.event_table(t.queue_id) || ' (' || v_event.cols || ') SELECT '
                || replace(replace(replace(v_event.row_values, '{slot}', p_slot), '{type}', 's.t'), '{old}',
                           CASE WHEN v_old AND p_op <> 'INSERT' THEN 'json_agg(s.o)' ELSE 'NULL' END) || ' FROM (';
    IF p_op = 'INSERT' THEN
        RETURN v_insert || format($q$SELECT 'I' AS t, %s AS r, row_number() OVER () / 1000 AS g
            FROM %s n WHERE %s$q$, v_payload_n, p_new, v_filter) || ') s GROUP BY s.t, s.g';
    ELSIF p_op = 'DELETE' THEN
        RETURN v_insert || format($q$SELECT 'D' AS t, %s AS r,%s row_number() OVER () / 1000 AS g
            FROM %s o WHERE %s$q$, v_payload_o,
            CASE WHEN v_old THEN ' ' || replicator.capture_row_json('o', v_tracked, v_oid) || ' AS o,' ELSE '' END,
            p_old, v_filter) || ') s GROUP BY s.t, s.g';
    ELSIF v_old THEN
        RETURN v_insert || replicator.capture_paired_update_sql(t, v_tracked, v_filter, p_new, p_old) || ') s GROUP BY s.t, s.g';
    END IF;
    IF cardinality(t.table_ignore) > 0 THEN
        v_changed := format(' AND %s::text NOT IN (SELECT %s::text FROM %s o WHERE %s)',
                            replicator.capture_row_json('n', v_tracked, v_oid),
                            replicator.capture_row_json('o', v_tracked, v_oid), p_old, v_filter);
    END IF;
    RETURN v_insert || format(
        $q$SELECT 'U' AS t, %1$s AS r, row_number() OVER () / 1000 AS g
            FROM %7$s n WHERE %2$s%3$s
            UNION ALL
            SELECT 'D', %4$s, row_number() OVER () / 1000
            FROM (SELECT %5$s FROM %8$s o WHERE %2$s
                  EXCEPT SELECT %6$s FROM %7$s n WHERE %2$s) o$q$,
        v_payload_n, v_filter, v_changed, v_payload_o,
        (SELECT string_agg('o.' || quote_ident(k), ', ') FROM unnest(t.table_key) k),
        (SELECT string_agg('n.' || quote_ident(k), ', ') FROM unnest(t.table_key) k), p_new, p_old)
        || ') s GROUP BY s.t, s.g';
END;
$$;

CREATE OR REPLACE FUNCTION replicator.capture_paired_update_sql(t replicator.captured_table, p_tracked text[],
                                                                 p_filter text, p_new text, p_old text)
RETURNS text
LANGUAGE sql STABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.capture_paired_update_sql(t, p_tracked, p_filter, p_new, p_old)
--
--      Part of replicator.capture_chunked_sql(): the items of an UPDATE of
--      a table with old rows, each old row paired with the new row of its
--      key. Both sides are grouped by the key columns (as EXCEPT compares
--      them: the type's equality, NULLs equal): a key with a new row is a
--      U, with the old row of its key or null (a key change's new key); a
--      key with only an old row a D (a key change's old key, or a row
--      updated out of the row filter). With ignored columns, a U whose
--      captured columns kept their values is left out.
--
-- Parameters:
--      t           - the captured table's record (full mode, old rows)
--      p_tracked   - its captured columns
--      p_filter    - its row filter, as a condition ('true' without)
--      p_new       - the new rows, as a FROM item (replicator.capture_chunked_sql)
--      p_old       - the old rows, likewise
--
-- Returns:
--      a query of items (t, r, o, g): type, ev_data item, ev_old item, and
--      the event (g) it goes in, 1000 items each
-- ----------------------------------------------------------------------
    SELECT format(
        $q$SELECT CASE WHEN p.r IS NULL THEN 'D' ELSE 'U' END AS t, coalesce(p.r, p.k) AS r, p.o,
                  row_number() OVER () / 1000 AS g
            FROM (SELECT (array_agg(p.r) FILTER (WHERE p.r IS NOT NULL))[1] AS r,
                         (array_agg(p.o) FILTER (WHERE p.o IS NOT NULL))[1] AS o,
                         (array_agg(p.k) FILTER (WHERE p.k IS NOT NULL))[1] AS k
                  FROM (SELECT %1$s, %2$s AS r, NULL::json AS o, NULL::json AS k FROM %9$s n WHERE %3$s
                        UNION ALL
                        SELECT %4$s, NULL, %5$s, %6$s FROM %10$s o WHERE %3$s) p
                  GROUP BY %7$s) p%8$s$q$,
        (SELECT string_agg(format('n.%I AS k%s', c, i), ', ' ORDER BY i) FROM unnest(t.table_key) WITH ORDINALITY k(c, i)),
        replicator.capture_row_json('n', p_tracked, t.table_oid),
        p_filter,
        (SELECT string_agg(format('o.%I', c), ', ' ORDER BY i) FROM unnest(t.table_key) WITH ORDINALITY k(c, i)),
        replicator.capture_row_json('o', p_tracked, t.table_oid),
        replicator.capture_row_json('o', t.table_key, t.table_oid),
        (SELECT string_agg('k' || i, ', ' ORDER BY i) FROM unnest(t.table_key) WITH ORDINALITY k(c, i)),
        CASE WHEN cardinality(t.table_ignore) > 0
             THEN E'\n            WHERE p.r IS NULL OR p.o IS NULL OR p.r::text <> p.o::text' ELSE '' END,
        p_new, p_old);
$$;

CREATE OR REPLACE FUNCTION replicator.capture_row_insert(p_queue_id integer, p_cols text, p_values text)
RETURNS text
LANGUAGE sql STABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.capture_row_insert(p_queue_id, p_cols, p_values)
--
--      Part of replicator.capture_row_body(): the PL/pgSQL writing one
--      event of a row capture, as replicator.capture_fast_insert writes a
--      statement's: straight into the current partition (an IF arm per
--      partition, no tuple routing) when the queue has at most 8, else
--      through the parent. Operators schema-qualified, as all of a row
--      capture (replicator.capture_row_body).
--
-- Parameters:
--      p_queue_id  - the queue
--      p_cols      - the event table's columns, in their order
--      p_values    - their values; {slot} stands for the slot
-- ----------------------------------------------------------------------
    WITH q AS (SELECT queue_ntables AS n FROM replicator.queue WHERE queue_id = p_queue_id),
    stmt AS (
        SELECT i, 'INSERT INTO ' || CASE WHEN i < 0 THEN replicator.event_table(p_queue_id)
                                         ELSE replicator.event_partition(p_queue_id, i) END
                  || ' (' || p_cols || ') VALUES ('
                  || replace(p_values, '{slot}', CASE WHEN i < 0 THEN 'capture.v_slot' ELSE i || '::smallint' END)
                  || ');' AS sql
        FROM q, generate_series(-1, CASE WHEN q.n <= 8 THEN q.n - 1 ELSE -1 END) i)
    SELECT CASE WHEN count(*) = 1 THEN min(sql)
           ELSE string_agg(CASE WHEN i = 0 THEN 'IF' ELSE E'\n        ELSIF' END
                           || ' capture.v_slot OPERATOR(pg_catalog.=) ' || i || E' THEN\n            ' || sql,
                           '' ORDER BY i) FILTER (WHERE i >= 0)
                || E'\n        ELSE\n            ' || min(sql) FILTER (WHERE i < 0)
                || E'\n        END IF;'
           END
    FROM stmt;
$$;

CREATE OR REPLACE FUNCTION replicator.capture_row_closed(t replicator.captured_table)
RETURNS boolean
LANGUAGE sql STABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.capture_row_closed(t)
--
--      Whether a table's row capture names every function, operator and
--      type it uses with its schema (replicator.capture_row_body), so that
--      it runs safely, as SECURITY DEFINER, under the writer's search_path:
--      without the SET search_path that costs a row capture about 5 us a
--      row (docs/benchmarks.md). Not with a row filter (bare names, read
--      with search_path pinned), nor with key columns of types outside
--      pg_catalog (through domains; their equality is looked up by name).
-- ----------------------------------------------------------------------
    SELECT t.table_where IS NULL AND NOT EXISTS (
        SELECT FROM pg_attribute a
        JOIN pg_type ty ON ty.oid = a.atttypid
        JOIN pg_type bt ON bt.oid = CASE WHEN ty.typtype = 'd' THEN ty.typbasetype ELSE ty.oid END
        WHERE a.attrelid = t.table_oid AND a.attname = ANY (t.table_key) AND NOT a.attisdropped
          AND (bt.typnamespace <> 'pg_catalog'::regnamespace OR bt.typtype = 'd'));
$$;

CREATE OR REPLACE FUNCTION replicator.capture_row_key_kept(t replicator.captured_table, p_new text, p_old text)
RETURNS text
LANGUAGE plpgsql STABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.capture_row_key_kept(t, p_new, p_old)
--
--      Part of a row capture (replicator.capture_row_body, capture_drift):
--      the condition that the row p_new has the key of the row p_old (NULLs
--      equal, as EXCEPT compares them), operators schema-qualified.
-- ----------------------------------------------------------------------
BEGIN
    RETURN (SELECT string_agg(CASE WHEN k = ANY (replicator.nullable_key_columns(t.table_oid, t.table_key))
                           THEN format('coalesce(%2$s.%1$I OPERATOR(pg_catalog.=) %3$s.%1$I,'
                                       ' %2$s.%1$I IS NULL AND %3$s.%1$I IS NULL)', k, p_new, p_old)
                           ELSE format('%2$s.%1$I OPERATOR(pg_catalog.=) %3$s.%1$I', k, p_new, p_old) END, ' AND ')
    FROM unnest(t.table_key) k);
END;
$$;

CREATE OR REPLACE FUNCTION replicator.capture_row_holders(t replicator.captured_table, p_old text)
RETURNS text
LANGUAGE plpgsql STABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.capture_row_holders(t, p_old)
--
--      Part of a row capture (replicator.capture_row_body, capture_drift):
--      what follows the table's name in "SELECT FROM <table>" to read the
--      rows holding the key of the row p_old now, within the row filter
--      (a NOT NULL column's equality is an index condition).
-- ----------------------------------------------------------------------
BEGIN
    RETURN (SELECT ' x WHERE ' || string_agg(CASE WHEN k = ANY (replicator.nullable_key_columns(t.table_oid, t.table_key))
                                          THEN format('(x.%1$I OPERATOR(pg_catalog.=) %2$s.%1$I'
                                                      ' OR (x.%1$I IS NULL AND %2$s.%1$I IS NULL))', k, p_old)
                                          ELSE format('x.%1$I OPERATOR(pg_catalog.=) %2$s.%1$I', k, p_old) END,
                                     ' AND ')
           || CASE WHEN t.table_where IS NOT NULL THEN format(' AND (%s)', t.table_where) ELSE '' END
    FROM unnest(t.table_key) k);
END;
$$;

CREATE OR REPLACE FUNCTION replicator.capture_row_body(t replicator.captured_table, p_cols text, p_row text)
RETURNS text
LANGUAGE plpgsql STABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.capture_row_body(t, p_cols, p_row)
--
--      Part of replicator.generate_capture(): the INSERT, UPDATE and DELETE
--      branches of a row capture (table_capture 'row'), run by AFTER ROW
--      triggers. They write the events a statement capture writes for the
--      same rows, item for item (a statement's event of one item is the
--      row capture's event, byte for byte), one event per row:
--        I  the inserted row, where it passes the row filter;
--        U  the new row, where it passes the filter (with ignored columns:
--           where a captured column changed, or the row entered the filter);
--        D  the deleted row's key; for an UPDATE, the old key, where the
--           old row passed the filter and the new row kept neither the
--           filter nor the key. A key change's old key is queued only when
--           no row of the table has it now (within the filter): AFTER ROW
--           triggers run at the end of the statement, so a row that another
--           row of the same statement moved onto that key is seen, as the
--           statement capture's EXCEPT sees it among the new rows (a key
--           swap queues no D). One index scan by the key, for a key change
--           only, by dynamic SQL naming the table by its oid (a name fixed
--           at generation would read another table after a rename).
--      Old rows (table_old_rows): a D's the old row; a U's the old row when
--      the key was kept and it passed the filter, else null: a key change's
--      new key (a statement capture, pairing by key, gives a key swap's U
--      the old row that had the key; a row knows only its own).
--      Functions, operators and types are schema-qualified (the function
--      may run under the writer's search_path: replicator.capture_row_closed);
--      a row filter's names are the filter's own.
--
-- Parameters:
--      t           - the captured table's record
--      p_cols      - the event table's columns (replicator.capture_event_row)
--      p_row       - their values, placeholders and all
--
-- Returns:
--      PL/pgSQL: "IF TG_OP ... 'INSERT' THEN ... ELSIF ... 'DELETE' THEN ..."
--      up to the TRUNCATE branch
-- ----------------------------------------------------------------------
DECLARE
    v_oid regclass := t.table_oid;
    v_tracked text[] := ARRAY(SELECT c FROM unnest(t.table_columns) c WHERE c <> ALL (t.table_ignore));
    v_old boolean := t.table_old_rows AND t.table_mode = 'full';
    v_payload_n text := replicator.capture_row_json('new',
                            CASE t.table_mode WHEN 'full' THEN v_tracked ELSE t.table_key END, v_oid);
    v_payload_o text := replicator.capture_row_json('old', t.table_key, v_oid);
    v_old_row text := replicator.capture_row_json('old', v_tracked, v_oid);
    v_in_n text := 'true';
    v_in_o text := 'true';
    v_same text;
    v_taken text;
    v_ins text;
    v_upd text;
    v_del text;
BEGIN
    IF t.table_where IS NOT NULL THEN
        -- the filter reads bare column names, as over the transition tables
        v_in_n := format('coalesce((SELECT (%s) FROM (SELECT new.*) n), false)', t.table_where);
        v_in_o := format('coalesce((SELECT (%s) FROM (SELECT old.*) o), false)', t.table_where);
    END IF;
    v_same := replicator.capture_row_key_kept(t, 'new', 'old');
    -- read by dynamic SQL naming the table by its oid as it is called now: a name fixed here
    -- would read another table once this one or its schema is renamed (key changes only)
    v_taken := format($t$EXECUTE 'SELECT EXISTS (SELECT FROM ' OPERATOR(pg_catalog.||) %s::pg_catalog.regclass::pg_catalog.text
                    OPERATOR(pg_catalog.||) %L INTO v_taken USING old;$t$,
                      t.table_oid::oid, replicator.capture_row_holders(t, '($1)') || ')');

    v_ins := replicator.capture_row_insert(t.queue_id, p_cols,
        replace(replace(replace(p_row, '{type}', quote_literal('I')), '{old}', 'NULL'),
                'json_agg(s.r)', format('pg_catalog.json_build_array(%s)', v_payload_n)));
    v_del := replicator.capture_row_insert(t.queue_id, p_cols,
        replace(replace(replace(p_row, '{type}', quote_literal('D')), '{old}',
                        CASE WHEN v_old THEN format('pg_catalog.json_build_array(%s)', v_old_row) ELSE 'NULL' END),
                'json_agg(s.r)', format('pg_catalog.json_build_array(%s)', v_payload_o)));
    v_upd := replicator.capture_row_insert(t.queue_id, p_cols,
        replace(replace(replace(p_row, '{type}', quote_literal('U')), '{old}',
                        CASE WHEN NOT v_old THEN 'NULL'
                             ELSE format('pg_catalog.json_build_array(CASE WHEN capture.v_same AND capture.v_in_o'
                                         ' THEN %s END)', v_old_row) END),
                'json_agg(s.r)', format('pg_catalog.json_build_array(%s)', v_payload_n)));

    IF t.table_where IS NULL AND cardinality(t.table_ignore) = 0 AND NOT v_old THEN
        -- the common case, in the fewest statements: the new row, and the old key if it changed
        RETURN format($f$IF TG_OP OPERATOR(pg_catalog.=) 'INSERT' THEN
        %1$s
    ELSIF TG_OP OPERATOR(pg_catalog.=) 'UPDATE' THEN
        %2$s
        IF NOT (%3$s) THEN
            %4$s
            IF NOT v_taken THEN
                %5$s
            END IF;
        END IF;
    ELSIF TG_OP OPERATOR(pg_catalog.=) 'DELETE' THEN
        %5$s$f$, v_ins, v_upd, v_same, v_taken, v_del);
    END IF;
    RETURN format($f$IF TG_OP OPERATOR(pg_catalog.=) 'INSERT' THEN
        IF %1$s THEN
            %2$s
        END IF;
    ELSIF TG_OP OPERATOR(pg_catalog.=) 'UPDATE' THEN
        v_in_n := %1$s;
        v_in_o := %3$s;
        v_same := %4$s;
        IF v_in_n%5$s THEN
            %6$s
        END IF;
        IF v_in_o AND NOT (v_in_n AND v_same) THEN
            IF NOT v_same THEN
                %7$s
            END IF;
            IF v_same OR NOT v_taken THEN
                %8$s
            END IF;
        END IF;
    ELSIF TG_OP OPERATOR(pg_catalog.=) 'DELETE' THEN
        IF %3$s THEN
            %8$s
        END IF;$f$,
        v_in_n, v_ins, v_in_o, v_same,
        CASE WHEN cardinality(t.table_ignore) > 0
             THEN format(' AND NOT (v_in_o AND %s::pg_catalog.text OPERATOR(pg_catalog.=) %s::pg_catalog.text)',
                         replicator.capture_row_json('new', v_tracked, v_oid), v_old_row)
             ELSE '' END,
        v_upd, v_taken, v_del);
END;
$$;

CREATE OR REPLACE FUNCTION replicator.generate_capture(p_table_id integer, p_function_only boolean DEFAULT false)
RETURNS void
LANGUAGE plpgsql AS $gen$
-- ----------------------------------------------------------------------
-- Function: replicator.generate_capture(p_table_id, p_function_only)
--
--      (Re)creates the capture function and triggers of a captured table.
--
--      Capture is statement-level over transition tables: one INSERT per
--      application statement writes its changed rows into the queue, at
--      most 1000 rows per event, each row encoded as a JSON array in the
--      column order recorded in replicator.captured_table. The column list,
--      key, ignored columns, row filter and mode are baked into the
--      generated SQL: no per-row dynamic SQL. A table with table_capture
--      'row' gets AFTER ROW triggers instead, writing the same events one
--      row at a time (replicator.capture_row_body); TRUNCATE stays a
--      statement trigger.
--
--      Events written (ev_data is a JSON array of items):
--        I  rows inserted (full) / their keys (pk)
--        U  rows updated, new values (full) / their keys (pk); an upsert
--        D  keys deleted; for an UPDATE, the old keys no updated row kept
--           (a key change is a D of the old key and a U of the new row)
--        T  the table was truncated (ev_data NULL)
--      A table with old rows (table_old_rows, full mode only) also
--      writes ev_old for U and D: a JSON array of the items' old rows, in
--      the items' order (a U's null where its key is new: a key change);
--      other events, and other tables, leave it NULL
--      (replicator.capture_chunked_sql says how old rows are paired).
--      A partitioned table or an inheritance parent is captured with its
--      descendants (replicator.capture_tree): the function encodes their
--      rows under this table's id, with this table's columns (by name).
--      A TRUNCATE naming a descendant, or a TRUNCATE ONLY of an inheritance
--      parent, queues no T (it would empty the whole table at targets) but,
--      through replicator.partition_truncated, an S event asking targets
--      to copy the table again.
--      With ignored columns, an updated row is queued only when a captured
--      column changed. With a row filter, rows outside it are not queued;
--      a row updated out of the filter is queued as a D of its key.
--
--      The generated code is shaped for speed (bin/bench-capture measures
--      it; docs/benchmarks.md says what was tried):
--      - a statement of up to 1000 rows is one INSERT ... SELECT with a
--        single aggregate and no projection step (the event table's columns
--        in their order, defaults inlined), written straight into the
--        current partition (no tuple routing; queues of up to 8 event
--        tables); larger statements take the chunked form (row_number() /
--        1000 groups) into the parent;
--      - the current partition is read with pg_sequence_last_value(), a
--        plain expression, not a query;
--      - an UPDATE looks for vanished keys (old keys EXCEPT new keys) only
--        when its keys may have changed: when the old rows' keys, in
--        transition table order, are not the new rows' keys in the same
--        order. Equal lists prove that no old key vanished; PostgreSQL
--        stores the old and new row of each update side by side, so an
--        update that changes no key has equal lists (were the order ever
--        different, the exact form runs: slower, still right). Tables with
--        a row filter or ignored columns always look. The old keys are an
--        ARRAY(SELECT ...) compared with array_agg of the new ones;
--      - the fallbacks are guarded by IF NOT FOUND THEN IF EXISTS (...):
--        NOT FOUND alone is a simple expression, while "NOT FOUND AND
--        EXISTS (...)" would start an executor at every statement;
--      - the output settings are SET on the function only when a captured
--        type needs them (replicator.capture_needs_settings) or the table
--        has a row filter.
--
--      Where DDL is not captured by event triggers (no superuser), a DDL
--      run directly on the table would make the generated SQL fail (a
--      column dropped or renamed) or miss values (a column added): the
--      function first checks, in one catalog lookup, that the table's
--      catalog rows are the ones it was generated for
--      (replicator.capture_guard), and otherwise lets
--      replicator.capture_drift follow the change before capturing; such a
--      function pins the output settings whatever its types, since it may
--      capture columns it was not generated for. A table
--      whose capture is suspended (replicator.suspend_capture) gets a
--      function that captures nothing.
--
-- Parameters:
--      p_table_id        - replicator.captured_table id
--      p_function_only   - replace the function only, keeping the triggers
--                          (no lock on the table: the capture of a table
--                          changed behind it, inside an application's
--                          statement)
-- ----------------------------------------------------------------------
DECLARE
    t replicator.captured_table;
    v_table text;
    v_oid regclass;
    v_fn text := replicator.capture_function(p_table_id);
    v_evtable text;
    v_tracked text[];
    v_filter text;
    v_payload_n text;
    v_payload_o text;
    v_keys_o text;
    v_keys_n text;
    v_cols text;
    v_row text;
    v_guard text;
    v_tag text := '$capture$';
    v_key_n text;
    v_key_o text;
    v_upd text;
    v_body text;
    v_truncate text;
    v_old_full text;
    v_old_u text := 'NULL';
    v_old_d text := 'NULL';
    v_branches text;
    v_settings boolean;
BEGIN
    SELECT * INTO t FROM replicator.captured_table WHERE table_id = p_table_id;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'captured table % does not exist', p_table_id;
    END IF;
    v_table := quote_ident(t.table_schema) || '.' || quote_ident(t.table_name);
    v_oid := to_regclass(v_table);
    IF v_oid IS NULL THEN
        RAISE EXCEPTION 'table % does not exist', v_table;
    END IF;
    IF NOT p_function_only THEN
        PERFORM replicator.create_capture_triggers(p_table_id, v_oid);
    END IF;
    -- What the guard and the ticker compare with (replicator.sync_drifted), read
    -- after the triggers were made; the guard only where no event trigger sees DDL.
    UPDATE replicator.captured_table
    SET (table_catalog_xmins, table_catalog_tids) = (SELECT c.xmins, c.tids FROM replicator.catalog_rows(v_oid) c),
        table_storage = replicator.tree_storage(v_oid),
        table_guarded = NOT replicator.ddl_captured()
    WHERE table_id = p_table_id;
    IF NOT replicator.ddl_captured() THEN
        v_guard := replicator.capture_guard(p_table_id);
    END IF;
    v_evtable := replicator.event_table(t.queue_id);
    v_tracked := ARRAY(SELECT c FROM unnest(t.table_columns) c WHERE c <> ALL (t.table_ignore));
    v_filter := coalesce('(' || t.table_where || ')', 'true');
    v_payload_n := replicator.capture_row_json('n',
        CASE t.table_mode WHEN 'full' THEN v_tracked ELSE t.table_key END, v_oid);
    v_payload_o := replicator.capture_row_json('o', t.table_key, v_oid);
    v_keys_o := (SELECT string_agg('o.' || quote_ident(k), ', ') FROM unnest(t.table_key) k);
    v_keys_n := (SELECT string_agg('n.' || quote_ident(k), ', ') FROM unnest(t.table_key) k);

    SELECT e.cols, e.row_values INTO v_cols, v_row FROM replicator.capture_event_row(t.queue_id, p_table_id) e;
    IF t.table_old_rows AND t.table_mode = 'full' THEN
        -- the fast UPDATE runs only when the old keys are the new keys in the same order:
        -- old_rows read again in that order are the old rows of the items, one by one
        v_old_full := replicator.capture_row_json('o', v_tracked, v_oid);
        v_old_u := format('(SELECT json_agg(%s) FROM old_rows o)', v_old_full);
        v_old_d := 'json_agg(s.o)';
    END IF;

    -- Old keys that no new row kept are looked for only when a key may have
    -- changed (see the header): the fast form of an UPDATE also requires the
    -- list of new keys to be the list of old keys.
    v_upd := replicator.capture_chunked_sql(t, 'UPDATE', 'capture.v_slot') || ';';
    IF t.table_where IS NULL AND cardinality(t.table_ignore) = 0 THEN
        v_key_n := CASE WHEN cardinality(t.table_key) = 1 THEN v_keys_n ELSE 'ROW(' || v_keys_n || ')' END;
        v_key_o := CASE WHEN cardinality(t.table_key) = 1 THEN v_keys_o ELSE 'ROW(' || v_keys_o || ')' END;
        v_upd := format($f$%1$s
        IF NOT FOUND THEN
            IF EXISTS (SELECT FROM new_rows) THEN
                %2$s
            END IF;
        END IF;$f$,
            replicator.capture_fast_insert(t.queue_id, v_cols,
                replace(replace(v_row, '{type}', quote_literal('U')), '{old}', v_old_u),
                format('SELECT %s AS r, %s AS k FROM new_rows n', v_payload_n, v_key_n),
                format(' AND array_agg(s.k) = ARRAY(SELECT %s FROM old_rows o LIMIT 1001)', v_key_o)),
            v_upd);
    END IF;

    v_truncate := format('INSERT INTO %s (%s) VALUES (%s);', v_evtable, v_cols,
        replace(replace(replace(replace(v_row, '{slot}', 'capture.v_slot'), '{type}', quote_literal('T')),
                        'json_agg(s.r)', 'NULL'), '{old}', 'NULL'));
    IF (SELECT relkind FROM pg_class WHERE oid = v_oid) = 'p' THEN
        -- the TRUNCATE trigger is on every partition too: one naming a partition
        -- empties part of the table only
        v_truncate := format(E'ELSIF TG_RELID OPERATOR(pg_catalog.=) %s::pg_catalog.oid THEN\n        %s\n    ELSE\n        PERFORM replicator.partition_truncated(%s);',
                             v_oid::oid, v_truncate, p_table_id);
    ELSIF EXISTS (SELECT 1 FROM pg_inherits WHERE inhparent = v_oid) THEN
        -- an inheritance parent: TRUNCATE ONLY empties it alone (a partitioned
        -- table refuses ONLY), and a TRUNCATE naming a descendant part of it
        v_truncate := format(E'ELSIF TG_RELID OPERATOR(pg_catalog.=) %1$s::pg_catalog.oid AND replicator.tree_truncated(%1$s) THEN\n        %2$s\n'
                             || E'    ELSE\n        PERFORM replicator.partition_truncated(%3$s);',
                             v_oid::oid, v_truncate, p_table_id);
    ELSE
        v_truncate := E'ELSE\n        ' || v_truncate;
    END IF;

    -- A column named like a variable of the function (found, tg_op, v_slot...) is the
    -- column in the row filter and the rows read: the variables SQL reads are qualified.
    IF t.table_capture = 'row' THEN
        v_branches := replicator.capture_row_body(t, v_cols, v_row);
    ELSE
        v_branches := format($f$IF TG_OP = 'INSERT' THEN
        %1$s
        IF NOT FOUND THEN
            IF EXISTS (SELECT FROM new_rows n WHERE %2$s OFFSET 1000) THEN
                %3$s
            END IF;
        END IF;
    ELSIF TG_OP = 'UPDATE' THEN
        %4$s
    ELSIF TG_OP = 'DELETE' THEN
        %5$s
        IF NOT FOUND THEN
            IF EXISTS (SELECT FROM old_rows o WHERE %2$s OFFSET 1000) THEN
                %6$s
            END IF;
        END IF;$f$,
        replicator.capture_fast_insert(t.queue_id, v_cols,
            replace(replace(v_row, '{type}', quote_literal('I')), '{old}', 'NULL'),
            format('SELECT %s AS r FROM new_rows n WHERE %s', v_payload_n, v_filter), ''),
        v_filter,
        replicator.capture_chunked_sql(t, 'INSERT', 'capture.v_slot') || ';',
        v_upd,
        replicator.capture_fast_insert(t.queue_id, v_cols,
            replace(replace(v_row, '{type}', quote_literal('D')), '{old}', v_old_d),
            format('SELECT %s AS r%s FROM old_rows o WHERE %s', v_payload_o,
                   CASE WHEN v_old_full IS NOT NULL THEN ', ' || v_old_full || ' AS o' ELSE '' END, v_filter), ''),
        replicator.capture_chunked_sql(t, 'DELETE', 'capture.v_slot') || ';');
    END IF;
    v_body := format($f$
#variable_conflict use_column
<<capture>>
DECLARE
    v_slot smallint := pg_catalog.pg_sequence_last_value(%1$L::pg_catalog.regclass);
    v_sql pg_catalog.text;%2$s
BEGIN%3$s
    %4$s
    %5$s
    END IF;
    RETURN NULL;
END capture;$f$,
        replicator.event_slot_seq(t.queue_id),
        CASE WHEN t.table_capture = 'row' THEN E'\n    v_in_n boolean;\n    v_in_o boolean;\n    v_same boolean;\n    v_taken boolean;' ELSE '' END,
        CASE WHEN v_guard IS NOT NULL THEN format($g$
    IF %s THEN
        v_sql := replicator.capture_drift(%s, TG_OP);
        IF v_sql IS NOT NULL THEN
            EXECUTE v_sql USING v_slot%s;
        END IF;
        IF TG_OP <> 'TRUNCATE' THEN
            RETURN NULL;
        END IF;
    END IF;$g$, v_guard, p_table_id, CASE WHEN t.table_capture = 'row' THEN ', NEW, OLD' ELSE '' END) ELSE '' END,
        v_branches,
        v_truncate);
    IF t.table_suspended IS NOT NULL THEN
        -- replicator.suspend_capture: nothing is captured until the table is added again
        v_body := E'\nBEGIN\n    RETURN NULL;\nEND;';
    END IF;

    -- a dollar-quote tag that no name or row filter in the body holds
    WHILE position(v_tag IN v_body) > 0 LOOP
        v_tag := '$capture' || length(v_tag) || '$';
    END LOOP;
    -- SECURITY DEFINER: application roles write to the queue only through this function.
    -- Values must not depend on the writer's session (bytea_output = escape,
    -- extra_float_digits <= 0 losing digits, other IntervalStyles): the output settings
    -- are pinned when a captured type's encoding depends on them, or a row filter may, or
    -- the guard may have the function capture a structure it was not made for. A row
    -- filter's literals are read as row_filter_error() checked them, whatever the writer's
    -- session says: strings with standard_conforming_strings on, times in UTC, dates ISO/MDY.
    v_settings := t.table_where IS NOT NULL OR v_guard IS NOT NULL
                  OR replicator.capture_needs_settings(
                         CASE WHEN t.table_mode = 'full' OR cardinality(t.table_ignore) > 0 THEN v_tracked END
                         || t.table_key, v_oid);
    -- A row capture that names everything with its schema runs under the writer's search_path
    -- (replicator.capture_row_closed): setting it costs about 5 us a call, a row's whole capture.
    EXECUTE format($f$
        CREATE OR REPLACE FUNCTION %s() RETURNS trigger
        LANGUAGE plpgsql SECURITY DEFINER%s%s%s
        AS %s%s%s$f$, v_fn,
        CASE WHEN t.table_capture = 'row' AND NOT v_settings AND replicator.capture_row_closed(t) THEN ''
             ELSE ' SET search_path = pg_catalog, pg_temp' END,
        CASE WHEN v_settings
             THEN E'\n        SET bytea_output = ''hex'' SET extra_float_digits = 1 SET IntervalStyle = ''postgres'''
             ELSE '' END,
        CASE WHEN t.table_where IS NOT NULL
             THEN E'\n        SET standard_conforming_strings = on SET TimeZone = ''UTC'' SET DateStyle = ''ISO, MDY'''
             ELSE '' END,
        v_tag, v_body, v_tag);
    EXECUTE format('REVOKE ALL ON FUNCTION %s() FROM PUBLIC', v_fn);

END;
$gen$;

CREATE OR REPLACE FUNCTION replicator.create_capture_triggers(p_table_id integer, p_table regclass)
RETURNS void
LANGUAGE plpgsql AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.create_capture_triggers(p_table_id, p_table)
--
--      Part of replicator.generate_capture(): (re)creates the capture
--      triggers of a captured table and of its descendants, on its capture
--      function (made empty first when it does not exist yet; the caller
--      replaces it in the same transaction).
--
-- Parameters:
--      p_table_id  - replicator.captured_table id
--      p_table     - the captured table
-- ----------------------------------------------------------------------
DECLARE
    v_part regclass;
    v_row boolean := (SELECT table_capture = 'row' FROM replicator.captured_table WHERE table_id = p_table_id);
BEGIN
    IF to_regprocedure(replicator.capture_function(p_table_id) || '()') IS NULL THEN
        EXECUTE format('CREATE FUNCTION %s() RETURNS trigger LANGUAGE plpgsql AS $f$BEGIN RETURN NULL; END;$f$',
                       replicator.capture_function(p_table_id));
        EXECUTE format('REVOKE ALL ON FUNCTION %s() FROM PUBLIC', replicator.capture_function(p_table_id));
    END IF;
    PERFORM replicator.drop_capture_triggers(p_table_id);
    -- A statement fires the statement triggers of the table it names only: a
    -- partitioned table or an inheritance parent needs them on each of its
    -- descendants too, so a write or a TRUNCATE naming one is captured (under
    -- the captured table's id, its columns matched by name: a descendant may
    -- have more columns, in another order). A statement naming the table
    -- fires its own triggers only, whose transition tables hold the changed
    -- rows of every descendant, in the table's row type. A row capture's
    -- triggers fire for each row on the table holding it (no partitioned
    -- table: replicator.check_capture_settings), so the descendants of an
    -- inheritance parent have them too. TRUNCATE is a statement trigger in both.
    FOR v_part IN SELECT d FROM replicator.capture_tree(p_table) d ORDER BY d <> p_table, d LOOP
        IF v_row THEN
            EXECUTE format('CREATE TRIGGER %I AFTER INSERT ON %s FOR EACH ROW EXECUTE PROCEDURE %s()',
                           '_replicator_' || p_table_id || '_ins', v_part, replicator.capture_function(p_table_id));
            EXECUTE format('CREATE TRIGGER %I AFTER UPDATE ON %s FOR EACH ROW EXECUTE PROCEDURE %s()',
                           '_replicator_' || p_table_id || '_upd', v_part, replicator.capture_function(p_table_id));
            EXECUTE format('CREATE TRIGGER %I AFTER DELETE ON %s FOR EACH ROW EXECUTE PROCEDURE %s()',
                           '_replicator_' || p_table_id || '_del', v_part, replicator.capture_function(p_table_id));
            EXECUTE format('CREATE TRIGGER %I AFTER TRUNCATE ON %s FOR EACH STATEMENT EXECUTE PROCEDURE %s()',
                           '_replicator_' || p_table_id || '_trunc', v_part, replicator.capture_function(p_table_id));
            CONTINUE;
        END IF;
        EXECUTE format('CREATE TRIGGER %I AFTER INSERT ON %s REFERENCING NEW TABLE AS new_rows'
                       ' FOR EACH STATEMENT EXECUTE PROCEDURE %s()',
                       '_replicator_' || p_table_id || '_ins', v_part, replicator.capture_function(p_table_id));
        EXECUTE format('CREATE TRIGGER %I AFTER UPDATE ON %s REFERENCING OLD TABLE AS old_rows'
                       ' NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE PROCEDURE %s()',
                       '_replicator_' || p_table_id || '_upd', v_part, replicator.capture_function(p_table_id));
        EXECUTE format('CREATE TRIGGER %I AFTER DELETE ON %s REFERENCING OLD TABLE AS old_rows'
                       ' FOR EACH STATEMENT EXECUTE PROCEDURE %s()',
                       '_replicator_' || p_table_id || '_del', v_part, replicator.capture_function(p_table_id));
        EXECUTE format('CREATE TRIGGER %I AFTER TRUNCATE ON %s FOR EACH STATEMENT EXECUTE PROCEDURE %s()',
                       '_replicator_' || p_table_id || '_trunc', v_part, replicator.capture_function(p_table_id));
    END LOOP;
END;
$$;

CREATE OR REPLACE FUNCTION replicator.drop_capture_triggers(p_table_id integer)
RETURNS void
LANGUAGE plpgsql AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.drop_capture_triggers(p_table_id)
--
--      Drops the capture triggers of a captured table, if the table and
--      the triggers still exist.
-- ----------------------------------------------------------------------
DECLARE
    v_trigger record;
BEGIN
    FOR v_trigger IN
        SELECT tg.tgname, tg.tgrelid::regclass AS tbl
        FROM pg_trigger tg
        WHERE tg.tgname IN ('_replicator_' || p_table_id || '_ins', '_replicator_' || p_table_id || '_upd',
                            '_replicator_' || p_table_id || '_del', '_replicator_' || p_table_id || '_trunc')
          AND tg.tgfoid = to_regprocedure(replicator.capture_function(p_table_id) || '()')
    LOOP
        EXECUTE format('DROP TRIGGER %I ON %s', v_trigger.tgname, v_trigger.tbl);
    END LOOP;
END;
$$;

CREATE OR REPLACE FUNCTION replicator.drop_capture(p_table_id integer)
RETURNS void
LANGUAGE plpgsql AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.drop_capture(p_table_id)
--
--      Removes the capture triggers and the generated function of a
--      captured table. Its events already queued stay in the queue.
-- ----------------------------------------------------------------------
BEGIN
    PERFORM replicator.drop_capture_triggers(p_table_id);
    EXECUTE format('DROP FUNCTION IF EXISTS %s()', replicator.capture_function(p_table_id));
END;
$$;
