CREATE OR REPLACE FUNCTION replicator.find_queue(p_queue_name text)
RETURNS replicator.queue
LANGUAGE plpgsql STABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.find_queue(p_queue_name)
--
--      Looks up a queue by name; the one place that turns an unknown name
--      into a clear error.
--
-- Parameters:
--      p_queue_name    - queue name
--
-- Returns:
--      the queue row; raises 'queue "x" does not exist' when there is none
-- ----------------------------------------------------------------------
DECLARE
    q replicator.queue;
BEGIN
    SELECT * INTO q FROM replicator.queue WHERE queue_name = p_queue_name;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'queue "%" does not exist', p_queue_name
            USING HINT = 'create it with: replicator queue create ' || p_queue_name;
    END IF;
    RETURN q;
END;
$$;
