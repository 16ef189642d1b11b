"""An S3-compatible server for tests: moto's server (pure Python, in memory) on a free
loopback port, its writes atomic as S3's are (moto_atomic_server.py), and the environment that points the AWS
clients (obstore, delta-rs, Spark's s3a, boto3) at it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import boto3
import pytest

# moto accepts any key unless told to check them (INITIAL_NO_AUTH_ACTION_COUNT)
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_REGION": "us-east-1"}
# what else in the environment could point a client elsewhere, or at a real account
UNSET = ("AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_REGION", "AWS_ALLOW_HTTP")


class MotoServer:
    def __init__(self, log: Path, env: dict[str, str] | None = None) -> None:
        self.log = log
        self.env = env or {}
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, deadline_s: float = 60.0, attempts: int = 3) -> MotoServer:
        """Starts the server and returns once it answers; a port taken between choosing and
        binding it (the server exits at once) is chosen again."""
        for _ in range(attempts):
            self.port = _free_port()
            with open(self.log, "ab") as log:
                self.process = subprocess.Popen(
                    [sys.executable, str(Path(__file__).with_name("moto_atomic_server.py")), "-H", "127.0.0.1",
                     "-p", str(self.port)],
                    stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **self.env})
            deadline = time.monotonic() + deadline_s
            while self.process.poll() is None:
                if self._answers():
                    return self
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"moto_server did not answer within {deadline_s:.0f} s: see {self.log}")
                time.sleep(0.1)   # polling interval, not synchronisation
        raise RuntimeError(f"moto_server exited ({self.process.returncode}) {attempts} times: see {self.log}")

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.endpoint}/", timeout=2):
                return True
        except urllib.error.HTTPError:   # any HTTP answer means it serves
            return True
        except OSError:
            return False

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def environment(self) -> dict[str, str]:
        """The variables that point every AWS client at this server."""
        return {"AWS_ENDPOINT_URL": self.endpoint, **CREDENTIALS}

    def apply_env(self, monkeypatch: pytest.MonkeyPatch) -> None:
        for name in UNSET:
            monkeypatch.delenv(name, raising=False)
        for name, value in self.environment().items():
            monkeypatch.setenv(name, value)

    def create_bucket(self, prefix: str = "bucket") -> str:
        """A new bucket (S3 names: 3 to 63 characters, lower case)."""
        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
                     aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
                     region_name=CREDENTIALS["AWS_REGION"]).create_bucket(Bucket=name)
        return name


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
