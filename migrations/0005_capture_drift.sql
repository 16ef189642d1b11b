-- 0005_capture_drift: what a capture function was generated for, so that a DDL run directly on
-- a captured table where no event trigger sees it (no superuser) is noticed (replicator.capture_drift):
-- the xmins of the table's pg_class and pg_attribute rows and its storage; and why a capture is
-- suspended (its key or row filter gone in such a DDL), until the table is removed and added again.

ALTER TABLE replicator.captured_table
    ADD COLUMN table_catalog xid[],
    ADD COLUMN table_filenode oid,
    ADD COLUMN table_suspended text;
