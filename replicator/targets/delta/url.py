"""A warehouse's storage by its URL: a local path, or an object store (storage.py, object_storage.py);
and the kind of tables a `delta:` target's URL asks for."""

from __future__ import annotations

from pathlib import Path

from replicator.errors import UserError
from replicator.targets.delta.storage import LocalStorage, Storage


def open_storage(url: str) -> Storage:
    """A local path (or file:// URL), or an object-store URL (s3://, gs://, az://, abfss://)."""
    if "://" in url and not url.startswith("file://"):
        from replicator.targets.delta.object_storage import ObjectStorage
        return ObjectStorage(url)
    return LocalStorage(Path(url.removeprefix("file://")))


TABLES_OPTION = "?tables="
TABLE_KINDS = ("default", "portable")


def parse_url(url: str) -> tuple[str, bool]:
    """The warehouse URL of a `delta:` target without its scheme, and whether its tables are
    portable: URL, or URL?tables=default|portable (a `?` elsewhere is part of the URL)."""
    where, option, kind = url.rpartition(TABLES_OPTION)
    if not option or "/" in kind:
        return url, False
    if kind not in TABLE_KINDS:
        raise UserError(f"invalid target option tables={kind!r}: use delta:URI (deletion vectors and column "
                        f"mapping, the default) or delta:URI?tables=portable (readers without them: Polars, "
                        f"delta-rs' to_pyarrow_table)")
    return where, kind == "portable"
