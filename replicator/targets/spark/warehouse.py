"""The Spark warehouse on disk: layout, manifest, lock, type mapping.

No Spark here (pyarrow only): the consumer writes change logs without a
Spark job; replicator.targets.spark.reader and .compact read them with Spark.

Layout of a warehouse directory::

    PATH/_manifest.json                 the commit point (replaced atomically)
    PATH/_lock                          writers' lock (flock), held only while committing
    PATH/_compact.lock, _consumer.lock  a compaction's, the consumer's
    PATH/<table>-<id>/g-<id>/base-*.parquet           base snapshot of a generation
    PATH/<table>-<id>/g-<id>/compact-<id>/part-*      a base written by compaction (Spark)
    PATH/<table>-<id>/g-<id>/log-<seq>-<id>.parquet   one change log file per batch
    PATH/_views/<view>-<id>/g-<id>/base/, log-<seq>-<id>/   a view's files (see .views)

Nothing else is replicator's: remove_orphans deletes only unnamed files of this
layout, and refuses to work beside anything else (a link, a file of another name).

A table's current state is its base plus its change log files, the latest
row of each key winning (merge-on-read). Log files hold one row per key,
``_seq`` (the file's sequence number: later files win) and ``_deleted``.
A new generation (initial copy, copy again after a schema change, TRUNCATE)
starts from a new base and no log. Compaction folds a generation's log into
a new base. Nothing is visible until the manifest names it, and the
manifest also holds the consumer positions: data and position commit
together (write a temporary file, fsync, rename over the manifest).

Parquet column names are physical: ``c<attnum>``. A column keeps its attnum
through renames and a new column gets a new one, so in-place schema changes
(add, drop, rename column) never rewrite files: the manifest's structure
says which physical columns the table has and what they are called now.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import stat
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa

from replicator.errors import UserError
from replicator.structure import Column, TableStructure
from replicator.targets.arrow import arrow_array, arrow_type
from replicator.targets.crash import crash_point

MANIFEST = "_manifest.json"
MANIFEST_TMP_SUFFIX = ".tmp"       # _manifest.json.<pid>.tmp while a writer replaces the manifest
LOCK = "_lock"
COMPACT_LOCK = "_compact.lock"
OWNER_LOCK = "_consumer.lock"     # held by the consumer writing the warehouse
VIEWS_DIR = "_views"
FORMAT = 1
SEQ = "_seq"
DELETED = "_deleted"
GARBAGE_RETENTION = 300.0   # seconds a replaced file stays for readers that listed it




# type mapping: replicator.targets.arrow --------------------------------------------------

DECIMALS = "decimals"   # a manifest table entry's flag: its generation stores numeric(p,s) as DECIMAL(p,s)


def physical_name(column: Column) -> str:
    return f"c{column.attnum}" if column.attnum else "n_" + column.name


def physical_schema(structure: TableStructure, *, decimals: bool, log: bool = False) -> pa.Schema:
    fields = [pa.field(physical_name(c), arrow_type(c, decimals=decimals)) for c in structure.columns]
    if log:
        fields += [pa.field(SEQ, pa.int64()), pa.field(DELETED, pa.bool_())]
    return pa.schema(fields)


def stores_decimals(entry: Mapping[str, Any]) -> bool:
    """Whether a manifest table entry's generation stores numeric(p,s) as DECIMAL(p,s): one
    copied by a replicator before that keeps its text until it is copied again."""
    return bool(entry.get(DECIMALS))


def entry_schema(entry: Mapping[str, Any], *, log: bool = False) -> pa.Schema:
    """The physical schema of a manifest table entry's files."""
    return physical_schema(TableStructure.from_json(entry["structure"]), decimals=stores_decimals(entry), log=log)


def arrow_table(structure: TableStructure, rows: Sequence[Sequence[Any]], *, decimals: bool,
                seq: int | None = None, deleted: Sequence[bool] | None = None) -> pa.Table:
    """Rows (tuples in the structure's column order) as an Arrow table with physical names,
    numerics as decimals or text (the generation's DECIMALS flag); with seq, a change log table."""
    schema = physical_schema(structure, decimals=decimals, log=seq is not None)
    columns = list(zip(*rows)) if rows else [() for _ in structure.columns]
    arrays = [arrow_array(values, field.type, label=f"{structure.qualified_name}.{column.name}")
              for values, field, column in zip(columns, schema, structure.columns)]
    if seq is not None:
        arrays.append(pa.array([seq] * len(rows), type=pa.int64()))
        arrays.append(pa.array(deleted if deleted is not None else [False] * len(rows), type=pa.bool_()))
    return pa.Table.from_arrays(arrays, schema=schema)


