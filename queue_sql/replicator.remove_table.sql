CREATE OR REPLACE FUNCTION replicator.find_table(p_queue_name text, p_table text)
RETURNS replicator.captured_table
LANGUAGE plpgsql STABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.find_table(p_queue_name, p_table)
--
--      Looks up a table captured by a queue. p_table is 'schema.table' or
--      'table' in SQL syntax, or the name as `table list` shows it
--      (unquoted: 'public.Mixed Case'); a table that was dropped since is
--      still found by its recorded name. Where both match different tables
--      (tables orders and "Orders", p_table 'Orders'), the SQL meaning wins.
--
-- Returns:
--      the captured_table row; raises when the queue does not capture it
-- ----------------------------------------------------------------------
DECLARE
    q replicator.queue := replicator.find_queue(p_queue_name);
    t replicator.captured_table;
    v_oid regclass;
BEGIN
    BEGIN
        v_oid := to_regclass(p_table);
    EXCEPTION WHEN invalid_name OR syntax_error THEN
        v_oid := NULL;   -- not SQL syntax: the recorded name may still match
    END;
    SELECT ct.* INTO t FROM replicator.captured_table ct
    WHERE ct.queue_id = q.queue_id
      AND (to_regclass(quote_ident(ct.table_schema) || '.' || quote_ident(ct.table_name)) = v_oid
           OR ct.table_schema || '.' || ct.table_name = p_table
           OR (ct.table_name = p_table AND ct.table_schema = 'public'))
    ORDER BY to_regclass(quote_ident(ct.table_schema) || '.' || quote_ident(ct.table_name)) = v_oid DESC NULLS LAST
    LIMIT 1;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'table % is not in queue "%"', p_table, p_queue_name;
    END IF;
    RETURN t;
END;
$$;

CREATE OR REPLACE FUNCTION replicator.remove_table(p_queue_name text, p_table text,
                                                    p_drop_from_replicas boolean DEFAULT false)
RETURNS integer
LANGUAGE plpgsql AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.remove_table(p_queue_name, p_table, p_drop_from_replicas)
--
--      Stops capturing a table into a queue: drops its triggers and
--      generated function. Events already queued are still delivered.
--      Replicas keep their copy as it is, no longer updated, unless
--      p_drop_from_replicas: then an S event of kind 'dropped' (as for a
--      DROP TABLE, tag 'TABLE REMOVE') makes consumers drop their copy at
--      that point of the queue, after the changes queued before it.
--      Refused for a table of a schema the queue follows: the next DDL
--      would capture it again.
--
-- Parameters:
--      p_queue_name         - queue
--      p_table              - the captured table (replicator.find_table)
--      p_drop_from_replicas - whether consumers drop their copy
--
-- Returns:
--      the id the table had in the queue
-- ----------------------------------------------------------------------
DECLARE
    t replicator.captured_table := replicator.find_table(p_queue_name, p_table);
BEGIN
    IF EXISTS (SELECT 1 FROM replicator.captured_schema
               WHERE queue_id = t.queue_id AND schema_name = t.table_schema) THEN
        RAISE EXCEPTION 'table %.% is in schema %, which queue "%" follows: the next DDL would capture it again;'
                        ' stop following the schema first (replicator table remove % --schema %)',
                        t.table_schema, t.table_name, t.table_schema, p_queue_name, p_queue_name, t.table_schema;
    END IF;
    IF p_drop_from_replicas THEN
        PERFORM replicator.forget_table(t.table_id, 'TABLE REMOVE', NULL);
    ELSE
        PERFORM replicator.drop_capture(t.table_id);
        DELETE FROM replicator.captured_table WHERE table_id = t.table_id;
    END IF;
    RETURN t.table_id;
END;
$$;
