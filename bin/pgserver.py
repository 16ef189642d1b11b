"""A throwaway PostgreSQL cluster for the demo, the tests and the benchmarks.

Uses the local server binaries (``initdb``, ``pg_ctl``); when running as root
they are run as the ``postgres`` user through ``runuser``, since PostgreSQL
refuses to run as root.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

from replicator.errors import UserError


def _bindir() -> Path:
    """Directory holding initdb/pg_ctl: $PG_BINDIR, pg_config, or the newest Debian version."""
    if os.environ.get("PG_BINDIR"):
        return Path(os.environ["PG_BINDIR"])
    debian = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"), key=lambda p: int(p.parts[-3]))
    if debian:
        return debian[-1].parent
    found = shutil.which("pg_ctl")
    if found:
        return Path(found).parent
    raise UserError("PostgreSQL server binaries not found: install the 'postgresql' package or set PG_BINDIR")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class PgServer:
    """A PostgreSQL cluster in its own directory, listening on 127.0.0.1 only."""

    def __init__(self, datadir: str | Path | None = None, port: int | None = None,
                 settings: dict[str, str] | None = None) -> None:
        self.bindir = _bindir()
        self.basedir = Path(datadir) if datadir else Path(tempfile.mkdtemp(prefix="replicator-pg-"))
        self.datadir = self.basedir / "data"
        self.port = port or _free_port()
        self.settings = {
            "listen_addresses": "'127.0.0.1'",
            "unix_socket_directories": f"'{self.basedir}'",
            "fsync": "off",
            "synchronous_commit": "off",
            "full_page_writes": "off",
            "max_connections": "200",
            "max_prepared_transactions": "10",
            "log_min_messages": "warning",
            **(settings or {}),
        }
        self._as_postgres = os.geteuid() == 0

    @property
    def dsn(self) -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres"

    def _run(self, *args: str) -> subprocess.CompletedProcess[str]:
        cmd = [str(self.bindir / args[0]), *args[1:]]
        if self._as_postgres:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stdout}\n{result.stderr}")
        return result

    def init(self) -> PgServer:
        self.basedir.mkdir(parents=True, exist_ok=True)
        if self._as_postgres:
            shutil.chown(self.basedir, "postgres", "postgres")
            if subprocess.run(["runuser", "-u", "postgres", "--", "test", "-w", str(self.basedir)]).returncode:
                raise UserError(f"PostgreSQL runs as user postgres, which cannot write {self.basedir} (a parent "
                                f"directory is closed to it): choose a directory it can reach")
        if not (self.datadir / "PG_VERSION").exists():
            self._run("initdb", "-D", str(self.datadir), "-U", "postgres", "-A", "trust",
                      "-E", "UTF8", "--locale=C", "--no-sync")
            with open(self.datadir / "postgresql.conf", "a") as conf:
                for key, value in self.settings.items():
                    conf.write(f"{key} = {value}\n")
        return self

    def start(self) -> PgServer:
        self._run("pg_ctl", "-D", str(self.datadir), "-o", f"-p {self.port}", "-w",
                  "-l", str(self.basedir / "server.log"), "start")
        return self

    def stop(self, mode: str = "fast") -> None:
        self._run("pg_ctl", "-D", str(self.datadir), "-m", mode, "-w", "stop")

    def restart(self, mode: str = "fast") -> None:
        """Restart the server; mode "immediate" simulates a crash."""
        self._run("pg_ctl", "-D", str(self.datadir), "-m", mode, "-o", f"-p {self.port}", "-w",
                  "-l", str(self.basedir / "server.log"), "restart")

    def is_running(self) -> bool:
        cmd = [str(self.bindir / "pg_ctl"), "-D", str(self.datadir), "status"]
        if self._as_postgres:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        return subprocess.run(cmd, capture_output=True).returncode == 0

    def destroy(self) -> None:
        if self.is_running():
            self.stop("immediate")
        shutil.rmtree(self.basedir, ignore_errors=True)

    def __enter__(self) -> PgServer:
        return self.init().start()

    def __exit__(self, *exc: object) -> None:
        self.destroy()
