CREATE OR REPLACE FUNCTION replicator.window_event_sql(p_queue_id integer, p_prev_snapshot txid_snapshot,
                                                       p_cur_snapshot txid_snapshot, p_tables integer[] DEFAULT NULL)
RETURNS text
LANGUAGE plpgsql STABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.window_event_sql(p_queue_id, p_prev_snapshot, p_cur_snapshot, p_tables)
--
--      Builds the query returning the events between two ticks' snapshots
--      in ev_id order: those of transactions visible in p_cur_snapshot and
--      not in p_prev_snapshot. Those transactions have a txid either in
--      [prev.xmax, cur.xmax) or in prev's in-progress list, so the query is
--      two index lookups on ev_txid - a range and a list of literals - never
--      a scan of the whole queue; the visibility test in the current
--      snapshot removes transactions still running at the later tick.
--
-- Parameters:
--      p_queue_id      - queue whose event table is read
--      p_prev_snapshot - snapshot of the earlier tick
--      p_cur_snapshot  - snapshot of the later tick
--      p_tables        - only events of these captured table ids (NULL: all)
--
-- Returns:
--      SQL text selecting ev_id, ev_txid, ev_time, ev_type, ev_table, ev_data
-- ----------------------------------------------------------------------
DECLARE
    v_xip text;
    v_tables text := '';
BEGIN
    SELECT string_agg(x::text, ',') INTO v_xip FROM txid_snapshot_xip(p_prev_snapshot) x;
    IF p_tables IS NOT NULL THEN
        v_tables := format(' AND ev_table = ANY (%L::integer[])', p_tables);
    END IF;
    RETURN format(
        'SELECT ev_id, ev_txid, ev_time, ev_type, ev_table, ev_data FROM %s'
        ' WHERE ((ev_txid >= %s AND ev_txid < %s)%s)'
        ' AND txid_visible_in_snapshot(ev_txid, %L)%s'
        ' ORDER BY ev_id',
        replicator.event_table(p_queue_id),
        txid_snapshot_xmax(p_prev_snapshot), txid_snapshot_xmax(p_cur_snapshot),
        CASE WHEN v_xip IS NULL THEN '' ELSE ' OR ev_txid IN (' || v_xip || ')' END,
        p_cur_snapshot, v_tables);
END;
$$;

CREATE OR REPLACE FUNCTION replicator.batch_event_sql(p_batch_id bigint, p_tables integer[] DEFAULT NULL)
RETURNS text
LANGUAGE plpgsql STABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.batch_event_sql(p_batch_id, p_tables)
--
--      Builds the query returning a batch's events in ev_id order: the
--      events between its previous tick and its tick
--      (replicator.window_event_sql()).
--
-- Parameters:
--      p_batch_id  - an open batch of a consumer of the calling role's
--                    (checked by replicator.get_batch_info())
--      p_tables    - only events of these captured table ids (NULL: all)
--
-- Returns:
--      SQL text selecting ev_id, ev_txid, ev_time, ev_type, ev_table, ev_data
-- ----------------------------------------------------------------------
DECLARE
    b record;
BEGIN
    SELECT * INTO b FROM replicator.get_batch_info(p_batch_id);
    RETURN replicator.window_event_sql(b.queue_id, b.prev_snapshot, b.cur_snapshot, p_tables);
END;
$$;
