CREATE OR REPLACE FUNCTION replicator.warned(p_relation oid)
RETURNS boolean
LANGUAGE sql STABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.warned(p_relation)
--
--      Whether replicator.warn_once has warned about the relation in this
--      transaction (setting replicator.warned): under `replicator
--      execute`, later statements of a script skip the work that would
--      only lead to the same warning.
--
-- Parameters:
--      p_relation  - the relation
--
-- Returns:
--      true if a warning about it was raised in this transaction
-- ----------------------------------------------------------------------
    SELECT coalesce(p_relation::text = ANY (string_to_array(current_setting('replicator.warned', true), ',')),
                    false);
$$;

CREATE OR REPLACE FUNCTION replicator.warn_once(p_relation oid, p_message text)
RETURNS void
LANGUAGE plpgsql AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.warn_once(p_relation, p_message)
--
--      Raises p_message as a WARNING, unless one was raised about the
--      relation before in this transaction (under `replicator execute`,
--      every statement of a script looks at the relations it touched so
--      far).
--
-- Parameters:
--      p_relation  - the relation the warning is about
--      p_message   - the warning
-- ----------------------------------------------------------------------
BEGIN
    IF replicator.warned(p_relation) THEN
        RETURN;
    END IF;
    RAISE WARNING '%', p_message;
    PERFORM set_config('replicator.warned',
                       concat_ws(',', nullif(current_setting('replicator.warned', true), ''), p_relation::text), true);
END;
$$;
