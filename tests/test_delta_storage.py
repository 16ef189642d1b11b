"""Where a Delta warehouse lives: a local directory and an object store (S3 on the moto
server) behave alike for every operation the Delta writer uses, put-if-absent is exclusive
under concurrency, and an object store's problems a user can fix are one-line errors."""

from __future__ import annotations

import io
import multiprocessing
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path

import boto3
import deltalake
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from replicator.errors import UserError
from replicator.targets.delta.object_storage import ObjectStorage
from replicator.targets.delta.storage import LocalStorage, Storage
from replicator.targets.delta.url import open_storage
from s3_helpers import MotoServer


@pytest.fixture(params=["local", "s3"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "local":
        return str(tmp_path / "warehouse")
    return str(request.getfixturevalue("s3_url"))


@pytest.fixture
def storage(url: str) -> Storage:
    return open_storage(url)


def test_open_storage_takes_a_path_or_file_url_as_local_and_an_s3_url_as_object_storage(tmp_path, s3_url):
    assert isinstance(open_storage(str(tmp_path)), LocalStorage)
    assert isinstance(open_storage(f"file://{tmp_path}"), LocalStorage)
    assert isinstance(open_storage(s3_url), ObjectStorage)


def test_a_written_file_reads_back_and_a_second_write_replaces_it(storage):
    assert not storage.exists("t/_delta_log/00000000000000000000.json")
    storage.write("t/_delta_log/00000000000000000000.json", b"first")
    assert storage.exists("t/_delta_log/00000000000000000000.json")
    assert storage.read("t/_delta_log/00000000000000000000.json") == b"first"
    storage.write("t/_delta_log/00000000000000000000.json", b"second")
    assert storage.read("t/_delta_log/00000000000000000000.json") == b"second"


def test_reading_a_missing_file_raises_file_not_found(storage):
    with pytest.raises(FileNotFoundError):
        storage.read("t/none.json")


def test_put_if_absent_writes_a_new_file_and_refuses_an_existing_one(storage):
    assert storage.put_if_absent("t/_delta_log/00000000000000000001.json", b"ours") is True
    assert storage.put_if_absent("t/_delta_log/00000000000000000001.json", b"theirs") is False
    assert storage.read("t/_delta_log/00000000000000000001.json") == b"ours"


def test_put_if_absent_has_exactly_one_winner_among_racing_threads(storage):
    for version in range(10):
        path = f"t/_delta_log/{version:020d}.json"
        start, won = threading.Barrier(6), []

        def commit(writer: int, path: str = path, start: threading.Barrier = start, won: list[int] = won) -> None:
            start.wait()
            if storage.put_if_absent(path, f"writer {writer}".encode()):
                won.append(writer)

        threads = [threading.Thread(target=commit, args=(writer,)) for writer in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert len(won) == 1, (version, won)
        assert storage.read(path) == f"writer {won[0]}".encode()


def _commit_in_a_process(url: str, path: str, writer: int, start, results) -> None:
    storage = open_storage(url)
    start.wait()
    results.put((writer, storage.put_if_absent(path, f"writer {writer}".encode())))


def test_put_if_absent_has_exactly_one_winner_among_racing_processes(storage, url):
    context = multiprocessing.get_context("spawn")   # each process its own client, as separate consumers have
    for version in range(2):
        path = f"t/_delta_log/{version:020d}.json"
        start, results = context.Barrier(4), context.Queue()
        processes = [context.Process(target=_commit_in_a_process, args=(url, path, writer, start, results))
                     for writer in range(4)]
        for process in processes:
            process.start()
        outcomes = dict(results.get(timeout=120) for _ in processes)
        for process in processes:
            process.join(timeout=60)
            assert process.exitcode == 0
        winners = [writer for writer, won in outcomes.items() if won]
        assert len(winners) == 1, outcomes
        assert storage.read(path) == f"writer {winners[0]}".encode()


def test_open_write_shows_the_file_only_when_the_block_ends(storage):
    with storage.open_write("t/part-0.parquet") as f:
        f.write(b"x" * 1000)
        f.write(b"y" * 1000)
        assert not storage.exists("t/part-0.parquet")
    assert storage.read("t/part-0.parquet") == b"x" * 1000 + b"y" * 1000


@pytest.mark.parametrize("size", [1000, 12 * 1024 * 1024], ids=["small", "multipart"])
def test_open_write_leaves_nothing_when_the_block_raises(storage, size):
    with pytest.raises(RuntimeError, match="writer failed"), storage.open_write("t/part-0.parquet") as f:
        f.write(b"x" * size)   # 12 MB: obstore has begun a multipart upload (its parts are 10 MB)
        raise RuntimeError("writer failed")
    assert not storage.exists("t/part-0.parquet")
    assert storage.list("t") == []


def test_open_write_takes_pyarrow_parquet_and_open_read_serves_its_footer_and_row_groups(storage):
    table = pa.table({"id": pa.array(range(50_000), pa.int64()), "name": [f"name {i}" for i in range(50_000)]})
    with storage.open_write("t/part-0.parquet") as f:
        pq.write_table(table, f, row_group_size=10_000)
    parquet = pq.ParquetFile(storage.open_read("t/part-0.parquet"))
    assert parquet.metadata.num_rows == 50_000
    assert parquet.metadata.num_row_groups == 5
    assert parquet.read_row_group(3, columns=["id"]).column("id").to_pylist() == list(range(30_000, 40_000))
    assert pq.read_table(storage.open_read("t/part-0.parquet")).equals(table)


def test_open_read_seeks_from_the_start_the_position_and_the_end(storage):
    storage.write("t/f.bin", bytes(range(256)) * 4)
    with storage.open_read("t/f.bin") as f:
        assert f.seekable()
        f.seek(-4, io.SEEK_END)
        assert f.read(4) == bytes(range(252, 256))
        f.seek(10)
        assert f.read(3) == bytes([10, 11, 12])
        f.seek(2, io.SEEK_CUR)
        assert f.tell() == 15
        assert f.read() == (bytes(range(256)) * 4)[15:]


def test_list_is_recursive_under_a_directory_prefix_with_sizes(storage):
    before = time.time()
    storage.write("t/_delta_log/00000000000000000000.json", b"abc")
    storage.write("t/ab/part-1.parquet", b"12345")
    storage.write("t/part-0.parquet", b"1")
    storage.write("tt/part-0.parquet", b"22")   # shares the string prefix "t", not the directory
    assert sorted((e.path, e.size) for e in storage.list("t")) == [
        ("t/_delta_log/00000000000000000000.json", 3), ("t/ab/part-1.parquet", 5), ("t/part-0.parquet", 1)]
    assert sorted(e.path for e in storage.list("")) == [
        "t/_delta_log/00000000000000000000.json", "t/ab/part-1.parquet", "t/part-0.parquet", "tt/part-0.parquet"]
    assert all(before - 5 <= e.modified <= time.time() + 5 for e in storage.list(""))
    assert storage.list("none") == []


def test_delete_removes_a_file_and_takes_a_missing_one_quietly(storage):
    storage.write("t/part-0.parquet", b"1")
    storage.delete("t/part-0.parquet")
    assert not storage.exists("t/part-0.parquet")
    storage.delete("t/part-0.parquet")


def test_delta_rs_reaches_the_same_store_with_the_uri_and_options_given(storage):
    root, options = storage.delta_rs()
    deltalake.write_deltalake(f"{root}/t", pa.table({"id": [1, 2]}), storage_options=options)
    deltalake.write_deltalake(f"{root}/t", pa.table({"id": [3]}), mode="append", storage_options=options)
    assert storage.exists("t/_delta_log/00000000000000000001.json")
    table = deltalake.DeltaTable(f"{root}/t", storage_options=options)
    assert table.version() == 1
    assert sorted(table.to_pyarrow_table().column("id").to_pylist()) == [1, 2, 3]


# the object store's own errors


def test_an_object_store_upload_aborted_by_an_error_leaves_no_multipart_upload(s3_url):
    storage = open_storage(s3_url)
    with pytest.raises(RuntimeError), storage.open_write("t/part-0.parquet") as f:
        f.write(b"x" * 12 * 1024 * 1024)
        raise RuntimeError("writer failed")
    bucket = s3_url.removeprefix("s3://").split("/")[0]
    assert boto3.client("s3").list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


def test_a_missing_bucket_is_one_line_saying_to_create_it(s3_url, s3_server):
    with pytest.raises(UserError) as error:
        open_storage("s3://no-such-bucket/warehouse")
    assert str(error.value) == (f"s3://no-such-bucket/warehouse: the bucket 'no-such-bucket' does not exist at "
                                f"{s3_server.endpoint}: create it, or correct the warehouse URL")


def test_a_bucket_removed_under_an_open_warehouse_is_one_line_at_the_next_write(s3_url):
    storage = open_storage(s3_url)
    boto3.client("s3").delete_bucket(Bucket=s3_url.removeprefix("s3://").split("/")[0])
    with pytest.raises(UserError, match=r"^s3://\S+: the bucket '\S+' does not exist at http://127.0.0.1:\d+: create it"):
        storage.write("t/a.json", b"1")
    with pytest.raises(UserError, match="does not exist"), storage.open_write("t/part-0.parquet") as f:
        f.write(b"x")   # the upload is sent when the block ends


@pytest.fixture(scope="module")
def checking_s3_server(tmp_path_factory: pytest.TempPathFactory):
    """A moto server that checks credentials: it knows none, so every key is refused."""
    server = MotoServer(tmp_path_factory.mktemp("moto-auth") / "moto.log", env={"INITIAL_NO_AUTH_ACTION_COUNT": "0"})
    server.start()
    yield server
    server.stop()


@pytest.mark.s3   # a server of its own (checking_s3_server)
def test_refused_credentials_are_one_line_naming_the_variables(checking_s3_server, monkeypatch):
    checking_s3_server.apply_env(monkeypatch)
    with pytest.raises(UserError) as error:
        open_storage("s3://bucket-x/warehouse")
    assert str(error.value) == (
        f"s3://bucket-x/warehouse: access denied (InvalidAccessKeyId) at {checking_s3_server.endpoint}: "
        "check the credentials in AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (AWS_SESSION_TOKEN)")


def test_an_unreachable_endpoint_is_one_line_naming_it(s3_url, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")   # port 1: nothing listens (tcpmux is long gone)
    with pytest.raises(UserError) as error:
        open_storage(s3_url)
    assert str(error.value) == (f"{s3_url}: cannot reach the object store at http://127.0.0.1:1: "
                                "check the endpoint (AWS_ENDPOINT_URL), and that the server runs")


@pytest.mark.parametrize(("url", "message"), [
    ("ftp://host/warehouse", "ftp://host/warehouse: not a warehouse URL: use a local path, s3://, gs://, az:// or abfss://"),
    ("s3:///warehouse", "s3:///warehouse: the URL names no bucket: use s3://BUCKET/PATH"),
])
def test_a_url_naming_no_object_store_is_one_line(url, message):
    with pytest.raises(UserError) as error:
        open_storage(url)
    assert str(error.value) == message


OUTSIDE = ["../escaped", "/escaped", "t/../../escaped", "t/./x", "t//x", "..", "."]


def _every_operation(storage: Storage, path: str) -> dict[str, Callable[[], object]]:
    def open_write() -> None:
        with storage.open_write(path) as f:
            f.write(b"x")

    return {"read": lambda: storage.read(path), "exists": lambda: storage.exists(path),
            "write": lambda: storage.write(path, b"x"), "put_if_absent": lambda: storage.put_if_absent(path, b"x"),
            "open_write": open_write, "open_read": lambda: storage.open_read(path),
            "list": lambda: storage.list(path), "delete": lambda: storage.delete(path)}


def test_every_operation_refuses_a_path_leading_outside_the_warehouse_in_one_line(storage, url, tmp_path):
    storage.write("t/kept", b"kept")
    (tmp_path / "escaped").write_bytes(b"a file beside the warehouse")
    for path in OUTSIDE:
        for name, operation in _every_operation(storage, path).items():
            with pytest.raises(UserError, match=f"refused the path {re.escape(repr(path))}") as refused:
                operation()
            assert "\n" not in str(refused.value), (name, path)
    assert (tmp_path / "escaped").read_bytes() == b"a file beside the warehouse"
    assert [e.path for e in storage.list("")] == ["t/kept"]


def test_a_symbolic_link_out_of_a_local_warehouse_is_refused(tmp_path):
    storage = LocalStorage(tmp_path / "warehouse")
    storage.write("t/kept", b"kept")
    beside = tmp_path / "beside"
    beside.mkdir()
    (beside / "part-0.parquet").write_bytes(b"theirs")
    (tmp_path / "warehouse" / "t" / "link").symlink_to(beside)
    for name, operation in _every_operation(storage, "t/link/part-0.parquet").items():
        with pytest.raises(UserError, match="a symbolic link leads it outside the warehouse"):
            operation()
        assert (beside / "part-0.parquet").read_bytes() == b"theirs", name
    assert sorted(p.name for p in beside.iterdir()) == ["part-0.parquet"]
    assert storage.read("t/kept") == b"kept"   # links inside it are followed
    (tmp_path / "warehouse" / "u").symlink_to(tmp_path / "warehouse" / "t")
    assert storage.read("u/kept") == b"kept"
