-- 0003_table_structure: what DDL capture needs to know of a captured table: its oid (names
-- change with RENAME), the structure last announced to consumers, and whether its key was
-- chosen automatically (all columns, for a keyless table created in a followed schema; a
-- primary key added later replaces it).

ALTER TABLE replicator.captured_table
    ADD COLUMN table_oid oid,
    ADD COLUMN table_structure jsonb,
    ADD COLUMN key_is_auto boolean NOT NULL DEFAULT false;

UPDATE replicator.captured_table
SET table_oid = to_regclass(quote_ident(table_schema) || '.' || quote_ident(table_name));
