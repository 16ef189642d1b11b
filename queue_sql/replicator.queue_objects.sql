CREATE OR REPLACE FUNCTION replicator.event_table(p_queue_id integer)
RETURNS text
LANGUAGE sql IMMUTABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.event_table(p_queue_id)
--
--      Name of a queue's partitioned event table, quoted and qualified.
--
-- Returns:
--      'replicator.event_<queue_id>'
-- ----------------------------------------------------------------------
    SELECT 'replicator.' || quote_ident('event_' || p_queue_id);
$$;

CREATE OR REPLACE FUNCTION replicator.event_partition(p_queue_id integer, p_slot integer)
RETURNS text
LANGUAGE sql IMMUTABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.event_partition(p_queue_id, p_slot)
--
--      Name of one insert-only partition of a queue's event table.
--
-- Returns:
--      'replicator.event_<queue_id>_<slot>'
-- ----------------------------------------------------------------------
    SELECT 'replicator.' || quote_ident('event_' || p_queue_id || '_' || p_slot);
$$;

CREATE OR REPLACE FUNCTION replicator.event_id_seq(p_queue_id integer)
RETURNS text
LANGUAGE sql IMMUTABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.event_id_seq(p_queue_id)
--
--      The queue's event sequence: DML and DDL events both take their ev_id
--      from it, which orders schema changes among row changes.
-- ----------------------------------------------------------------------
    SELECT 'replicator.' || quote_ident('event_' || p_queue_id || '_id_seq');
$$;

CREATE OR REPLACE FUNCTION replicator.event_slot_seq(p_queue_id integer)
RETURNS text
LANGUAGE sql IMMUTABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.event_slot_seq(p_queue_id)
--
--      The sequence whose last_value is the partition writers insert into.
--      A sequence and not a column of replicator.queue: reading it is not
--      subject to MVCC, so a writer in a REPEATABLE READ transaction sees a
--      rotation at once (see replicator.maint_rotate_step1).
-- ----------------------------------------------------------------------
    SELECT 'replicator.' || quote_ident('event_' || p_queue_id || '_slot');
$$;

CREATE OR REPLACE FUNCTION replicator.current_slot(p_queue_id integer)
RETURNS integer
LANGUAGE plpgsql STABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.current_slot(p_queue_id)
--
--      The partition number events are written into now.
-- ----------------------------------------------------------------------
DECLARE
    v_slot integer;
BEGIN
    EXECUTE 'SELECT last_value FROM ' || replicator.event_slot_seq(p_queue_id) INTO v_slot;
    RETURN v_slot;
END;
$$;

CREATE OR REPLACE FUNCTION replicator.last_event_id(p_queue_id integer)
RETURNS bigint
LANGUAGE plpgsql STABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.last_event_id(p_queue_id)
--
--      The last ev_id handed out by the queue's event sequence (0 if none);
--      used to count events between ticks without reading event tables.
-- ----------------------------------------------------------------------
DECLARE
    v_last bigint;
    v_called boolean;
BEGIN
    EXECUTE 'SELECT last_value, is_called FROM ' || replicator.event_id_seq(p_queue_id)
        INTO v_last, v_called;
    RETURN CASE WHEN v_called THEN v_last ELSE v_last - 1 END;
END;
$$;
