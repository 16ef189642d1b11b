"""The Spark session replicator starts reads and writes Delta tables (SQL, time travel,
history, OPTIMIZE) in a local directory and, through s3a, in S3 (the moto server); its
settings: Delta's, the jars from replicator's cache, s3a from the environment, the
user's own on top."""

from __future__ import annotations

import os
import signal
import subprocess

import deltalake
import pytest

import spark_helpers
from replicator.spark_session.jars import PACKAGES, RESOLVED, cache_dir, jar_settings, record_resolution
from replicator.spark_session.session import DELTA, session_settings
from replicator.targets.delta.object_storage import ObjectStorage


def _write_versions(spark, path: str) -> None:
    """Versions 0 (create) to 4 (optimize) of a small table, by Spark SQL."""
    spark.sql(f"CREATE TABLE delta.`{path}` (id BIGINT, name STRING) USING delta")
    spark.sql(f"INSERT INTO delta.`{path}` VALUES (1, 'one'), (2, 'two')")
    spark.sql(f"UPDATE delta.`{path}` SET name = 'TWO' WHERE id = 2")
    spark.sql(f"INSERT INTO delta.`{path}` VALUES (3, 'three')")
    spark.sql(f"OPTIMIZE delta.`{path}`")


def _rows(frame) -> list[tuple[int, str]]:
    return sorted((row.id, row.name) for row in frame.collect())


def _assert_versions(spark, path: str) -> None:
    assert _rows(spark.read.format("delta").load(path)) == [(1, "one"), (2, "TWO"), (3, "three")]
    assert _rows(spark.read.format("delta").option("versionAsOf", 1).load(path)) == [(1, "one"), (2, "two")]
    assert _rows(spark.sql(f"SELECT * FROM delta.`{path}` VERSION AS OF 2")) == [(1, "one"), (2, "TWO")]
    history = spark.sql(f"DESCRIBE HISTORY delta.`{path}`").collect()
    assert [(row.version, row.operation) for row in history] == [
        (4, "OPTIMIZE"), (3, "WRITE"), (2, "UPDATE"), (1, "WRITE"), (0, "CREATE TABLE")]


def test_a_session_writes_a_local_delta_table_with_sql_and_reads_its_versions(spark, tmp_path):
    path = str(tmp_path / "warehouse" / "t")
    _write_versions(spark, path)
    _assert_versions(spark, path)
    assert (tmp_path / "warehouse" / "t" / "_delta_log" / "00000000000000000004.json").is_file()


def test_a_session_writes_a_delta_table_in_s3_through_s3a_that_delta_rs_reads_too(spark, s3_url):
    path = f"{s3_url}/t"   # the s3:// URL replicator and delta-rs are given, as is
    _write_versions(spark, path)
    _assert_versions(spark, path)
    root, options = ObjectStorage(s3_url).delta_rs()
    table = deltalake.DeltaTable(f"{root}/t", storage_options=options, version=1)
    assert sorted(table.to_pyarrow_table().to_pylist(), key=lambda r: r["id"]) == [
        {"id": 1, "name": "one"}, {"id": 2, "name": "two"}]
    assert deltalake.DeltaTable(f"{root}/t", storage_options=options).version() == 4


# settings


def test_the_user_conf_wins_over_replicator_settings_and_adds_to_its_lists(tmp_path):
    settings = session_settings({"spark.sql.shuffle.partitions": "64", "spark.jars.packages": "org.example:mine:1.0",
                                 "spark.sql.extensions": "org.example.MyExtension"}, environ={}, jars=tmp_path)
    assert settings["spark.sql.shuffle.partitions"] == "64"
    assert settings["spark.jars.packages"] == ",".join((*PACKAGES, "org.example:mine:1.0"))
    assert settings["spark.sql.extensions"] == f"{DELTA['spark.sql.extensions']},org.example.MyExtension"
    assert settings["spark.sql.catalog.spark_catalog"] == "org.apache.spark.sql.delta.catalog.DeltaCatalog"


