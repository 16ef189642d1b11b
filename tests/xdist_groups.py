"""--dist loadgroup that groups: pytest-xdist 3.8 tells its scheduler a test's xdist_group by
appending it to the test's node id, which pytest 9.2 no longer lets a plugin change
(pytest-dev/pytest-xdist#1386). Nothing fails: the tests of a group just go to whichever worker is
free, so each worker starts a Spark session and a broker of its own. Here the workers write each
grouped test's group to a file of the run, and the scheduler reads the groups from there."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
from xdist.remote import Producer
from xdist.scheduler import LoadGroupScheduling
from xdist.workermanage import WorkerController

_DIRECTORY = pytest.StashKey[tempfile.TemporaryDirectory[str]]()
_WORKERINPUT_KEY = "replicator_xdist_groups"


def start(config: pytest.Config) -> None:
    """On the controller of a --dist loadgroup run: a directory for the workers' files."""
    if config.getoption("dist", "no") == "loadgroup" and not hasattr(config, "workerinput"):
        config.stash[_DIRECTORY] = tempfile.TemporaryDirectory(prefix="replicator-xdist-groups-")


def stop(config: pytest.Config) -> None:
    if _DIRECTORY in config.stash:
        config.stash[_DIRECTORY].cleanup()


def tell_worker(node: WorkerController) -> None:
    """Give a worker about to start the directory to write its groups to."""
    if _DIRECTORY in node.config.stash:
        node.workerinput[_WORKERINPUT_KEY] = node.config.stash[_DIRECTORY].name


def write_groups(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On a worker: each grouped test's group, by node id (a pytest older than 9.2 lets xdist append
    the group to the node id later, which LoadGroupScheduling reads as it always did)."""
    workerinput = getattr(config, "workerinput", {})
    if _WORKERINPUT_KEY not in workerinput:
        return
    groups = {item.nodeid: _group(mark) for item in items if (mark := item.get_closest_marker("xdist_group"))}
    (Path(workerinput[_WORKERINPUT_KEY]) / f"{workerinput['workerid']}.json").write_text(json.dumps(groups))


def _group(mark: pytest.Mark) -> str:
    return str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))


class FileGroupScheduling(LoadGroupScheduling):
    """LoadGroupScheduling with the groups the workers wrote. The scheduler splits the node ids
    into scopes once every worker has collected, so every worker has written its file by then."""

    def __init__(self, config: pytest.Config, log: Producer | None = None) -> None:
        super().__init__(config, log)
        self._directory = Path(config.stash[_DIRECTORY].name)
        self._groups: dict[str, str] | None = None

    def _split_scope(self, nodeid: str) -> str:
        if self._groups is None:
            self._groups = {}
            for path in sorted(self._directory.glob("*.json")):
                self._groups.update(json.loads(path.read_text()))
        return self._groups.get(nodeid) or super()._split_scope(nodeid)


def make_scheduler(config: pytest.Config, log: Producer) -> FileGroupScheduling | None:
    return FileGroupScheduling(config, log) if _DIRECTORY in config.stash else None
