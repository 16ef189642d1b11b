CREATE OR REPLACE FUNCTION replicator.forget_table(p_table_id integer, p_tag text, p_sql text)
RETURNS void
LANGUAGE plpgsql AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.forget_table(p_table_id, p_tag, p_sql)
--
--      A captured table was dropped: queue an S event of kind 'dropped'
--      and stop capturing it.
-- ----------------------------------------------------------------------
DECLARE
    t replicator.captured_table;
BEGIN
    SELECT * INTO t FROM replicator.captured_table WHERE table_id = p_table_id;
    PERFORM replicator.insert_schema_event(p_table_id, jsonb_build_object(
        'kind', 'dropped', 'tag', p_tag, 'sql', p_sql, 'schema', t.table_schema, 'name', t.table_name));
    PERFORM replicator.drop_capture(p_table_id);
    DELETE FROM replicator.captured_table WHERE table_id = p_table_id;
END;
$$;

CREATE OR REPLACE FUNCTION replicator.table_record_now(p_table_id integer)
RETURNS replicator.captured_table
LANGUAGE plpgsql AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.table_record_now(p_table_id)
--
--      What a captured table's record becomes after DDL, read from the
--      catalog and written nowhere: names, columns, key (followed through
--      renames by attnum; a new primary key replaces a primary or automatic
--      key), ignored columns and structure. A change that would leave the
--      table without a usable key raises with the way out.
--
-- Parameters:
--      p_table_id  - replicator.captured_table id
--
-- Returns:
--      the record as it would be now; NULL when the table is gone
-- ----------------------------------------------------------------------
DECLARE
    t replicator.captured_table;
    v_schema text;
    v_name text;
    v_columns text[];
    v_pk text[];
    v_key text[];
    v_ignore text[];
    v_missing text;
    v_way_out text;
BEGIN
    SELECT * INTO t FROM replicator.captured_table WHERE table_id = p_table_id;
    SELECT n.nspname, c.relname INTO v_schema, v_name
    FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = t.table_oid;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    v_way_out := format('remove the table from its queue first: replicator table remove %s %I.%I',
                        (SELECT queue_name FROM replicator.queue q WHERE q.queue_id = t.queue_id), v_schema, v_name);

    v_columns := ARRAY(SELECT attname FROM pg_attribute
                       WHERE attrelid = t.table_oid AND attnum > 0 AND NOT attisdropped ORDER BY attnum);
    -- Follow key and ignored columns through renames by their attnum.
    v_key := ARRAY(SELECT a.attname
                   FROM unnest(t.table_key) WITH ORDINALITY AS k(name, ord)
                   JOIN jsonb_array_elements(t.table_structure->'columns') c ON c->>'name' = k.name
                   JOIN pg_attribute a ON a.attrelid = t.table_oid AND a.attnum = (c->>'attnum')::int
                                      AND NOT a.attisdropped
                   ORDER BY k.ord);
    v_ignore := ARRAY(SELECT a.attname
                      FROM unnest(t.table_ignore) AS i(name)
                      JOIN jsonb_array_elements(t.table_structure->'columns') c ON c->>'name' = i.name
                      JOIN pg_attribute a ON a.attrelid = t.table_oid AND a.attnum = (c->>'attnum')::int
                                         AND NOT a.attisdropped);
    v_pk := ARRAY(SELECT a.attname
                  FROM pg_index i
                  CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, ord)
                  JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
                  WHERE i.indrelid = t.table_oid AND i.indisprimary ORDER BY k.ord);
    -- key_is_pk: the key follows the primary key (kept on its columns while there is none);
    -- key_is_auto: every comparable column until a primary key appears; else a --key.
    IF (t.key_is_pk OR t.key_is_auto) AND cardinality(v_pk) > 0 THEN
        t.key_is_pk := true;
        t.key_is_auto := false;
        v_key := v_pk;
    ELSIF t.key_is_auto THEN
        v_key := replicator.comparable_columns(t.table_oid);
    ELSIF t.key_is_pk AND cardinality(v_key) = cardinality(t.table_key) AND NOT EXISTS (
              -- the primary key is gone: is the key still unique (a unique index on NOT NULL
              -- key columns)? Else duplicates of it would silently collapse on targets.
              SELECT 1 FROM pg_index i
              WHERE i.indrelid = t.table_oid AND i.indisunique AND i.indimmediate
                AND i.indpred IS NULL AND i.indexprs IS NULL
                AND NOT EXISTS (SELECT 1 FROM unnest(i.indkey) k(attnum)
                                JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
                                WHERE NOT a.attnotnull OR a.attname <> ALL (v_key))) THEN
        IF t.table_mode <> 'full' THEN
            RAISE EXCEPTION 'table %.% is captured in pk mode with key (%), which this statement leaves without a unique constraint',
                v_schema, v_name, array_to_string(t.table_key, ', ')
                USING HINT = 'replace the primary key in the same statement (ALTER TABLE ... DROP CONSTRAINT ..., '
                             'ADD PRIMARY KEY (...)), or keep a unique index on the key columns';
        END IF;
        -- Full mode: every comparable column becomes the key (as for a keyless table
        -- created in a followed schema) until a primary key is added again.
        t.key_is_pk := false;
        t.key_is_auto := true;
        v_key := replicator.comparable_columns(t.table_oid);
        RAISE WARNING 'replicator: %.% has no primary key any more: captured with every column as its key until one is added',
            v_schema, v_name;
    END IF;
    IF cardinality(v_key) = 0 OR (NOT t.key_is_auto AND v_key IS DISTINCT FROM v_pk
                                  AND cardinality(v_key) < cardinality(t.table_key)) THEN
        SELECT string_agg(k, ', ') INTO v_missing FROM unnest(t.table_key) k;
        RAISE EXCEPTION 'table %.% is captured with key (%), which this statement removes', v_schema, v_name, v_missing
            USING HINT = v_way_out;
    END IF;
    IF t.table_mode = 'pk' AND cardinality(replicator.nullable_key_columns(t.table_oid, v_key)) > 0 THEN
        -- rows are read back by their key, and a NULL never equals: they would vanish from targets
        RAISE EXCEPTION 'table %.% is captured in pk mode with key (%), whose columns must stay NOT NULL',
            v_schema, v_name, array_to_string(v_key, ', ')
            USING HINT = v_way_out;
    END IF;
    IF EXISTS (SELECT 1 FROM unnest(v_key) k WHERE k <> ALL (replicator.comparable_columns(t.table_oid))) THEN
        -- the capture compares keys (EXCEPT): a key column's new type must have equality
        RAISE EXCEPTION 'table %.% is captured with key (%), a column of which now has a type without equality',
            v_schema, v_name, array_to_string(v_key, ', ')
            USING HINT = v_way_out;
    END IF;
    t.table_schema := v_schema;
    t.table_name := v_name;
    t.table_columns := v_columns;
    t.table_key := v_key;
    t.table_ignore := v_ignore;
    t.table_structure := replicator.table_structure(t.table_oid, v_key);
    RETURN t;
