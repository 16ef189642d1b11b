"""The Spark target: the warehouse directory, its reader, compaction and incremental views."""
