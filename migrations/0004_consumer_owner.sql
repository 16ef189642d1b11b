-- 0004_consumer_owner: the role a consumer belongs to. Only that role (or a member of it), the
-- owner of schema replicator (or a member of it) and superusers may read its batches, move it
-- or unregister it (replicator.check_consumer_owner()); registering its name again as another
-- role is refused.
--
-- Consumers registered before this version have no recorded owner: they are given to the owner
-- of schema replicator, who installed replicator. Nothing tells who registered them, and
-- letting the first role to register a name claim it would let any granted role take over a
-- running consumer (a daemon calls register_consumer only when it starts) and move it past
-- events it never applied. A consumer run by another role is given to it with
-- `replicator queue owner QUEUE CONSUMER ROLE` (replicator.set_consumer_owner()).

ALTER TABLE replicator.consumer ADD COLUMN consumer_owner name;

UPDATE replicator.consumer
SET consumer_owner = (SELECT pg_get_userbyid(nspowner) FROM pg_namespace WHERE nspname = 'replicator');

ALTER TABLE replicator.consumer ALTER COLUMN consumer_owner SET NOT NULL;
