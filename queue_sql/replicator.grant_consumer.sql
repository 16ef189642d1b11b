CREATE OR REPLACE FUNCTION replicator.consumer_functions()
RETURNS SETOF regprocedure
LANGUAGE sql STABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.consumer_functions()
--
--      The functions a consumer role may execute: what a consumer daemon
--      (consumer.py, source/), the Spark streaming source (streaming/),
--      `replicator status`, `table list` and `queue unregister` call, and
--      the functions those call as the caller (SQL and PL/pgSQL functions
--      without SECURITY DEFINER check EXECUTE on what they call). Install
--      revokes EXECUTE on every function of schema replicator from PUBLIC;
--      trigger and event trigger functions need none to fire.
--
-- Returns:
--      one row per function
-- ----------------------------------------------------------------------
    SELECT f::regprocedure FROM unnest(ARRAY[
        -- queues and captured tables; rows read back (initial copy, PK-only join-back)
        'replicator.find_queue(text)',
        'replicator.table_info(text)',
        'replicator.table_structure(regclass, text[])',
        'replicator.capture_row_json(text, text[], regclass)',
        -- its own consumers only (SECURITY DEFINER, replicator.check_consumer_owner())
        'replicator.register_consumer(text, text, boolean)',
        'replicator.unregister_consumer(text, text)',
        'replicator.set_consumer_position(text, text, bigint)',
        'replicator.next_batch(text, text, bigint)',
        'replicator.get_batch_info(bigint)',
        'replicator.batch_event_sql(bigint, integer[])',
        'replicator.window_event_sql(integer, txid_snapshot, txid_snapshot, integer[])',
        'replicator.event_table(integer)',
        'replicator.finish_batch(bigint)',
        'replicator.set_consumer_copy(text, text, text, bigint, bigint)',
        -- forced ticks: the initial copy's durable tick, consume --until-caught-up
        'replicator.ticker(text, boolean)',
        -- status, table list; the Spark streaming source reads event ids
        'replicator.queue_info()',
        'replicator.current_slot(integer)',
        'replicator.event_slot_seq(integer)',
        'replicator.last_event_id(integer)',
        'replicator.event_id_seq(integer)',
        'replicator.consumer_info()',
        'replicator.consumer_idle(replicator.consumer)',
        'replicator.consumer_connected(replicator.consumer)',
        'replicator.ticker_info()',
        'replicator.consumer_copy_info()',
        'replicator.schema_info(text)',
        'replicator.statement_sizes(text, integer)',
        'replicator.event_partition(integer, integer)',
        'replicator.rotation_blockers(text)',
        'replicator.txid_horizon()'
    ]) f;
$$;

CREATE OR REPLACE FUNCTION replicator.grant_consumer_functions(p_role text)
RETURNS void
LANGUAGE plpgsql AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.grant_consumer_functions(p_role)
--
--      Grants EXECUTE on replicator.consumer_functions() to a role. Called
--      by replicator.grant_consumer(), and by install for every role with
--      USAGE on schema replicator: install creates the functions anew,
--      which drops their grants.
--
-- Parameters:
--      p_role      - an existing role
-- ----------------------------------------------------------------------
DECLARE
    v_function regprocedure;
BEGIN
    FOR v_function IN SELECT * FROM replicator.consumer_functions() LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO %I', v_function, p_role);
    END LOOP;
END;
$$;

CREATE OR REPLACE FUNCTION replicator.grant_consumer(p_role text)
RETURNS integer
LANGUAGE plpgsql AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.grant_consumer(p_role)
--
--      Gives a role what a consumer needs and nothing more: read the
--      queues, their events and the captured tables (initial copy, PK-only
--      join-back), with USAGE on the captured tables' schemas, and execute
--      replicator.consumer_functions(). Its position and its ticks go
--      through the consumer functions (register_consumer, next_batch,
--      finish_batch, set_consumer_position, ticker), which run as their
--      owner and act on the role's own consumers only: the role writes no
--      table of schema replicator, so it cannot forge a tick other
--      consumers would read, nor move, read or unregister another role's
--      consumer. Event tables of queues created later are covered by
--      default privileges; tables captured later need the grant again.
--
-- Parameters:
--      p_role      - an existing role
--
-- Returns:
--      the number of captured tables the role may now read
-- ----------------------------------------------------------------------
DECLARE
    v_table regclass;
    v_schema name;
    v_count integer := 0;
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = p_role) THEN
        RAISE EXCEPTION 'role "%" does not exist', p_role;
    END IF;
    EXECUTE format('GRANT USAGE ON SCHEMA replicator TO %I', p_role);
    EXECUTE format('GRANT SELECT ON ALL TABLES IN SCHEMA replicator TO %I', p_role);
    EXECUTE format('GRANT SELECT ON ALL SEQUENCES IN SCHEMA replicator TO %I', p_role);
    EXECUTE format('ALTER DEFAULT PRIVILEGES IN SCHEMA replicator GRANT SELECT ON TABLES TO %I', p_role);
    EXECUTE format('ALTER DEFAULT PRIVILEGES IN SCHEMA replicator GRANT SELECT ON SEQUENCES TO %I', p_role);
    PERFORM replicator.grant_consumer_functions(p_role);
    -- Granted by earlier versions, before the consumer functions ran as their owner.
    EXECUTE format('REVOKE INSERT, UPDATE, DELETE ON replicator.consumer, replicator.tick FROM %I', p_role);
    EXECUTE format('REVOKE USAGE ON replicator.batch_id_seq, replicator.consumer_consumer_id_seq FROM %I', p_role);
    FOR v_schema IN SELECT DISTINCT n.nspname FROM replicator.captured_table ct
                    JOIN pg_class c ON c.oid = ct.table_oid JOIN pg_namespace n ON n.oid = c.relnamespace LOOP
        EXECUTE format('GRANT USAGE ON SCHEMA %I TO %I', v_schema, p_role);
    END LOOP;
    FOR v_table IN SELECT DISTINCT table_oid::regclass FROM replicator.captured_table
                   WHERE to_regclass(table_oid::regclass::text) IS NOT NULL LOOP
        EXECUTE format('GRANT SELECT ON %s TO %I', v_table, p_role);
        v_count := v_count + 1;
    END LOOP;
    RETURN v_count;
END;
$$;
