CREATE OR REPLACE FUNCTION replicator.table_structure(p_table regclass, p_key text[] DEFAULT NULL)
RETURNS jsonb
LANGUAGE sql STABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.table_structure(p_table, p_key)
--
--      Describes a table as targets need it to create and reconcile their
--      copy: its columns in attnum order and its key.
--
-- Parameters:
--      p_table     - the table
--      p_key       - key columns to report; NULL means the primary key
--
-- Returns:
--      {"schema": .., "name": .., "key": [..], "columns": [{"name", "attnum",
--       "type", "type_oid", "base_type", "category", "not_null", "default"}]}
--      "base_type" is the type with domains resolved and array/enum markers:
--      targets map types from it. "default" is the effective default: the
--      column's own, else its domain's (a nested domain holds a copy of its
--      base domain's default from its creation; PostgreSQL reads only the
--      column type's own), so a column added with a domain that has a
--      default, which fills the existing rows, is not taken for one added
--      as NULL.
-- ----------------------------------------------------------------------
    SELECT jsonb_build_object(
        'schema', n.nspname,
        'name', c.relname,
        'key', coalesce(p_key, (
            SELECT array_agg(a.attname ORDER BY k.ord)
            FROM pg_index i
            CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, ord)
            JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
            WHERE i.indrelid = c.oid AND i.indisprimary), '{}'),
        'columns', coalesce((
            SELECT jsonb_agg(jsonb_build_object(
                'name', a.attname,
                'attnum', a.attnum,
                'type', format_type(a.atttypid, a.atttypmod),
                'type_oid', a.atttypid,
                'base_type', format_type(bt.oid, NULL),
                'category', bt.typcategory,
                'not_null', a.attnotnull,
                'default', coalesce(pg_get_expr(d.adbin, d.adrelid),
                                    (SELECT pg_get_expr(ty.typdefaultbin, 0) FROM pg_type ty
                                     WHERE ty.oid = a.atttypid AND ty.typtype = 'd'))) ORDER BY a.attnum)
            FROM pg_attribute a
            CROSS JOIN LATERAL (
                -- resolve domains to their base type
                WITH RECURSIVE dom(oid, typtype, typbasetype, typcategory, depth) AS (
                    SELECT t.oid, t.typtype, t.typbasetype, t.typcategory, 0
                    FROM pg_type t WHERE t.oid = a.atttypid
                    UNION ALL
                    SELECT t.oid, t.typtype, t.typbasetype, t.typcategory, dom.depth + 1
                    FROM dom JOIN pg_type t ON t.oid = dom.typbasetype
                    WHERE dom.typtype = 'd')
                SELECT oid, typcategory FROM dom ORDER BY depth DESC LIMIT 1) bt
            LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
            WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped), '[]'))
    FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
    WHERE c.oid = p_table;
$$;