END;
$$;

CREATE OR REPLACE FUNCTION replicator.store_table_record(t replicator.captured_table)
RETURNS void
LANGUAGE sql AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.store_table_record(t)
--
--      Records what replicator.table_record_now() found: names, columns,
--      key, ignored columns, structure. The capture function is generated
--      again by the caller.
-- ----------------------------------------------------------------------
    UPDATE replicator.captured_table SET
        table_schema = t.table_schema, table_name = t.table_name, table_columns = t.table_columns,
        table_key = t.table_key, table_ignore = t.table_ignore, key_is_pk = t.key_is_pk,
        key_is_auto = t.key_is_auto, table_structure = t.table_structure
    WHERE table_id = t.table_id;
$$;

CREATE OR REPLACE FUNCTION replicator.sync_table(p_table_id integer, p_tag text, p_sql text,
                                                 p_rewritten boolean DEFAULT false)
RETURNS boolean
LANGUAGE plpgsql AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.sync_table(p_table_id, p_tag, p_sql, p_rewritten)
--
--      Brings a captured table's record up to date with the catalog after
--      DDL (replicator.table_record_now). When anything targets depend on
--      changed, or the statement rewrote the table's rows, regenerates the
--      capture function and queues an S event. A change that would leave
--      the table without a usable key aborts the DDL with the way out.
--
-- Parameters:
--      p_table_id  - replicator.captured_table id
--      p_tag       - command tag of the statement
--      p_sql       - its text
--      p_rewritten - the statement rewrote the table's rows without row
--                    triggers (ALTER COLUMN ... TYPE ... USING, even to the
--                    same type; a volatile default): the S event carries
--                    "copy": true and targets copy the table again, and
--                    "rows_kept": true (values changed, no row left: a
--                    target may write the copy over the rows it holds)
--
-- Returns:
--      true if an S event was queued
-- ----------------------------------------------------------------------
DECLARE
    t replicator.captured_table;
    v_now replicator.captured_table := replicator.table_record_now(p_table_id);
BEGIN
    IF v_now IS NULL THEN
        PERFORM replicator.forget_table(p_table_id, p_tag, p_sql);
        RETURN true;
    END IF;
    SELECT * INTO t FROM replicator.captured_table WHERE table_id = p_table_id;
    IF replicator.structure_signature(v_now.table_structure) = replicator.structure_signature(t.table_structure)
       AND t.table_columns = v_now.table_columns AND NOT p_rewritten THEN
        RETURN false;
    END IF;
    PERFORM replicator.store_table_record(v_now);
    PERFORM replicator.generate_capture(p_table_id);
    IF p_rewritten THEN
        PERFORM replicator.insert_schema_event(p_table_id,
            replicator.schema_event_data(p_table_id, p_tag, p_sql, 'altered') || '{"copy": true, "rows_kept": true}');
    ELSE
        PERFORM replicator.insert_schema_event(p_table_id,
            replicator.schema_event_data(p_table_id, p_tag, p_sql, 'altered'));
    END IF;
    RETURN true;
END;
$$;
