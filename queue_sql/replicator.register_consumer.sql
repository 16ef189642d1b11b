CREATE OR REPLACE FUNCTION replicator.session_role()
RETURNS name
LANGUAGE sql STABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.session_role()
--
--      The role a consumer function acts for. Inside a SECURITY DEFINER
--      function current_user is the function's owner, so the caller is
--      taken from the session: the role of SET ROLE (PostgreSQL checks at
--      SET ROLE that the session user may become it), else the session
--      user. A SECURITY DEFINER function of the caller's own still acts
--      for the session's role, never for its owner.
--
-- Returns:
--      a role name
-- ----------------------------------------------------------------------
    SELECT CASE current_setting('role') WHEN 'none' THEN session_user ELSE current_setting('role')::name END;
$$;

CREATE OR REPLACE FUNCTION replicator.check_consumer_owner(p_consumer replicator.consumer)
RETURNS void
LANGUAGE plpgsql STABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.check_consumer_owner(p_consumer)
--
--      Refuses a consumer to any role but its owner: the role that
--      registered it (replicator.session_role() then), a member of that
--      role, the owner of schema replicator or a member of it, and
--      superusers (members of every role for pg_has_role). Moving another
--      role's consumer would make its target skip or repeat events.
--
-- Parameters:
--      p_consumer  - a row of replicator.consumer
--
-- Returns:
--      nothing; raises insufficient_privilege naming the consumer, its
--      owner and the ways out
-- ----------------------------------------------------------------------
DECLARE
    v_caller name := replicator.session_role();
    v_queue text;
BEGIN
    IF pg_has_role(v_caller, (SELECT nspowner FROM pg_namespace WHERE nspname = 'replicator'), 'MEMBER') THEN
        RETURN;
    END IF;
    -- an owner dropped since leaves its consumers to the owner of schema replicator
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = p_consumer.consumer_owner)
       AND pg_has_role(v_caller, p_consumer.consumer_owner, 'MEMBER') THEN
        RETURN;
    END IF;
    SELECT queue_name INTO v_queue FROM replicator.queue WHERE queue_id = p_consumer.queue_id;
    RAISE EXCEPTION USING ERRCODE = 'insufficient_privilege', MESSAGE = format(
        'consumer "%s" of queue "%s" belongs to role "%s", not "%s": connect as "%s", or use another consumer '
        'name; the owner of schema replicator can give it to "%s" with: replicator queue owner %s %s %s',
        p_consumer.consumer_name, v_queue, p_consumer.consumer_owner, v_caller, p_consumer.consumer_owner,
        v_caller, v_queue, p_consumer.consumer_name, v_caller);
END;
$$;

CREATE OR REPLACE FUNCTION replicator.register_consumer(p_queue_name text, p_consumer_name text,
                                                        p_temporary boolean DEFAULT false)
RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.register_consumer(p_queue_name, p_consumer_name, p_temporary)
--
--      Subscribes a consumer to a queue. A new consumer starts at the
--      queue's latest tick (a tick is made if the queue has none): it
--      receives the events of transactions not visible in that tick, and
--      belongs to the calling role (replicator.session_role()).
--      Registering a name another role owns is refused
--      (replicator.check_consumer_owner()). Registering again keeps the
--      position; a durable registration of a temporary consumer (a name
--      copied from status, given to --consumer) makes it durable, and a
--      temporary registration of a durable consumer is refused (a temporary
--      run's name has a random token of its own: it never meets a durable
--      one by accident). Every registration records the calling session
--      (pid, role, application_name, as pg_stat_activity shows them): while it is connected, the
--      consumer is not idle (replicator.consumer_connected); a daemon
--      registers at every connect.
--
-- Parameters:
--      p_temporary - a consumer for one run (a stream to stdout): its
--                    process unregisters it when it ends, and maint once it
--                    is idle (replicator.drop_idle_temporary_consumers)
--
-- Returns:
--      the consumer's last tick
-- ----------------------------------------------------------------------
DECLARE
    q replicator.queue := replicator.find_queue(p_queue_name);
    c replicator.consumer;
    v_tick bigint;
    v_usesysid oid;
    v_application_name text;
