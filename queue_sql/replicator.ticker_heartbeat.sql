CREATE OR REPLACE FUNCTION replicator.ticker_heartbeat(p_host text, p_pid integer, p_started timestamptz,
                                                       p_every interval)
RETURNS void
LANGUAGE sql AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.ticker_heartbeat(p_host, p_pid, p_started, p_every)
--
--      Records that a ticker daemon is running: its row of
--      replicator.ticker_heartbeat, written again every p_every (the
--      daemon calls this at most that often, not at every pass, so the
--      table gathers one dead tuple per p_every and ticker). Rows of
--      tickers not seen for a day (killed, their host gone) are deleted.
--
-- Parameters:
--      p_host, p_pid - the daemon's host name and process id
--      p_started     - when the daemon started
--      p_every       - how often it calls this (replicator.ticker_info
--                      deems it running while its row is younger than
--                      three of these)
-- ----------------------------------------------------------------------
    DELETE FROM replicator.ticker_heartbeat WHERE ticker_last_seen < now() - interval '1 day';
    INSERT INTO replicator.ticker_heartbeat (ticker_host, ticker_pid, ticker_started, ticker_every, ticker_last_seen)
    VALUES (p_host, p_pid, p_started, p_every, now())
    ON CONFLICT (ticker_host, ticker_pid) DO UPDATE
    SET ticker_started = excluded.ticker_started, ticker_every = excluded.ticker_every,
        ticker_last_seen = excluded.ticker_last_seen;
$$;

CREATE OR REPLACE FUNCTION replicator.ticker_stopped(p_host text, p_pid integer)
RETURNS void
LANGUAGE sql AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.ticker_stopped(p_host, p_pid)
--
--      Removes the heartbeat of a ticker daemon that stops.
-- ----------------------------------------------------------------------
    DELETE FROM replicator.ticker_heartbeat WHERE ticker_host = p_host AND ticker_pid = p_pid;
$$;

CREATE OR REPLACE FUNCTION replicator.ticker_info()
RETURNS TABLE (host text, pid integer, started timestamptz, last_seen timestamptz, running boolean)
LANGUAGE sql STABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.ticker_info()
--
--      The ticker daemons that left a heartbeat in the last day. One is
--      running while its heartbeat is younger than three of its periods
--      (replicator.ticker_heartbeat's p_every: 10 seconds, or its pass
--      interval if longer).
-- ----------------------------------------------------------------------
    SELECT h.ticker_host, h.ticker_pid, h.ticker_started, h.ticker_last_seen,
           clock_timestamp() - h.ticker_last_seen < 3 * h.ticker_every
    FROM replicator.ticker_heartbeat h
    ORDER BY h.ticker_last_seen DESC;
$$;
