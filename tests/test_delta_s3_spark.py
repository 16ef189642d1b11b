"""Spark writing a replica table on S3 beside the consumer (the session replicator.spark.get_session
makes): its commits and the consumer's exclude each other, so none overwrites another.

The race is forced: the S3 server is a moto server in this process, whose PutObject is wrapped so
that the consumer commits version N while Spark's PUT of version N is on its way (after every check
Spark makes before it). Each commit file must then be the one its writer wrote. The tables are read
through Spark, out of this process: delta-rs' scan holds the GIL the server's threads need.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import boto3
import pytest

pytest.importorskip("deltalake")
pytest.importorskip("pyspark")
from moto.s3.responses import S3Response
from moto.server import ThreadedMotoServer
from py4j.protocol import Py4JJavaError

from replicator.consumer import Consumer
from replicator.spark_session.jars import LOG_STORE, RESOLVED, build_log_store, cache_dir, jar_settings, log_store_jar
from replicator.targets.delta import log as delta_log
from replicator.targets.delta.object_storage import ObjectStorage
from replicator.targets.delta.reader import read_table, table_uris
from replicator.targets.delta.target import DeltaTarget
from s3_helpers import CREDENTIALS, UNSET
from test_delta_s3 import _spark_rows
from test_delta_target import diff, source_state


class RacingServer:
    """An S3 server (moto, in this process) that runs `before` once when a PUT of `key` arrives,
    before the server handles it."""

    def __init__(self) -> None:
        self.endpoint = ""
        self.armed: tuple[str, Callable[[], None]] | None = None
        self.fired = threading.Event()

    def put_object(self, original: Callable[[S3Response], Any]) -> Callable[[S3Response], Any]:
        def put(response: S3Response) -> Any:
            if self.armed is not None and response.parse_key_name() == self.armed[0]:
                _, before = self.armed
                self.armed = None
                before()
                self.fired.set()
            return original(response)
        return put


@pytest.fixture
def racing_s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[RacingServer]:
    racing = RacingServer()
    monkeypatch.setattr(S3Response, "put_object", racing.put_object(S3Response.put_object))
    server = ThreadedMotoServer("127.0.0.1", 0, verbose=False)
    server.start()
    racing.endpoint = "http://{}:{}".format(*server.get_host_and_port())
    for name in UNSET:
        monkeypatch.delenv(name, raising=False)
    for name, value in {"AWS_ENDPOINT_URL": racing.endpoint, **CREDENTIALS}.items():
        monkeypatch.setenv(name, value)
    try:
        yield racing
    finally:
        server.stop()


def _consume(dsn: str, url: str) -> None:
    consumer = Consumer(dsn, "q", DeltaTarget(url), name="c")
    try:
        consumer.run(until_caught_up=True)
    finally:
        consumer.close()


def _commit(url: str, directory: str, version: int) -> list[dict[str, Any]]:
    text = ObjectStorage(url).read(f"{directory}/_delta_log/{version:020d}.json").decode()
    return [json.loads(line) for line in text.splitlines()]


def _operation(actions: list[dict[str, Any]]) -> str:
    return str(next(a["commitInfo"].get("operation") for a in actions if "commitInfo" in a))


# Spark's statement and its effect on the source's rows. Delta decides whether the consumer's
# commit it meets conflicts (OPTIMIZE: never; this DELETE: now, as the consumer's MERGE adds rows it
# might have had to read): the statement then commits after it, or fails with Delta's conflict.
RACES = [("OPTIMIZE {table}", None), ("DELETE FROM {table} WHERE id = 7", "DELETE FROM t WHERE id = 7")]


@pytest.mark.s3   # a server of its own (racing_s3)
@pytest.mark.parametrize(("statement", "effect"), RACES)
def test_a_spark_commit_racing_the_consumers_to_one_version_on_s3_never_overwrites_it(
        dsn, conn, source, spark, racing_s3, statement, effect):
    operation = statement.split()[0]
    bucket = f"race-{operation.lower()}-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=racing_s3.endpoint, region_name=CREDENTIALS["AWS_REGION"]).create_bucket(Bucket=bucket)
    url = f"s3://{bucket}/warehouse"
    spark.sparkContext._jsc.hadoopConfiguration().set(f"fs.s3a.bucket.{bucket}.endpoint", racing_s3.endpoint)
    conn.execute("CREATE TABLE t (id bigint PRIMARY KEY, v text)")
    conn.execute("INSERT INTO t SELECT g, 'v' || g FROM generate_series(1, 50) g")
    source.create_queue("q")
    source.add_table("q", "t")
    _consume(dsn, url)
    for batch in range(3):   # small files for OPTIMIZE to compact
        conn.execute("INSERT INTO t SELECT g, 'b' FROM generate_series(%s::bigint, %s::bigint) g",
                     (100 + 10 * batch, 109 + 10 * batch))
        _consume(dsn, url)
    uri = table_uris(url)["public.t"]
    directory = uri.rsplit("/", 1)[-1]
    race = delta_log.load(ObjectStorage(url), directory).version + 1

    def the_consumer_commits_first() -> None:
        conn.execute("INSERT INTO t SELECT g, 'raced' FROM generate_series(500, 504) g")
        _consume(dsn, url)

    assert spark.conf.get("spark.delta.logStore.s3a.impl") == LOG_STORE
    racing_s3.armed = (f"warehouse/{directory}/_delta_log/{race:020d}.json", the_consumer_commits_first)
    query = statement.format(table=f"delta.`{uri.replace('s3://', 's3a://', 1)}`")
    try:
        spark.sql(query).collect()
        conflict = ""
    except Py4JJavaError as exc:
        conflict = str(exc).splitlines()[1]
        assert conflict.startswith(": io.delta.exceptions.Concurrent"), conflict
    assert racing_s3.fired.is_set(), "Spark's commit did not meet the consumer's"

    raced = _commit(url, directory, race)
    assert any("txn" in a for a in raced) and _operation(raced) != operation, \
        f"the consumer's commit of version {race} was overwritten by Spark's {_operation(raced)}"
    last = delta_log.load(ObjectStorage(url), directory).version
    if conflict:
        assert last == race
    else:
        assert last == race + 1 and _operation(_commit(url, directory, last)) == operation
        if effect:
            conn.execute(effect)
    problems = diff("t", source_state(conn, "t"), _spark_rows(read_table(spark, f"delta:{url}", "t"), ["id"]))
    assert not problems, "\n".join(problems[:30])


def test_the_log_store_is_built_into_the_jar_cache_and_given_to_delta_for_s3():
    directory = cache_dir()
    assert build_log_store(directory) == log_store_jar(directory)
    settings = jar_settings(directory)
    assert str(log_store_jar(directory)) in settings["spark.jars"].split(",")
    assert settings["spark.delta.logStore.s3a.impl"] == settings["spark.delta.logStore.s3.impl"] == LOG_STORE


def test_without_javac_sessions_keep_delta_s_log_store_and_a_warning_says_why(tmp_path, monkeypatch, caplog):
    (tmp_path / "jars").mkdir()
    (tmp_path / "jars" / "delta.jar").write_bytes(b"jar")
    (tmp_path / RESOLVED).write_text("delta.jar\n")
    monkeypatch.setenv("PATH", str(tmp_path))
    assert build_log_store(tmp_path) is None
    assert "cannot build replicator's Delta log store (no javac (a JDK))" in caplog.text
    assert jar_settings(tmp_path) == {"spark.jars": str(tmp_path / "jars" / "delta.jar")}
