-- 0009_capture_kind: how a table is captured (`replicator table add/alter --capture`):
-- 'statement', one trigger a statement over its transition tables (the default, as every
-- table was captured before), or 'row', one trigger a row writing the same events, cheaper
-- for tables written one row at a time (replicator.generate_capture). A TRUNCATE is a
-- statement trigger in both.

ALTER TABLE replicator.captured_table ADD COLUMN table_capture text NOT NULL DEFAULT 'statement'
    CHECK (table_capture IN ('statement', 'row'));
