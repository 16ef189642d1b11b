"""The optional parts of replicator and the extras that install them (pyproject.toml's
[project.optional-dependencies]). A base install replicates into SQLite and streams (jsonl:,
tsv:); the Delta warehouse, Kafka and Spark need their extra. The modules that import an
extra's packages load only when a URL names their target (replicator.targets), after require().
"""

from importlib.util import find_spec

from replicator.errors import UserError

# The modules each extra brings, as imported (pyproject.toml names their distributions).
EXTRAS: dict[str, tuple[str, ...]] = {
    "delta": ("pyarrow", "numpy", "pyroaring", "obstore", "deltalake"),
    "kafka": ("confluent_kafka", "msgspec"),
    "spark": ("pyspark", "pandas"),
}


def require(extra: str, what: str) -> None:
    """UserError naming the extra to install when a module of it is missing: `what`
    (e.g. "the Delta target") needs it."""
    if any(find_spec(module) is None for module in EXTRAS[extra]):
        raise UserError(f"{what} needs replicator[{extra}]: pip install 'replicator[{extra}]'")
