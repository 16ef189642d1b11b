"""Spark failures as one line a user can read.

A failed Spark job surfaces as a PySpark exception or a Py4J one whose text
runs on with a JVM stack trace; the CLI and the consumer's log want its first
meaningful line.
"""

from __future__ import annotations


def spark_errors() -> tuple[type[Exception], ...]:
    """The exception types of a failed Spark call (none when PySpark is not installed)."""
    try:
        from py4j.protocol import Py4JError
        from pyspark.errors import PySparkException
    except ImportError:
        return ()
    return (PySparkException, Py4JError)


def error_line(exc: BaseException) -> str:
    """The first line of an error; for a Java exception, the Java one's (the
    Python text of a Py4JJavaError names only the Py4J call that failed)."""
    java = getattr(exc, "java_exception", None)
    text = str(java.toString() if java is not None else exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
