CREATE OR REPLACE FUNCTION replicator.follow_new_tables(p_tag text, p_sql text, p_new oid[] DEFAULT '{}',
                                                        p_queue_id integer DEFAULT NULL, p_limit integer DEFAULT NULL)
RETURNS integer
LANGUAGE plpgsql AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.follow_new_tables(p_tag, p_sql, p_new, p_queue_id, p_limit)
--
--      Captures the tables of followed schemas that are not captured yet
--      (created since), queueing an S event of kind 'created' for each.
--      Rows a CREATE TABLE AS put in before capture began reach consumers
--      through their initial copy of the new table.
--
--      Partitions and inheritance children are not looked at: their rows
--      are their root's (replicator.capture_tree), captured with it when
--      the queue captures the root; when it does not, a child cannot be
--      captured on its own (replicator.check_capture_tree). Such a child
--      among p_new gets a warning saying why, once: it is never retried.
--
-- Parameters:
--      p_tag       - command tag of the statement
--      p_sql       - its text
--      p_new       - relations the statement created or touched (or, for
--                    replicator.follow_schema, the schema's tables): a
--                    table among them that the queue cannot capture is
--                    warned about; others are retried silently
--      p_queue_id  - only this queue's followed schemas (NULL: every queue's)
--      p_limit     - capture at most this many (NULL: all), those of p_new
--                    first; the others are left to the next call
--
-- Returns:
--      the number of tables now captured
-- ----------------------------------------------------------------------
DECLARE
    r record;
    v_id integer;
    v_count integer := 0;
