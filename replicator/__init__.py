"""replicator: trigger-based change-capture queue replication for PostgreSQL."""

# The one place the version is written: pyproject.toml reads it from here (setuptools' dynamic
# version), `replicator --version` prints it. A .devN suffix until the release (CHANGELOG.md).
__version__ = "0.2.0.dev0"
