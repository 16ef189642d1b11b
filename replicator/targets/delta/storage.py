"""Where a Delta warehouse lives: a local directory or an object store.

The Delta log needs one primitive beyond reading and writing files: put if
absent (a commit is the file ``_delta_log/<version>.json``, and two writers
of the same version must not both succeed). A local directory has it as a
hard link of a fully written temporary file; an object store as a
conditional PUT (``If-None-Match: *``), which S3, GCS and Azure honour.

Paths are relative to the warehouse's root, with ``/`` separators, and both storages refuse
one that would lead outside it (an absolute path, a ``..`` part; locally a symbolic link out of
it too), whatever built it: a table's name or a log another writer wrote is data, never a path.
"""

from __future__ import annotations

import contextlib
import errno
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Protocol

from replicator.errors import UserError


class NotDurable(OSError):
    """A file was linked into its directory, but the directory's fsync failed: the entry may never
    reach the disk (after a failed fsync the kernel may drop what it could not write, and a second
    fsync reports success: PostgreSQL's fsync lesson), so whether the file exists after a crash is
    not known."""


@dataclass(frozen=True)
class Entry:
    path: str            # relative to the root
    size: int
    modified: float      # seconds since the epoch


class Storage(Protocol):
    url: str             # the warehouse as the user named it, for messages
    roots: tuple[str, ...]   # the root as a Delta log may name it in an absolute path (decoded)

    def read(self, path: str) -> bytes:
        """The whole file; FileNotFoundError when there is none."""
        ...

    def exists(self, path: str) -> bool: ...

    def write(self, path: str, data: bytes) -> None:
        """Writes (or replaces) a file, durably."""
        ...

    def put_if_absent(self, path: str, data: bytes) -> bool:
        """Writes a file that must not exist yet, atomically: False when it exists (nothing written);
        NotDurable when it was written but may not be on disk."""
        ...

    @contextlib.contextmanager
    def open_write(self, path: str) -> Iterator[IO[bytes]]:
        """A file being written (a large Parquet file), durable and visible once the block ends
        without error; nothing at path when it fails."""
        ...

    def open_read(self, path: str) -> IO[bytes]:
        """A seekable file to read (Parquet's footer is at its end)."""
        ...

    def list(self, prefix: str) -> list[Entry]:
        """Every file under the directory prefix ('' for all), recursively."""
        ...

    def delete(self, path: str) -> None:
        """Removes a file; none there is not an error."""
        ...

    def delta_rs(self) -> tuple[str, dict[str, str]]:
        """The table URI root and storage options for delta-rs (the deltalake package)."""
        ...


def inside(url: str, path: str) -> str:
    """path, if it names a place inside the warehouse at url: relative, without '.', '..' or empty
    parts ('' is the root); else a UserError."""
    if path and (path.startswith("/") or any(part in ("", ".", "..") for part in path.split("/"))):
        raise UserError(f"{url}: refused the path {path!r}: it is not a path inside the warehouse (an absolute path, "
                        f"or a '.', '..' or empty part)")
    return path


def recorded_directory(url: str, directory: str, outcome: str, table: str | None = None) -> str:
    """directory, as _replicator records a table's (table: its name, when known), if it is one
    directory of the warehouse's root; else a UserError ending in `outcome` (what the caller
    left undone): an older version's table named '..' wrote outside it."""
    if directory in ("", ".", "..") or any(c in directory for c in "/\\\0"):
        raise UserError(f"{url}: the warehouse records {f'table {table}' if table else 'a table'} in the directory "
                        f"{directory!r}, which is not one of its own: {outcome}; replicate into a new warehouse")
    return directory


class LocalStorage:
    """A directory on a local (or POSIX-mounted) filesystem."""

    def __init__(self, root: Path) -> None:
        self.root = root.expanduser().resolve()
        self.url = str(self.root)
        root_path = self.root.as_posix()
        self.roots: tuple[str, ...] = (f"file://{root_path}", f"file:{root_path}", root_path)   # file:/…: Hadoop's

    def _path(self, path: str) -> Path:
        full = self.root / inside(self.url, path)
        real = os.path.realpath(full)
        if real != str(self.root) and not real.startswith(f"{self.root}{os.sep}"):
            raise UserError(f"{self.url}: refused the path {path!r}: a symbolic link leads it outside the warehouse "
                            f"(to {real})")
        return full

    def read(self, path: str) -> bytes:
        return self._path(path).read_bytes()

    def exists(self, path: str) -> bool:
        return self._path(path).exists()

    def write(self, path: str, data: bytes) -> None:
        with self.open_write(path) as f:
            f.write(data)

    def put_if_absent(self, path: str, data: bytes) -> bool:
        target = self._path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, target)   # fails if target exists: the commit is atomic and exclusive
            except FileExistsError:
                return False
            try:
                _fsync_dir(target.parent)
            except OSError as exc:   # not retried: a retry's success would not mean the entry is on disk
                raise NotDurable(exc.errno, f"{exc.strerror} (syncing the directory)", str(target.parent)) from exc
            return True
        finally:
            tmp.unlink(missing_ok=True)

    @contextlib.contextmanager
    def open_write(self, path: str) -> Iterator[IO[bytes]]:
        target = self._path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex}.tmp")
        try:
            with open(tmp, "wb") as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
            _fsync_dir(target.parent)
        finally:
            tmp.unlink(missing_ok=True)

    def open_read(self, path: str) -> IO[bytes]:
        return open(self._path(path), "rb")

    def list(self, prefix: str) -> list[Entry]:
        base = self._path(prefix.rstrip("/"))
        entries = []
        for directory, _, files in os.walk(base):
            for name in files:
                full = Path(directory) / name
                with contextlib.suppress(FileNotFoundError):
                    st = full.stat()
                    entries.append(Entry(full.relative_to(self.root).as_posix(), st.st_size, st.st_mtime))
        return entries

    def delete(self, path: str) -> None:
        self._path(path).unlink(missing_ok=True)

    def delta_rs(self) -> tuple[str, dict[str, str]]:
        return str(self.root), {}


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno != errno.EINVAL:   # a filesystem that cannot sync directories
            raise
    finally:
        os.close(fd)
