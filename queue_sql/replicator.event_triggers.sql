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
        -- (tables a followed schema had before, left by an interrupted follow_schema: a chunk at most)
        PERFORM replicator.follow_new_tables(tg_tag, v_sql, v_created, NULL, replicator.capture_chunk());
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