def test_s3a_is_pointed_at_the_environment_endpoint_in_path_style_without_tls_for_http(tmp_path):
    settings = session_settings(None, environ={"AWS_ENDPOINT_URL": "http://127.0.0.1:9000/"}, jars=tmp_path)
    assert {key: value for key, value in settings.items() if key.startswith("spark.hadoop.")} == {
        "spark.hadoop.fs.s3.impl": "org.apache.hadoop.fs.s3a.S3AFileSystem",
        "spark.hadoop.fs.AbstractFileSystem.s3.impl": "org.apache.hadoop.fs.s3a.S3A",
        "spark.hadoop.fs.s3a.endpoint": "http://127.0.0.1:9000",
        "spark.hadoop.fs.s3a.path.style.access": "true",
        "spark.hadoop.fs.s3a.connection.ssl.enabled": "false",
        "spark.hadoop.fs.s3a.endpoint.region": "us-east-1"}
    on_aws = session_settings(None, environ={"AWS_REGION": "eu-west-1"}, jars=tmp_path)
    assert "spark.hadoop.fs.s3a.endpoint" not in on_aws
    assert on_aws["spark.hadoop.fs.s3a.endpoint.region"] == "eu-west-1"


def test_the_jars_are_resolved_into_the_cache_until_a_resolution_is_recorded_there(tmp_path):
    assert jar_settings(tmp_path) == {"spark.jars.packages": ",".join(PACKAGES),
                                      "spark.jars.excludes": "software.amazon.awssdk:bundle,"
                                      "org.apache.hadoop:hadoop-client-api,org.apache.hadoop:hadoop-client-runtime",
                                      "spark.jars.ivy": str(tmp_path)}
    (tmp_path / "jars").mkdir()
    jars = ["{}_{}-{}.jar".format(*package.split(":")) for package in PACKAGES] + ["io.netty_netty-common-4.1.jar"]
    for name in jars[1:]:
        (tmp_path / "jars" / name).write_bytes(b"jar")
    assert record_resolution(tmp_path) is False   # Delta's jar is not there: Ivy put them elsewhere
    (tmp_path / "jars" / jars[0]).write_bytes(b"jar")
    assert record_resolution(tmp_path) is True
    assert sorted(jar_settings(tmp_path)["spark.jars"].split(",")) == sorted(str(tmp_path / "jars" / n) for n in jars)
    (tmp_path / "jars" / jars[-1]).unlink()   # a cache emptied by hand resolves again
    assert "spark.jars.packages" in jar_settings(tmp_path)
    assert (tmp_path / RESOLVED).is_file()


def test_the_jar_cache_is_replicator_s_own_or_the_one_the_environment_names(tmp_path):
    assert cache_dir({"XDG_CACHE_HOME": str(tmp_path)}).parent == tmp_path / "replicator" / "spark-jars"
    assert cache_dir({"REPLICATOR_SPARK_JARS": str(tmp_path / "jars")}).parent == tmp_path / "jars"


# the tests' session: one that stops answering is replaced, not handed to the next test

def _jvm_process(spark) -> subprocess.Popen[bytes]:
    return spark.sparkContext._gateway.proc   # PySpark's: the JVM of the process's current session


def test_a_session_whose_jvm_died_is_replaced_by_a_working_one(spark_sessions):
    dead = spark_sessions.healthy()
    jvm = _jvm_process(dead)
    jvm.kill()
    jvm.wait()
    with pytest.warns(UserWarning, match="did not run a one-row job"):
        replaced = spark_sessions.healthy()
    assert replaced is not dead and _jvm_process(replaced).pid != jvm.pid
    assert replaced.range(3).count() == 3
    assert spark_sessions.healthy() is replaced   # kept while it answers


def test_a_session_whose_jvm_stalls_is_replaced_once_the_probe_times_out(spark_sessions, monkeypatch):
    stalled = spark_sessions.healthy()
    jvm = _jvm_process(stalled)
    monkeypatch.setattr(spark_helpers, "PROBE_SECONDS", 2.0)
    os.kill(jvm.pid, signal.SIGSTOP)
    with pytest.warns(UserWarning, match="within 2 s"):
        replaced = spark_sessions.healthy()
    assert jvm.poll() is not None   # killed, not left stopped
    assert replaced.range(3).count() == 3
