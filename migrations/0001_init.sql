-- 0001_init: the tables of schema "replicator": queues, ticks, consumers, captured tables.
-- Event tables are created per queue by replicator.create_queue().

CREATE TABLE replicator.schema_version (
    version     integer PRIMARY KEY,
    name        text NOT NULL,
    applied_at  timestamptz NOT NULL DEFAULT now()
);

-- One row per queue. Its events live in the partitioned table replicator.event_<queue_id>,
-- split into queue_ntables insert-only partitions; the sequence replicator.event_<queue_id>_slot
-- names the partition writers insert into (a sequence, so every isolation level sees a switch
-- at once).
CREATE TABLE replicator.queue (
    queue_id              serial PRIMARY KEY,
    queue_name            text NOT NULL UNIQUE,
    queue_ntables         integer NOT NULL DEFAULT 3 CHECK (queue_ntables BETWEEN 2 AND 100),
    queue_rotation_period interval NOT NULL DEFAULT '2 hours',
    queue_switch_time     timestamptz NOT NULL DEFAULT now(),
    -- txid of the transaction that ran the last switch, and of the first one after it:
    -- every writer into the previous partition has a txid below queue_switch_step2.
    queue_switch_step1    bigint NOT NULL DEFAULT txid_current(),
    queue_switch_step2    bigint DEFAULT txid_current(),
    queue_ticker_max_count   integer NOT NULL DEFAULT 500,
    queue_ticker_max_lag     interval NOT NULL DEFAULT '3 seconds',
    queue_ticker_idle_period interval NOT NULL DEFAULT '60 seconds',
    queue_created         timestamptz NOT NULL DEFAULT now()
);

-- A tick is a snapshot of the queue: a batch is the events of transactions visible in one
-- tick's snapshot and not in the previous tick's.
CREATE TABLE replicator.tick (
    tick_queue      integer NOT NULL REFERENCES replicator.queue ON DELETE CASCADE,
    tick_id         bigint NOT NULL,
    tick_time       timestamptz NOT NULL DEFAULT now(),
    tick_snapshot   txid_snapshot NOT NULL,
    tick_event_seq  bigint NOT NULL,
    PRIMARY KEY (tick_queue, tick_id)
);

-- A table captured into a queue. table_columns/table_key are the column lists baked into the
-- generated capture function; they are regenerated when the table's structure changes.
CREATE TABLE replicator.captured_table (
    table_id        serial PRIMARY KEY,
    queue_id        integer NOT NULL REFERENCES replicator.queue ON DELETE CASCADE,
    table_schema    text NOT NULL,
    table_name      text NOT NULL,
    table_mode      text NOT NULL DEFAULT 'full' CHECK (table_mode IN ('full', 'pk')),
    table_key       text[] NOT NULL,
    key_is_pk       boolean NOT NULL,
    table_ignore    text[] NOT NULL DEFAULT '{}',
    table_where     text,
    table_columns   text[] NOT NULL,
    table_added     timestamptz NOT NULL DEFAULT now(),
    UNIQUE (queue_id, table_schema, table_name)
);

-- A consumer of a queue: its position (last_tick) and at most one open batch.
CREATE TABLE replicator.consumer (
    consumer_id     serial PRIMARY KEY,
    queue_id        integer NOT NULL REFERENCES replicator.queue ON DELETE CASCADE,
    consumer_name   text NOT NULL,
    last_tick       bigint NOT NULL,
    next_tick       bigint,
    batch_id        bigint,
    batch_start     timestamptz,
    active_time     timestamptz NOT NULL DEFAULT now(),
    registered      timestamptz NOT NULL DEFAULT now(),
    UNIQUE (queue_id, consumer_name)
);

CREATE SEQUENCE replicator.batch_id_seq;
