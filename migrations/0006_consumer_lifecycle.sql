-- 0006_consumer_lifecycle: consumers that come and go, and a ticker that is seen.
--
-- A temporary consumer (`replicator consume` streaming to stdout without --consumer) is
-- registered for one run and unregistered when it ends; one whose process was killed is
-- unregistered by maint once idle past its queue's consumer_idle_limit
-- (replicator.drop_idle_temporary_consumers). Durable consumers are never unregistered
-- automatically: past the limit they are reported idle (status, maint), nothing more.
--
-- Each running ticker daemon keeps a row of replicator.ticker_heartbeat (written through
-- replicator.ticker_heartbeat(), at most every few seconds, not at every pass: the source
-- must not collect a dead tuple per tick interval), so that status can tell a dead ticker
-- from a consumer that falls behind.

ALTER TABLE replicator.consumer ADD COLUMN consumer_temporary boolean NOT NULL DEFAULT false;

-- The session that registered the consumer last (its daemon registers it at every connect):
-- while that session is connected, the consumer is not idle (replicator.consumer_connected).
-- pid, session user and application_name are what pg_stat_activity shows every role.
ALTER TABLE replicator.consumer ADD COLUMN consumer_pid integer;
ALTER TABLE replicator.consumer ADD COLUMN consumer_usesysid oid;
ALTER TABLE replicator.consumer ADD COLUMN consumer_application_name text;

-- A stream to stdout of the previous version registered a durable consumer named after its
-- target, `jsonl:-` or `tsv:-` (the first 8 hex digits of its SHA-1): that command now registers
-- a temporary consumer of its own per run, so nothing resumes these any more. Temporary, they
-- are unregistered by maint once idle instead of holding back rotation forever. Only those two
-- names: a file target named `stdout` has a name of the same shape and stays durable.
UPDATE replicator.consumer SET consumer_temporary = true
WHERE consumer_name IN ('jsonl_stdout_9a4232c3', 'tsv_stdout_78816dd4');

ALTER TABLE replicator.queue ADD COLUMN queue_consumer_idle_limit interval NOT NULL DEFAULT '1 hour';

CREATE TABLE replicator.ticker_heartbeat (
    ticker_host      text NOT NULL,
    ticker_pid       integer NOT NULL,
    ticker_started   timestamptz NOT NULL,
    -- how often this ticker writes its row: it is running while its row is younger than a few of these
    ticker_every     interval NOT NULL,
    ticker_last_seen timestamptz NOT NULL,
    PRIMARY KEY (ticker_host, ticker_pid)
);
