CREATE OR REPLACE FUNCTION replicator.triggered_tree(p_table_id integer)
RETURNS oid[]
LANGUAGE sql STABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.triggered_tree(p_table_id)
--
--      The tables that carry a captured table's capture triggers, its
--      descendants when its capture was generated, in oid order.
--
-- Parameters:
--      p_table_id  - replicator.captured_table id
--
-- Returns:
--      their oids
-- ----------------------------------------------------------------------
    -- Found from the capture function's dependents, by pg_depend's index on what they depend
    -- on: pg_trigger has no index on tgname, and a scan of every trigger (or of every trigger's
    -- dependency, pg_depend's other index: hence the class compared in the join) per table made
    -- a ticker's pass quadratic in tables.
    SELECT ARRAY(SELECT tg.tgrelid
                 FROM pg_depend d JOIN pg_trigger tg ON tg.oid = d.objid AND tg.tableoid = d.classid
                 WHERE d.refclassid = 'pg_proc'::regclass
                   AND d.refobjid = to_regprocedure(replicator.capture_function(p_table_id) || '()')
                   AND tg.tgname = '_replicator_' || p_table_id || '_ins'
                 ORDER BY tg.tgrelid);
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
    v_triggered := replicator.triggered_tree(p_table_id);
    IF v_tree = v_triggered THEN   -- (as replicator.drifted_tables compares them)
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
