-- ----------------------------------------------------------------------
-- The functions of schema replicator, in the order they are created.
--
--      `replicator install` applies migrations/ first (the tables), then
--      runs these files in this order (replicator/source/install.py); a
--      file of queue_sql/ missing here is an error. psql creates the same
--      functions from it (psql -f install.sql, after the migrations);
--      install also creates the event triggers, revokes EXECUTE from
--      PUBLIC, grants consumer roles theirs and regenerates captures.
--      Functions in LANGUAGE sql are checked when created: what they
--      call comes before them.
-- ----------------------------------------------------------------------

-- queues and their event tables
\ir replicator.find_queue.sql
\ir replicator.queue_objects.sql
\ir replicator.create_queue.sql
\ir replicator.drop_queue.sql
\ir replicator.set_queue_config.sql

-- captured tables and their capture functions
\ir replicator.table_structure.sql
\ir replicator.capture_tree.sql
\ir replicator.generate_capture.sql
\ir replicator.add_table.sql
\ir replicator.remove_table.sql
\ir replicator.alter_table.sql
\ir replicator.partition_truncated.sql

-- schema changes: S events, following DDL with event triggers, and without
\ir replicator.schema_event.sql
\ir replicator.warn_once.sql
\ir replicator.check_row_filters.sql
\ir replicator.sync_table.sql
\ir replicator.sync_partitions.sql
\ir replicator.follow_schema.sql
\ir replicator.table_rewrite.sql
\ir replicator.sync_all.sql
\ir replicator.event_triggers.sql
\ir replicator.capture_drift.sql

-- ticks, consumers and batches
\ir replicator.ticker.sql
\ir replicator.ticker_heartbeat.sql
\ir replicator.register_consumer.sql
\ir replicator.grant_consumer.sql
\ir replicator.next_batch.sql
\ir replicator.get_batch_info.sql
\ir replicator.batch_event_sql.sql
\ir replicator.finish_batch.sql
\ir replicator.consumer_copy.sql

-- maintenance, status, upgrades
\ir replicator.maint_rotate.sql
\ir replicator.idle_consumers.sql
\ir replicator.info.sql
\ir replicator.upgrade.sql
