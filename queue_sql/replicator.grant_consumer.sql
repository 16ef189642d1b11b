CREATE OR REPLACE FUNCTION replicator.grant_consumer(p_role text)
RETURNS integer
LANGUAGE plpgsql AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.grant_consumer(p_role)
--
--      Gives a role what a consumer needs and nothing more: read the
--      queues, their events and the captured tables (initial copy, PK-only
--      join-back), with USAGE on the captured tables' schemas. Its
--      position and its ticks go through the consumer functions
--      (register_consumer, next_batch, finish_batch,
--      set_consumer_position, ticker), which run as their owner: the role
--      writes no table of schema replicator, so it cannot forge a tick
--      other consumers would read. Event tables of queues created later are
--      covered by default privileges; tables captured later need the grant
--      again.
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
