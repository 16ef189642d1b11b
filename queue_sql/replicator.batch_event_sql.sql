CREATE OR REPLACE FUNCTION replicator.batch_event_sql(p_batch_id bigint, p_tables integer[] DEFAULT NULL)
RETURNS text
LANGUAGE plpgsql STABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.batch_event_sql(p_batch_id, p_tables)
--
--      Builds the query returning a batch's events in ev_id order.
--
--      A batch holds the events of transactions visible in the batch's
--      tick and not in the previous one. Those transactions have a txid
--      either in [prev.xmax, cur.xmax) or in prev's in-progress list, so
--      the query is two index lookups on ev_txid - a range and a list of
--      literals - never a scan of the whole queue; the visibility test in
--      the current snapshot removes transactions still running at the tick.
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
    v_xip text;
    v_tables text := '';
BEGIN
    SELECT * INTO b FROM replicator.get_batch_info(p_batch_id);
    SELECT string_agg(x::text, ',') INTO v_xip FROM txid_snapshot_xip(b.prev_snapshot) x;
    IF p_tables IS NOT NULL THEN
        v_tables := format(' AND ev_table = ANY (%L::integer[])', p_tables);
    END IF;
    RETURN format(
        'SELECT ev_id, ev_txid, ev_time, ev_type, ev_table, ev_data FROM %s'
        ' WHERE ((ev_txid >= %s AND ev_txid < %s)%s)'
        ' AND txid_visible_in_snapshot(ev_txid, %L)%s'
        ' ORDER BY ev_id',
        replicator.event_table(b.queue_id),
        txid_snapshot_xmax(b.prev_snapshot), txid_snapshot_xmax(b.cur_snapshot),
        CASE WHEN v_xip IS NULL THEN '' ELSE ' OR ev_txid IN (' || v_xip || ')' END,
        b.cur_snapshot, v_tables);
END;
$$;
