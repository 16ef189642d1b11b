CREATE OR REPLACE FUNCTION replicator.partition_truncated(p_table_id integer)
RETURNS void
LANGUAGE plpgsql AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.partition_truncated(p_table_id)
--
--      Called by the capture function of a captured partitioned table or
--      inheritance parent when a TRUNCATE emptied part of it only: one
--      naming a descendant (a partition, an inheritance child), or a
--      TRUNCATE ONLY of the inheritance parent (replicator.tree_truncated
--      false). Those rows left without a row trigger firing, and a T
--      event would empty the whole table at targets: queues instead an S
--      event (kind 'altered', "copy": true), in the truncating transaction
--      and from the queue's sequence, so targets copy the table again
--      within the snapshot rules of the initial copy.
--
--      Nothing is queued when the copy would be redundant: when this
--      transaction already queued a copy of the table that replaces the
--      rows targets hold, not one of a rewrite ("rows_kept"; targets copy it
--      after the transaction committed, and skip its events), or when its
--      latest event of the table is a T (the whole table was truncated:
--      a TRUNCATE of a partitioned table or inheritance parent fires the
--      triggers of its descendants after its own, and nothing was written
--      since).
--
-- Parameters:
--      p_table_id  - replicator.captured_table id of the truncated table's
--                    captured ancestor
-- ----------------------------------------------------------------------
DECLARE
    v_queue integer;
    v_events text;
    v_last "char";
    v_copied boolean := false;
BEGIN
    SELECT queue_id INTO v_queue FROM replicator.captured_table WHERE table_id = p_table_id;
    v_events := replicator.event_table(v_queue);
    -- The events of this transaction only, found through the index on ev_txid (an
    -- index naming ev_table too would cost every captured write). The latest first:
    -- a TRUNCATE of the whole tree calls this once per descendant, each time right
    -- after the T. Neither query aggregates: the first keeps the newest event of the
    -- table, the second stops at its first copy, and runs only when the transaction
    -- has events of the table.
    EXECUTE format('SELECT ev_type FROM %s WHERE ev_txid = txid_current() AND ev_table = $1'
                   ' ORDER BY ev_id DESC LIMIT 1', v_events)
        INTO v_last USING p_table_id;
    IF v_last = 'T' THEN
        RETURN;
    END IF;
    IF v_last IS NOT NULL THEN
        EXECUTE format('SELECT EXISTS (SELECT 1 FROM %s WHERE ev_txid = txid_current() AND ev_table = $1'
                       ' AND ev_type = ''S'' AND ev_data->>''copy'' = ''true'' AND ev_data->>''rows_kept'' IS NULL)',
                       v_events)
            INTO v_copied USING p_table_id;
    END IF;
    IF v_copied THEN
        RETURN;
    END IF;
    PERFORM replicator.queue_copy_event(p_table_id, 'TRUNCATE TABLE', current_query());
END;
$$;

CREATE OR REPLACE FUNCTION replicator.tree_truncated(p_table oid)
RETURNS boolean
LANGUAGE sql VOLATILE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.tree_truncated(p_table)
--
--      Called by the TRUNCATE trigger of a captured inheritance parent
--      (AFTER: every table the statement truncated is empty by then), which
--      cannot tell TRUNCATE from TRUNCATE ONLY: whether the table and every
--      descendant (replicator.capture_tree) hold no row at all, so that a T
--      event leaves targets as the source. Each must have an empty main fork
--      (no tuple of any transaction, committed or not) and be locked ACCESS
--      EXCLUSIVE by this session, as TRUNCATE locks what it empties: nobody
--      else writes into it before this transaction ends, so no event of
--      another transaction can slip in before the T. A descendant TRUNCATE
--      ONLY left alone is not locked so (or not empty): the caller then asks
--      for a copy instead (replicator.partition_truncated).
--
-- Parameters:
--      p_table     - the captured inheritance parent
--
-- Returns:
--      true when the whole tree is empty and held by this session
-- ----------------------------------------------------------------------
    SELECT bool_and(pg_relation_size(d) = 0 AND EXISTS (
               SELECT 1 FROM pg_locks l
               WHERE l.locktype = 'relation' AND l.relation = d AND l.pid = pg_backend_pid()
                 AND l.mode = 'AccessExclusiveLock' AND l.granted
                 AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())))
    FROM replicator.capture_tree(p_table) d;
$$;
