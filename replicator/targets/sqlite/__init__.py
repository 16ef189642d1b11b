"""The SQLite target: the replica file, its column types and its incremental views."""
