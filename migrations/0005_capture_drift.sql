-- 0005_capture_drift: what a capture function was generated for, so that a DDL run directly on
-- a captured table where no event trigger sees it (no superuser) is noticed
-- (replicator.capture_guard, replicator.sync_drifted): the versions (xmin, ctid) of its columns'
-- pg_attribute rows and of its primary key's pg_index row, the storage of its capture tree, and
-- whether the function checks them at every statement; and why a capture is suspended (its key
-- or row filter gone in such a DDL), until the table is removed and added again.

ALTER TABLE replicator.captured_table
    ADD COLUMN table_catalog_xmins xid[],
    ADD COLUMN table_catalog_tids tid[],
    ADD COLUMN table_storage jsonb,
    ADD COLUMN table_guarded boolean NOT NULL DEFAULT false,
    ADD COLUMN table_suspended text;
