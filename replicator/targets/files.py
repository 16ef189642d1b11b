"""What a target knows of its files: whether one is still the file it opened, and what kind a path is."""

from __future__ import annotations

import os
import stat
from pathlib import Path


def file_changed(path: str | Path, mine: int | tuple[int, int]) -> str:
    """How the file at `path` differs from the one a target writes, given as the descriptor
    it holds open or as the (st_dev, st_ino) it had: "" when it is that file, "deleted"
    when nothing is there, "replaced" when another file is. One stat(), before each batch:
    a target whose file was deleted or replaced would go on writing what nobody reads."""
    if isinstance(mine, int):
        st = os.fstat(mine)
        mine = (st.st_dev, st.st_ino)
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return "deleted"
    return "" if (st.st_dev, st.st_ino) == mine else "replaced"


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def special_file(path: str | Path) -> str | None:
    """What is at `path` when it is neither a regular file nor nothing ("a directory", "a
    named pipe (FIFO)", ...; symbolic links followed), else None. A target's files are
    read back, cut back and written at offsets: only a regular file can be one."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    if stat.S_ISREG(mode):
        return None
    return next((kind for test, kind in _KINDS if test(mode)), "not a regular file")
