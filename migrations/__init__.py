"""The numbered, append-only scripts that create and change the tables of schema
replicator, applied by `replicator install` (replicator.source.install). A package only so
that it ships inside the wheel, as ``replicator.migrations``."""
