"""The Delta Lake warehouse (``--target delta:URI``): every replicated table a Delta table, written by
replicator itself (no JVM), on a local path or object storage. See target.py and docs/delta.md."""