# files and the manifest ---------------------------------------------------------------------

def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    try:
        fsync_file(path)
    except OSError as exc:
        if exc.errno != errno.EINVAL:   # EINVAL: a filesystem that cannot sync directories
            raise


def make_durable(paths: Iterable[Path], root: Path) -> None:
    """fsyncs files and every directory from their parents up to root, before a
    manifest names them: a file's name lives in its directory, a new directory's
    in its parent, and a power loss drops names whose directory was not synced."""
    directories: set[Path] = set()
    for path in paths:
        fsync_file(path)
        for directory in (path.parent, *path.parent.parents):
            directories.add(directory)
            if directory == root:
                break
        else:
            raise ValueError(f"{path} is not under {root}")
    for directory in sorted(directories, key=lambda d: len(d.parts), reverse=True):
        fsync_dir(directory)


def new_id() -> str:
    return uuid.uuid4().hex[:12]


def empty_manifest() -> dict[str, Any]:
    return {"format": FORMAT, "version": 0, "next_seq": 1, "positions": {}, "tables": {}, "views": {},
            "garbage": []}


def retire(manifest: dict[str, Any], relative: list[str]) -> None:
    """Files (or directories) the manifest no longer names: deleted by a later
    commit, once readers that listed them are done (GARBAGE_RETENTION)."""
    manifest.setdefault("garbage", []).append({"files": list(relative), "since": time.time()})


