CREATE OR REPLACE FUNCTION replicator.capture_tree_problems()
RETURNS TABLE (table_id integer, problem text)
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.capture_tree_problems()
--
--      Called by `replicator install` before it regenerates the captures:
--      the captured tables whose capture trees this version refuses
--      (replicator.check_capture_tree). Older versions accepted a
--      partition or an inheritance child captured on its own, and
--      captured inheritance children of followed schemas; the first DDL
--      touching such a tree would now fail. Table names in the messages
--      are schema-qualified (search_path is pinned to pg_catalog).
--
-- Returns:
--      one row per refused captured table: its id and the message of the
--      refusal, which names the way out
-- ----------------------------------------------------------------------
DECLARE
    r record;
BEGIN
    FOR r IN
        SELECT t.table_id, t.table_oid, t.table_key, q.queue_name
        FROM replicator.captured_table t
        JOIN replicator.queue q ON q.queue_id = t.queue_id
        JOIN pg_class c ON c.oid = t.table_oid
        ORDER BY t.table_id
    LOOP
        BEGIN
            PERFORM replicator.check_capture_tree(r.table_oid, r.table_key, r.queue_name, r.table_id);
        EXCEPTION WHEN raise_exception THEN
            table_id := r.table_id;
            problem := SQLERRM;
            RETURN NEXT;
        END;
    END LOOP;
END;
$$;

CREATE OR REPLACE FUNCTION replicator.trees_missing_triggers()
RETURNS integer[]
LANGUAGE sql STABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.trees_missing_triggers()
--
--      Called by `replicator install` before it regenerates the captures:
--      the captured tables with a descendant (replicator.capture_tree)
--      that does not carry their capture triggers. Versions before
--      inheritance trees were captured put them on an inheritance parent
--      alone; a partition created without event triggers outside
--      `replicator execute` has none either. Rows written naming such a
--      descendant were never captured, though targets hold those copied
--      before: once the regenerated capture covers the descendant, targets
--      must copy the table again (replicator.queue_copy_event).
--
-- Returns:
--      replicator.captured_table ids, in order
-- ----------------------------------------------------------------------
    SELECT coalesce(array_agg(t.table_id ORDER BY t.table_id), '{}')
    FROM replicator.captured_table t
    WHERE EXISTS (SELECT 1 FROM pg_class c WHERE c.oid = t.table_oid)
      AND EXISTS (SELECT 1 FROM replicator.capture_tree(t.table_oid) d
                  WHERE d <> t.table_oid
                    AND NOT EXISTS (SELECT 1 FROM pg_trigger tg
                                    WHERE tg.tgrelid = d AND tg.tgname = '_replicator_' || t.table_id || '_ins'));
$$;
