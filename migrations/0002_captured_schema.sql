-- 0002_captured_schema: whole schemas followed by a queue (`table add QUEUE --schema NAME`);
-- tables created in them later are captured from their first row.

CREATE TABLE replicator.captured_schema (
    queue_id        integer NOT NULL REFERENCES replicator.queue ON DELETE CASCADE,
    schema_name     text NOT NULL,
    schema_mode     text NOT NULL DEFAULT 'full' CHECK (schema_mode IN ('full', 'pk')),
    schema_added    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (queue_id, schema_name)
);