BEGIN
    IF p_consumer_name IS NULL OR p_consumer_name = '' THEN
        RAISE EXCEPTION 'consumer name must not be empty';
    END IF;
    -- as pg_stat_activity shows this session to others (after SET SESSION AUTHORIZATION too)
    SELECT usesysid, application_name INTO v_usesysid, v_application_name
    FROM pg_stat_activity WHERE pid = pg_backend_pid();
    SELECT * INTO c FROM replicator.consumer
    WHERE queue_id = q.queue_id AND consumer_name = p_consumer_name FOR UPDATE;
    IF FOUND THEN
        PERFORM replicator.check_consumer_owner(c);
        IF coalesce(p_temporary, false) AND NOT c.consumer_temporary THEN
            RAISE EXCEPTION 'consumer "%" of queue "%" is durable: a run for once cannot take it; give it to '
                            '--consumer to resume it', p_consumer_name, p_queue_name;
        END IF;
        UPDATE replicator.consumer
        SET consumer_temporary = consumer_temporary AND coalesce(p_temporary, false),
            consumer_pid = pg_backend_pid(), consumer_usesysid = v_usesysid,
            consumer_application_name = v_application_name
        WHERE consumer_id = c.consumer_id;
        RETURN c.last_tick;
    END IF;
    SELECT max(tick_id) INTO v_tick FROM replicator.tick WHERE tick_queue = q.queue_id;
    IF v_tick IS NULL THEN
        v_tick := replicator.ticker(p_queue_name, true);
    END IF;
    IF v_tick IS NULL THEN
        -- Another ticker holds the queue and is making its first tick: wait for it.
        PERFORM FROM replicator.queue WHERE queue_id = q.queue_id FOR NO KEY UPDATE;
        SELECT max(tick_id) INTO v_tick FROM replicator.tick WHERE tick_queue = q.queue_id;
        IF v_tick IS NULL THEN
            v_tick := replicator.ticker(p_queue_name, true);
        END IF;
    END IF;
    INSERT INTO replicator.consumer (queue_id, consumer_name, last_tick, consumer_owner, consumer_temporary,
                                     consumer_pid, consumer_usesysid, consumer_application_name)
    VALUES (q.queue_id, p_consumer_name, v_tick, replicator.session_role(), coalesce(p_temporary, false),
            pg_backend_pid(), v_usesysid, v_application_name)
    ON CONFLICT (queue_id, consumer_name) DO NOTHING;
    -- another session may have registered the name meanwhile: the owner check decides
    c := replicator.find_consumer(p_queue_name, p_consumer_name);
    RETURN c.last_tick;
END;
$$;

CREATE OR REPLACE FUNCTION replicator.unregister_consumer(p_queue_name text, p_consumer_name text)
RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.unregister_consumer(p_queue_name, p_consumer_name)
--
--      Removes a consumer of the calling role's (see
--      replicator.check_consumer_owner()); it no longer holds back
--      rotation.
--
-- Returns:
--      true if the consumer existed
-- ----------------------------------------------------------------------
DECLARE
    q replicator.queue := replicator.find_queue(p_queue_name);
    c replicator.consumer;
BEGIN
    SELECT * INTO c FROM replicator.consumer
    WHERE queue_id = q.queue_id AND consumer_name = p_consumer_name FOR UPDATE;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    PERFORM replicator.check_consumer_owner(c);
    DELETE FROM replicator.consumer WHERE consumer_id = c.consumer_id;
    RETURN true;
END;
$$;

CREATE OR REPLACE FUNCTION replicator.find_consumer(p_queue_name text, p_consumer_name text)
RETURNS replicator.consumer
LANGUAGE plpgsql AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.find_consumer(p_queue_name, p_consumer_name)
--
--      Looks up and locks a consumer row of the calling role's (see
--      replicator.check_consumer_owner()).
--
-- Returns:
--      the consumer row; raises when it is not registered or belongs to
--      another role
-- ----------------------------------------------------------------------
DECLARE
    q replicator.queue := replicator.find_queue(p_queue_name);
    c replicator.consumer;
BEGIN
    SELECT * INTO c FROM replicator.consumer
    WHERE queue_id = q.queue_id AND consumer_name = p_consumer_name FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'consumer "%" is not registered on queue "%"', p_consumer_name, p_queue_name;
    END IF;
    PERFORM replicator.check_consumer_owner(c);
    RETURN c;
END;
$$;

CREATE OR REPLACE FUNCTION replicator.set_consumer_owner(p_queue_name text, p_consumer_name text, p_role text)
RETURNS void
LANGUAGE plpgsql AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.set_consumer_owner(p_queue_name, p_consumer_name, p_role)
--
--      Gives a consumer to another role: a consumer registered before
--      owners were recorded (owned by the owner of schema replicator), or
--      one whose replica a new role runs. Runs as the caller and updates
--      replicator.consumer, so only the owner of schema replicator (and
--      superusers) can; no role is granted it.
--
-- Parameters:
--      p_role      - an existing role, the consumer's new owner
-- ----------------------------------------------------------------------
DECLARE
    c replicator.consumer := replicator.find_consumer(p_queue_name, p_consumer_name);
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = p_role) THEN
        RAISE EXCEPTION 'role "%" does not exist', p_role;
    END IF;
    UPDATE replicator.consumer SET consumer_owner = p_role WHERE consumer_id = c.consumer_id;
END;
$$;
