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
            RAISE EXCEPTION 'this statement breaks the row filter of %.% (%): change the filter first (replicator table alter % % --where ... or --no-where), then run the statement again',
                r.nspname, r.relname, v_error, r.queue_name, format('%I.%I', r.nspname, r.relname)
                USING HINT = 'change the filter first with replicator table alter --where or --no-where';
        END IF;
    END LOOP;
END;
$$;
