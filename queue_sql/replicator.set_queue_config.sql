CREATE OR REPLACE FUNCTION replicator.set_queue_config(p_queue_name text, p_param text, p_value text)
RETURNS void
LANGUAGE plpgsql AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.set_queue_config(p_queue_name, p_param, p_value)
--
--      Changes one setting of a queue; the ticker and maintenance use it
--      from their next pass.
--
-- Parameters:
--      p_queue_name - queue
--      p_param      - ticker_max_count (events that make a tick due),
--                     ticker_max_lag (time after which pending events make a
--                     tick due), ticker_idle_period (time after which a tick
--                     is made without events), rotation_period (how long
--                     an event table is written before the next one) or
--                     consumer_idle_limit (how long a consumer may go unseen
--                     before status and maint call it idle, and maint
--                     unregisters it if it is temporary)
--      p_value      - the new value, as text: an integer, or an interval
-- ----------------------------------------------------------------------
DECLARE
    q replicator.queue := replicator.find_queue(p_queue_name);
    v_interval interval;
BEGIN
    IF p_param = 'ticker_max_count' THEN
        IF p_value !~ '^\s*[0-9]+\s*$' OR p_value::bigint NOT BETWEEN 1 AND 2147483647 THEN
            RAISE EXCEPTION 'ticker_max_count must be a positive integer, not %', p_value;
        END IF;
        UPDATE replicator.queue SET queue_ticker_max_count = p_value::integer WHERE queue_id = q.queue_id;
        RETURN;
    END IF;
    IF p_param NOT IN ('ticker_max_lag', 'ticker_idle_period', 'rotation_period', 'consumer_idle_limit') THEN
        RAISE EXCEPTION 'unknown queue setting "%": use ticker_max_count, ticker_max_lag, ticker_idle_period, '
            'rotation_period or consumer_idle_limit',
            p_param;
    END IF;
    BEGIN
        v_interval := p_value::interval;
    EXCEPTION WHEN invalid_datetime_format OR datetime_field_overflow OR interval_field_overflow THEN
        RAISE EXCEPTION '% must be an interval such as ''3 seconds'', not %', p_param, p_value;
    END;
    IF v_interval <= interval '0' THEN
        RAISE EXCEPTION '% must be positive, not %', p_param, p_value;
    END IF;
    IF p_param = 'ticker_max_lag' THEN
        UPDATE replicator.queue SET queue_ticker_max_lag = v_interval WHERE queue_id = q.queue_id;
    ELSIF p_param = 'ticker_idle_period' THEN
        UPDATE replicator.queue SET queue_ticker_idle_period = v_interval WHERE queue_id = q.queue_id;
    ELSIF p_param = 'rotation_period' THEN
        UPDATE replicator.queue SET queue_rotation_period = v_interval WHERE queue_id = q.queue_id;
    ELSE
        UPDATE replicator.queue SET queue_consumer_idle_limit = v_interval WHERE queue_id = q.queue_id;
    END IF;
END;
$$;
