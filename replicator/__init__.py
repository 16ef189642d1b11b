"""replicator: trigger-based change-capture queue replication for PostgreSQL."""

__version__ = "0.1.0"
