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
    RETURN v_count + replicator.follow_new_tables(p_tag, p_sql, v_touched, NULL, replicator.capture_chunk());
END;
$$;