class Warehouse:
    """A warehouse directory: reads and commits its manifest."""

    def __init__(self, path: Path | str, *, create: bool = False) -> None:
        self.path = Path(path).expanduser().resolve()
        if create:
            self.path.mkdir(parents=True, exist_ok=True)

    @property
    def manifest_path(self) -> Path:
        return self.path / MANIFEST

    def exists(self) -> bool:
        return self.manifest_path.exists()

    def read(self) -> dict[str, Any]:
        """The committed manifest (an empty one before the first commit)."""
        try:
            text = self.manifest_path.read_text()
        except FileNotFoundError:
            return empty_manifest()
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"{self.manifest_path} is not a manifest ({exc}): restore it from a backup, "
                             f"or mirror into a new warehouse directory") from None
        if not isinstance(data, dict) or not all(isinstance(data.get(k), dict) for k in ("positions", "tables")):
            raise ValueError(f"{self.manifest_path} is not a manifest (no positions and tables): restore it "
                             f"from a backup, or mirror into a new warehouse directory")
        if data.get("format") != FORMAT:
            raise ValueError(f"{self.manifest_path} has format {data.get('format')}, expected {FORMAT}")
        return data

    @contextlib.contextmanager
    def lock(self, name: str = LOCK, *, wait: bool = True) -> Iterator[bool]:
        """An exclusive lock between writers (separate opens conflict, even in one process)."""
        fd = os.open(self.path / name, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                yield False
                return
            yield True
        finally:
            os.close(fd)

    def write(self, manifest: dict[str, Any]) -> None:
        """Makes a manifest the committed one: temporary file, fsync, rename, fsync
        of the directory. Call with the lock held (remove_orphans relies on it)."""
        manifest["version"] = int(manifest.get("version", 0)) + 1
        manifest["committed_at"] = time.time()
        tmp = self.path / f"{MANIFEST}.{os.getpid()}{MANIFEST_TMP_SUFFIX}"
        with open(tmp, "w") as f:
            json.dump(manifest, f, separators=(",", ":"))
            f.flush()
            os.fsync(f.fileno())
        crash_point("spark-manifest-written")
        os.replace(tmp, self.manifest_path)
        fsync_dir(self.path)

    def file(self, relative: str) -> Path:
        return self.path / relative

    def relative(self, path: Path) -> str:
        return str(path.relative_to(self.path))

    def collect_garbage(self, manifest: dict[str, Any], *, retention: float = GARBAGE_RETENTION) -> bool:
        """Deletes files replaced more than `retention` seconds ago; returns
        whether the manifest's garbage list changed (commit it then). A path is
        reached without following a symbolic link: one put on the way (a table's
        directory moved elsewhere and linked) is left, and what it points to."""
        now = time.time()
        keep, changed = [], False
        for entry in manifest.get("garbage", []):
            if now - entry["since"] >= retention:
                for relative in entry["files"]:
                    self._delete(relative)
                changed = True
            else:
                keep.append(entry)
        manifest["garbage"] = keep
        return changed

    def _delete(self, relative: str) -> None:
        """Deletes a file or directory tree of the warehouse, and the directories left empty
        above it, through directory descriptors opened with O_NOFOLLOW: nothing outside
        the warehouse directory is reached, whatever links are in it."""
        parts = Path(relative).parts
        if not parts or Path(relative).is_absolute() or any(p in ("", ".", "..") for p in parts):
            return
        try:
            parent = _open_below(self.path, parts[:-1])
        except OSError:
            return   # gone already, or a link on the way
        try:
            with contextlib.suppress(FileNotFoundError):
                st = os.stat(parts[-1], dir_fd=parent, follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    shutil.rmtree(parts[-1], ignore_errors=True, dir_fd=parent)   # follows no link inside
                elif stat.S_ISREG(st.st_mode):
                    os.unlink(parts[-1], dir_fd=parent)
        finally:
            os.close(parent)
        for depth in range(len(parts) - 1, 0, -1):   # the parents it emptied, up to the warehouse
            try:
                above = _open_below(self.path, parts[:depth - 1])
            except OSError:
                return
            try:
                os.rmdir(parts[depth - 1], dir_fd=above)
            except OSError:
                return
            finally:
                os.close(above)

    def referenced(self, manifest: dict[str, Any]) -> set[str]:
        """Every file the manifest names (tables and garbage)."""
        files: set[str] = set()
        for table in [*manifest["tables"].values(), *manifest.get("views", {}).values()]:
            files.update(table["base"])
            files.update(log["file"] for log in table["logs"])
        for entry in manifest.get("garbage", []):
            files.update(entry["files"])
        return files

    def remove_orphans(self, manifest: dict[str, Any], *, compaction: bool) -> int:
        """Deletes the files a crashed writer of replicator left behind: those no manifest
        names, named as replicator names its own (see the layout above). The consumer
        removes its own kind (logs and copied bases, views' files), a compaction the bases
        compactions write (directories compact-*). Both remove the manifest's temporary
        files: call with the lock held, which every manifest writer holds while its
        temporary file exists, so those left are a crashed one's.

        Nothing else is deleted, and no symbolic link is followed: an entry replicator
        did not make in the warehouse (a link, a file or directory of another name) is
        left as it is and refused with a UserError naming it, before anything is deleted
        (the consumer does not start beside it). Returns how many files it deleted."""
        referenced = self.referenced(manifest)
        referenced_dirs = {str(parent) for f in referenced for parent in Path(f).parents} | referenced
        files: list[tuple[str, ...]] = []       # leftovers, as path parts
        dirs: list[tuple[str, ...]] = []        # directories looked into, deepest last
        foreign: list[tuple[str, str]] = []     # (relative path, what it is)
        root = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            self._survey(root, (), "root", compaction, referenced, files, dirs, foreign)
        finally:
            os.close(root)
        if foreign:
            named = ", ".join(f"{relative} ({what})" for relative, what in foreign[:3])
            raise UserError(f"{self.path} holds {named}{', ...' if len(foreign) > 3 else ''}, which replicator "
                            f"did not make: it removes what its own crashed runs leave in a warehouse and follows "
                            f"no link, so it does not work beside {'them' if len(foreign) > 1 else 'it'}; move "
                            f"{'them' if len(foreign) > 1 else 'it'} out of the warehouse")
        removed = 0
        for parts in files:
            try:
                parent = _open_below(self.path, parts[:-1])
            except OSError:
                continue
            try:
                os.unlink(parts[-1], dir_fd=parent)
                removed += 1
            except FileNotFoundError:
                pass
            finally:
                os.close(parent)
        for parts in reversed(dirs):
            if "/".join(parts) in referenced_dirs:
                continue
            try:
                parent = _open_below(self.path, parts[:-1])
            except OSError:
                continue
            try:
                os.rmdir(parts[-1], dir_fd=parent)   # only if it is empty now
            except OSError:
                pass
            finally:
                os.close(parent)
        return removed

    def _survey(self, fd: int, parts: tuple[str, ...], kind: str, compaction: bool, referenced: set[str],
                files: list[tuple[str, ...]], dirs: list[tuple[str, ...]], foreign: list[tuple[str, str]]) -> None:
        """Lists the directory fd (at parts, of the layout's kind): replicator's leftovers
        into files (those of the caller's kind), the directories it looked into into
        dirs, what replicator did not make into foreign. A path the manifest names, or
        lying in a directory it names, is not looked at."""
        with os.scandir(fd) as entries:
            listed = sorted((e.name, e.stat(follow_symlinks=False).st_mode) for e in entries)
        inside_compaction = kind in _COMPACTION_KINDS
        for name, mode in listed:
            child = (*parts, name)
            relative = "/".join(child)
            if relative in referenced or _under(relative, referenced):
                continue
            is_dir, is_file = stat.S_ISDIR(mode), stat.S_ISREG(mode)
            layout = _layout(kind, name, is_dir) if is_dir or is_file else None
            if compaction and not inside_compaction:
                # a compaction looks only at what compactions write (and the manifest's
                # temporary files), reached through replicator's directories, which it
                # does not judge: the consumer's are the consumer's
                if layout == "manifest-temporary":
                    files.append(child)
                elif layout in ("table", "generation", "compact") and not stat.S_ISLNK(mode):
                    self._survey_into(fd, child, layout, compaction, referenced, files, dirs, foreign)
                continue
            if stat.S_ISLNK(mode):
                foreign.append((relative, "a symbolic link"))
            elif not (is_dir or is_file):
                foreign.append((relative, "not a file or directory"))
            elif layout is None:
                foreign.append((relative, "a directory" if is_dir else "a file"))
            elif layout == "keep" or (layout == "compact" and not compaction):
                continue   # never deleted; a compaction's work, which only a compaction removes
            elif layout in ("leftover", "manifest-temporary"):
                files.append(child)
            else:
                self._survey_into(fd, child, layout, compaction, referenced, files, dirs, foreign)

    def _survey_into(self, fd: int, child: tuple[str, ...], layout: str, compaction: bool, referenced: set[str],
                     files: list[tuple[str, ...]], dirs: list[tuple[str, ...]],
                     foreign: list[tuple[str, str]]) -> None:
        try:
            sub = os.open(child[-1], os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
        except FileNotFoundError:
            return
        try:
            if not compaction or layout in _COMPACTION_KINDS:   # a compaction removes only its own directories
                dirs.append(child)
            self._survey(sub, child, layout, compaction, referenced, files, dirs, foreign)
        finally:
            os.close(sub)


# What replicator makes in a warehouse, by the kind of directory it is in: name patterns
# (entries of another name are not replicator's, and are never deleted).
_ID = r"[0-9a-f]{12}"
_LAYOUT: dict[str, list[tuple[str, bool, str]]] = {
    # kind of directory: [(name pattern, is a directory, what the entry is)]
    "root": [(re.escape(MANIFEST), False, "keep"), (re.escape(LOCK), False, "keep"),
             (re.escape(COMPACT_LOCK), False, "keep"), (re.escape(OWNER_LOCK), False, "keep"),
             (re.escape(MANIFEST) + r"\.\d+" + re.escape(MANIFEST_TMP_SUFFIX), False, "manifest-temporary"),
             (re.escape(VIEWS_DIR), True, "views"), (rf"[\w-]+-{_ID}", True, "table")],
    "table": [(rf"g-{_ID}", True, "generation")],
    "generation": [(rf"base-\d{{5}}\.parquet|base-{_ID}-\d{{3,}}\.parquet|log-\d{{12}}-{_ID}\.parquet", False,
                    "leftover"),
                   (rf"compact-{_ID}", True, "compact")],
    "views": [(rf"\w+-{_ID}", True, "view")],
    "view": [(rf"g-{_ID}", True, "view-generation")],
    "view-generation": [(rf"base|log-\d{{12}}-{_ID}", True, "spark")],
    # a directory Spark wrote (or pyarrow, a view's log): its part files, their checksums, its marker
    "spark": [(r"part-.+|\.part-.+\.crc|_SUCCESS|\._SUCCESS\.crc", False, "leftover"),
              ("_temporary", True, "temporary")],
    "compact": [(r"part-.+|\.part-.+\.crc|_SUCCESS|\._SUCCESS\.crc", False, "leftover"),
                ("_temporary", True, "compact-temporary")],
    "temporary": [(r".+", True, "temporary"), (r".+", False, "leftover")],           # Spark's work in progress
    "compact-temporary": [(r".+", True, "compact-temporary"), (r".+", False, "leftover")],
}


_COMPACTION_KINDS = {"compact", "compact-temporary"}


def _layout(kind: str, name: str, is_dir: bool) -> str | None:
    """What an entry of a directory of this kind is in replicator's layout (None: not replicator's)."""
    return next((what for pattern, directory, what in _LAYOUT[kind]
                 if directory == is_dir and re.fullmatch(pattern, name)), None)


def _open_below(root: Path, parts: Sequence[str]) -> int:
    """A directory below root, opened one name at a time without following a link."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        for part in parts:
            sub = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = sub
    except BaseException:
        os.close(fd)
        raise
    return fd


def _under(relative: str, referenced: set[str]) -> bool:
    """Whether a file lies in a directory the manifest names (a view's files, garbage)."""
    parts = Path(relative).parents
    return any(str(p) in referenced for p in parts)


def table_files(entry: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(base files, log files) of a manifest table entry, logs oldest first."""
    return list(entry["base"]), [log["file"] for log in entry["logs"]]
