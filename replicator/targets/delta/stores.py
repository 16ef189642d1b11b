"""A warehouse's storage by its URL: a local path, or an object store (storage.py, object_storage.py)."""

from __future__ import annotations

from pathlib import Path

from replicator.targets.delta.storage import LocalStorage, Storage


def open_storage(url: str) -> Storage:
    """A local path (or file:// URL), or an object-store URL (s3://, gs://, az://, abfss://)."""
    if "://" in url and not url.startswith("file://"):
        from replicator.targets.delta.object_storage import ObjectStorage
        return ObjectStorage(url)
    return LocalStorage(Path(url.removeprefix("file://")))
