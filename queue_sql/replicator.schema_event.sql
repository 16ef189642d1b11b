CREATE OR REPLACE FUNCTION replicator.insert_schema_event(p_table_id integer, p_data jsonb)
RETURNS bigint
LANGUAGE plpgsql AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.insert_schema_event(p_table_id, p_data)
--
--      Queues an S event for a captured table into its queue, from the
--      queue's event sequence: the schema change is ordered among the
--      row changes of the same transaction and of others.
--
-- Returns:
--      the event id
-- ----------------------------------------------------------------------
DECLARE
    v_queue integer;
    v_id bigint;
BEGIN
    SELECT queue_id INTO v_queue FROM replicator.captured_table WHERE table_id = p_table_id;
    EXECUTE format('INSERT INTO %s (ev_slot, ev_id, ev_type, ev_table, ev_data)'
                   ' VALUES ($1, nextval(%L), ''S'', $2, $3) RETURNING ev_id',
                   replicator.event_table(v_queue), replicator.event_id_seq(v_queue))
        INTO v_id USING replicator.current_slot(v_queue), p_table_id, p_data::json;
    RETURN v_id;
END;
$$;

CREATE OR REPLACE FUNCTION replicator.structure_signature(p_structure jsonb)
RETURNS jsonb
LANGUAGE sql IMMUTABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.structure_signature(p_structure)
--
--      The part of a table_structure() that targets depend on: names,
--      column names, attnums, types and nullability, key. Nullability
--      counts: a target relies on NOT NULL key columns (the SQLite target's
--      INSERT OR REPLACE; NULLs never conflict). A change of default alone
--      is not announced: it changes no stored value.
--
-- Parameters:
--      p_structure - a replicator.table_structure() result
--
-- Returns:
--      the structure reduced to what is compared
-- ----------------------------------------------------------------------
    SELECT jsonb_build_object(
        'schema', p_structure->'schema', 'name', p_structure->'name', 'key', p_structure->'key',
        'columns', (SELECT jsonb_agg(jsonb_build_object('name', c->'name', 'attnum', c->'attnum',
                                                        'type', c->'type', 'not_null', c->'not_null')
                                     ORDER BY (c->>'attnum')::int)
                    FROM jsonb_array_elements(p_structure->'columns') c));
$$;

CREATE OR REPLACE FUNCTION replicator.schema_event_data(t replicator.captured_table, p_tag text, p_sql text,
                                                         p_kind text)
RETURNS jsonb
LANGUAGE sql IMMUTABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.schema_event_data(t, p_tag, p_sql, p_kind)
--
--      The data of an S event: what ran (command tag, statement text),
--      what happened to the table (p_kind: 'created', 'altered'), and the
--      resulting structure with the captured columns in event value order.
--
-- Parameters:
--      t           - the captured table's record, as the event describes it
-- ----------------------------------------------------------------------
    SELECT jsonb_build_object(
        'kind', p_kind, 'tag', p_tag, 'sql', p_sql,
        'schema', t.table_schema, 'name', t.table_name, 'mode', t.table_mode,
        'key', to_jsonb(t.table_key),
        'columns', to_jsonb(ARRAY(SELECT c FROM unnest(t.table_columns) c WHERE c <> ALL (t.table_ignore))),
        'structure', t.table_structure);
$$;

CREATE OR REPLACE FUNCTION replicator.schema_event_data(p_table_id integer, p_tag text, p_sql text, p_kind text)
RETURNS jsonb
LANGUAGE sql STABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.schema_event_data(p_table_id, p_tag, p_sql, p_kind)
--
--      The data of an S event for a captured table as recorded.
-- ----------------------------------------------------------------------
    SELECT replicator.schema_event_data(t, p_tag, p_sql, p_kind)
    FROM replicator.captured_table t WHERE t.table_id = p_table_id;
$$;

CREATE OR REPLACE FUNCTION replicator.queue_copy_event(p_table_id integer, p_tag text, p_sql text)
RETURNS bigint
LANGUAGE sql AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.queue_copy_event(p_table_id, p_tag, p_sql)
--
--      Queues an S event of kind 'altered' with "copy": true for a
--      captured table: its rows changed without a row trigger firing (a
--      rewrite, a descendant attached, detached, dropped or truncated, a
--      capture that did not cover a descendant before an upgrade), so
--      targets copy the table again, within the snapshot rules of the
--      initial copy.
--
-- Parameters:
--      p_table_id  - replicator.captured_table id
--      p_tag       - command tag of the statement that changed the rows
--      p_sql       - its text (NULL when there is none)
--
-- Returns:
--      the event id
-- ----------------------------------------------------------------------
    SELECT replicator.insert_schema_event(p_table_id,
        replicator.schema_event_data(p_table_id, p_tag, p_sql, 'altered') || '{"copy": true}');
$$;
