CREATE OR REPLACE FUNCTION replicator.create_queue(
    p_queue_name text,
    p_ntables integer DEFAULT 3,
    p_rotation_period interval DEFAULT '2 hours')
RETURNS integer
LANGUAGE plpgsql AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.create_queue(p_queue_name, p_ntables, p_rotation_period)
--
--      Creates a queue: its row, its event sequence, its slot sequence and
--      its partitioned event table with p_ntables insert-only partitions,
--      indexed on ev_txid so a batch is fetched by txid range.
--
-- Parameters:
--      p_queue_name      - name of the new queue
--      p_ntables         - number of event partitions rotated through (2..100)
--      p_rotation_period - how long a partition is written before the next one
--
-- Returns:
--      the new queue id; raises if a queue of that name exists
-- ----------------------------------------------------------------------
DECLARE
    v_id integer;
BEGIN
    IF p_queue_name IS NULL OR p_queue_name = '' THEN
        RAISE EXCEPTION 'queue name must not be empty';
    END IF;
    IF EXISTS (SELECT 1 FROM replicator.queue WHERE queue_name = p_queue_name) THEN
        RAISE EXCEPTION 'queue "%" already exists', p_queue_name;
    END IF;
    IF p_ntables IS NULL OR p_ntables NOT BETWEEN 2 AND 100 THEN
        RAISE EXCEPTION 'a queue needs between 2 and 100 event tables, not %', p_ntables;
    END IF;
    IF p_rotation_period <= interval '0' THEN
        RAISE EXCEPTION 'rotation period must be positive, not %', p_rotation_period;
    END IF;

    INSERT INTO replicator.queue (queue_name, queue_ntables, queue_rotation_period)
    VALUES (p_queue_name, p_ntables, p_rotation_period)
    RETURNING queue_id INTO v_id;

    EXECUTE format('CREATE SEQUENCE %s', replicator.event_id_seq(v_id));
    EXECUTE format('CREATE SEQUENCE %s MINVALUE 0 START 0', replicator.event_slot_seq(v_id));
    EXECUTE format('SELECT setval(%L, 0, true)', replicator.event_slot_seq(v_id));
    -- Columns ordered for alignment: fixed-width first, the json payload last.
    EXECUTE format($sql$
        CREATE TABLE %s (
            ev_id       bigint NOT NULL,
            ev_txid     bigint NOT NULL DEFAULT txid_current(),
            ev_time     timestamptz NOT NULL DEFAULT now(),
            ev_table    integer NOT NULL,
            ev_slot     smallint NOT NULL,
            ev_type     "char" NOT NULL,
            ev_data     json,
            ev_old      json     -- tables with old rows (--old-rows): their old rows, item for item
        ) PARTITION BY LIST (ev_slot)$sql$, replicator.event_table(v_id));
    FOR i IN 0 .. p_ntables - 1 LOOP
        EXECUTE format('CREATE TABLE %s PARTITION OF %s FOR VALUES IN (%s) WITH (fillfactor = 100)',
                       replicator.event_partition(v_id, i), replicator.event_table(v_id), i);
    END LOOP;
    EXECUTE format('CREATE INDEX ON %s (ev_txid)', replicator.event_table(v_id));
    RETURN v_id;
END;
$$;