BEGIN
    FOR r IN
        SELECT q.queue_name, s.schema_name, s.schema_mode, c.oid, c.relname,
               EXISTS (SELECT 1 FROM pg_index WHERE indrelid = c.oid AND indisprimary) AS has_primary_key
        FROM replicator.captured_schema s
        JOIN replicator.queue q ON q.queue_id = s.queue_id
        JOIN pg_namespace n ON n.nspname = s.schema_name
        JOIN pg_class c ON c.relnamespace = n.oid AND c.relkind IN ('r', 'p') AND NOT c.relispartition
        WHERE NOT EXISTS (SELECT 1 FROM replicator.captured_table t
                          WHERE t.queue_id = s.queue_id AND t.table_oid = c.oid)
          AND NOT EXISTS (SELECT 1 FROM pg_inherits h WHERE h.inhrelid = c.oid)
          AND (p_queue_id IS NULL OR s.queue_id = p_queue_id)
        ORDER BY c.oid <> ALL (p_new), c.oid   -- the statement's own tables first (p_limit)
    LOOP
        EXIT WHEN v_count = p_limit;
        -- Tables refused are tried again at every DDL (one may have gained a column),
        -- but warned about only by the statement that made or touched them.
        IF cardinality(replicator.comparable_columns(r.oid)) = 0 THEN
            IF r.oid = ANY (p_new) THEN
                PERFORM replicator.warn_once(r.oid, format(
                    'replicator: %s.%s has no column usable as a key and is not captured', r.schema_name, r.relname));
            END IF;
            CONTINUE;
        END IF;
        -- A keyless table is captured whole (full mode): rows without a reliable key
        -- cannot be read back. A table that cannot be captured (refused; another role's,
        -- whose triggers the owner may not make; locked past the ticker's lock_timeout)
        -- must not fail the DDL, nor the tick.
        BEGIN
            v_id := replicator.add_table(
                r.queue_name, format('%I.%I', r.schema_name, r.relname),
                CASE WHEN r.has_primary_key THEN r.schema_mode ELSE 'full' END,
                NULL, '{}', NULL, true);
        EXCEPTION WHEN OTHERS THEN
            IF r.oid = ANY (p_new) THEN
                PERFORM replicator.warn_once(r.oid, format('replicator: %s.%s is not captured: %s',
                                                           r.schema_name, r.relname, SQLERRM));
            END IF;
            CONTINUE;
        END;
        PERFORM replicator.insert_schema_event(v_id, replicator.schema_event_data(v_id, p_tag, p_sql, 'created'));
        IF NOT r.has_primary_key THEN
            PERFORM replicator.warn_once(r.oid, format(
                'replicator: %s.%s has no primary key: captured with every comparable column as its key,'
                ' so identical rows are one row on targets (add a primary key to keep them apart)',
                r.schema_name, r.relname));
        END IF;
        v_count := v_count + 1;
    END LOOP;
    -- after the tables just captured: a child of one of them is captured with it.
    FOR r IN
        SELECT q.queue_name, s.schema_name, c.oid, c.relname
        FROM replicator.captured_schema s
        JOIN replicator.queue q ON q.queue_id = s.queue_id
        JOIN pg_namespace n ON n.nspname = s.schema_name
        JOIN pg_class c ON c.relnamespace = n.oid AND c.relkind IN ('r', 'p') AND NOT c.relispartition
        WHERE c.oid = ANY (p_new)
          AND EXISTS (SELECT 1 FROM pg_inherits h WHERE h.inhrelid = c.oid)
          AND NOT EXISTS (SELECT 1 FROM replicator.captured_table t
                          WHERE t.queue_id = s.queue_id
                            AND t.table_oid IN (SELECT replicator.capture_ancestors(c.oid)))
          AND NOT replicator.warned(c.oid)
        ORDER BY c.oid
    LOOP
        BEGIN
            PERFORM replicator.check_capture_tree(r.oid::regclass, '{}', r.queue_name);
        EXCEPTION WHEN raise_exception THEN
            PERFORM replicator.warn_once(r.oid, format('replicator: %s.%s is not captured: %s',
                                                       r.schema_name, r.relname, SQLERRM));
        END;
    END LOOP;
    RETURN v_count;
END;
$$;

CREATE OR REPLACE FUNCTION replicator.capture_chunk()
RETURNS integer
LANGUAGE sql IMMUTABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.capture_chunk()
--
--      How many tables of followed schemas a transaction captures at
--      most: replicator.follow_schema, a ticker's pass, a DDL statement
--      (its own new tables first). Each holds about four locks to its
--      commit (its table, capture function and triggers), and a server's
--      lock table holds max_locks_per_transaction (64) x max_connections
--      (100) by default: a schema of thousands of tables captured in one
--      transaction failed with "out of shared memory", and slowed as the
--      transaction grew.
-- ----------------------------------------------------------------------
    SELECT 500;
$$;

CREATE OR REPLACE FUNCTION replicator.follow_schema(p_queue_name text, p_schema text, p_mode text DEFAULT 'full')
RETURNS integer
LANGUAGE plpgsql AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.follow_schema(p_queue_name, p_schema, p_mode)
--
--      Captures every table of a schema into a queue, now and as they are
--      created (by the DDL event trigger, or by replicator execute). The
--      tables there now are captured replicator.capture_chunk() a call:
--      call it again until it captures none (`table add --schema` does).
--
-- Returns:
--      the number of tables captured by this call
-- ----------------------------------------------------------------------
DECLARE
    q replicator.queue := replicator.find_queue(p_queue_name);
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = p_schema) THEN
        RAISE EXCEPTION 'schema % does not exist', p_schema;
    END IF;
    IF p_schema = 'replicator' THEN
        RAISE EXCEPTION 'schema replicator cannot be captured';
    END IF;
    INSERT INTO replicator.captured_schema (queue_id, schema_name, schema_mode)
    VALUES (q.queue_id, p_schema, p_mode)
    ON CONFLICT (queue_id, schema_name) DO UPDATE SET schema_mode = excluded.schema_mode;
    RETURN replicator.follow_new_tables('FOLLOW SCHEMA', NULL,
                                        ARRAY(SELECT c.oid FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                                              WHERE n.nspname = p_schema),
                                        NULL, replicator.capture_chunk());
END;
$$;

CREATE OR REPLACE FUNCTION replicator.unfollow_schema(p_queue_name text, p_schema text)
RETURNS void
LANGUAGE plpgsql AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.unfollow_schema(p_queue_name, p_schema)
--
--      Stops following a schema: tables created in it later are not
--      captured. Its tables captured so far stay captured (remove_table
--      them one by one).
--
-- Parameters:
--      p_queue_name    - the queue
--      p_schema        - a schema the queue follows
-- ----------------------------------------------------------------------
DECLARE
    q replicator.queue := replicator.find_queue(p_queue_name);
BEGIN
    DELETE FROM replicator.captured_schema WHERE queue_id = q.queue_id AND schema_name = p_schema;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'queue "%" does not follow schema %', p_queue_name, p_schema;
    END IF;
END;
$$;
