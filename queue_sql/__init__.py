"""The SQL replicator installs into the source database: functions, triggers and event
triggers, one concern per file, applied in the order of install.sql by `replicator install`
(replicator.source.install). A package only so that it ships inside the wheel, as
``replicator.queue_sql``; its files are read with importlib.resources."""
