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
