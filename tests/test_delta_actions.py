"""A Delta log's entries become actions at one boundary (replicator.targets.delta.actions): what
delta-rs writes reads as it is, and an entry lacking a field replicator relies on, or holding it in
another type, is refused in one line naming the file, the line and the field."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable, write_deltalake

from replicator.targets.delta import log as delta_log
from replicator.targets.delta.actions import MalformedLog, parse_commit
from replicator.targets.delta.storage import LocalStorage

ADD = {"path": "part-0.parquet", "partitionValues": {}, "size": 10, "modificationTime": 0, "dataChange": True,
       "stats": json.dumps({"numRecords": 3}),
       "deletionVector": {"storageType": "u", "pathOrInlineDv": "vBn[lx{q8@P<9BNH/isA", "offset": 1,
                          "sizeInBytes": 36, "cardinality": 1}}


def _line(action: dict) -> bytes:
    return json.dumps(action).encode() + b"\n"


def test_the_commits_and_checkpoint_delta_rs_writes_read_as_the_table_it_reads(tmp_path):
    uri = tmp_path / "t"
    write_deltalake(str(uri), pa.table({"id": [1, 2, 3]}))
    write_deltalake(str(uri), pa.table({"id": [4]}), mode="append")
    DeltaTable(str(uri)).create_checkpoint()
    DeltaTable(str(uri)).delete("id = 2")
    snapshot = delta_log.load(LocalStorage(tmp_path), "t", tombstones=True)
    table = DeltaTable(str(uri))
    assert snapshot.version == table.version() == 2
    assert set(snapshot.files) == {Path(uri).name for uri in table.file_uris()}
    assert snapshot.metadata is not None and snapshot.metadata["id"] == table.metadata().id
    assert snapshot.tombstones   # the file the delete rewrote


@pytest.mark.parametrize(("line", "why"), [
    (b"{not json", "it is not JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))"),
    (b"[1, 2]", "it is an array, not an object"),
    (_line({"add": "part-0.parquet"}), "its add is a string, not an object"),
    (_line({"add": {**ADD, "size": "10"}}), "its add.size is a string, not an integer"),
    (_line({"add": {**ADD, "size": True}}), "its add.size is a boolean, not an integer"),
    (_line({"add": {**ADD, "dataChange": "true"}}), "its add.dataChange is a string, not a boolean"),
    (_line({"add": {k: v for k, v in ADD.items() if k != "path"}}), "its add has no path"),
    (_line({"add": {**ADD, "deletionVector": {**ADD["deletionVector"], "cardinality": None}}}),
     "its add.deletionVector.cardinality is null, not an integer"),
    (_line({"remove": {"path": 7, "dataChange": True}}), "its remove.path is an integer, not a string"),
    (_line({"txn": {"appId": "q/c", "version": "12"}}), "its txn.version is a string, not an integer"),
    (_line({"metaData": {"id": "x", "schemaString": {"type": "struct"}}}),
     "its metaData.schemaString is an object, not a string"),
    (_line({"protocol": {"minReaderVersion": 3, "minWriterVersion": 7, "writerFeatures": "deletionVectors"}}),
     "its protocol.writerFeatures is a string, not an array or null"),
])
def test_a_malformed_entry_is_refused_in_one_line_naming_its_line_and_field(line, why):
    commit = _line({"commitInfo": {"operation": "WRITE"}}) + line
    with pytest.raises(MalformedLog) as refused:
        parse_commit(commit, "wh/t/_delta_log/00000000000000000001.json")
    assert str(refused.value) == (
        f"wh/t/_delta_log/00000000000000000001.json line 2 is not a Delta log entry replicator can read: {why}; "
        f"repair the table's log with the writer that made it, or restore the file")


def test_fields_replicator_does_not_read_and_kinds_it_does_not_know_are_kept_as_they_come():
    commit = (_line({"add": {**ADD, "tags": None, "baseRowId": 4, "deletionVector": None}})
              + _line({"cdc": {"path": "_change_data/x.parquet"}}) + _line({"domainMetadata": {"domain": "d"}}))
    assert parse_commit(commit, "c") == [{"add": {**ADD, "tags": None, "baseRowId": 4, "deletionVector": None}},
                                         {"cdc": {"path": "_change_data/x.parquet"}}, {"domainMetadata": {"domain": "d"}}]


def test_a_malformed_checkpoint_row_is_refused_naming_the_checkpoint(tmp_path):
    log_dir = tmp_path / "t" / "_delta_log"
    log_dir.mkdir(parents=True)
    pq.write_table(pa.table({"txn": [{"appId": "q/c", "version": None}]}), log_dir / f"{0:020d}.checkpoint.parquet")
    with pytest.raises(MalformedLog, match=rf"^{re.escape(str(tmp_path))}/t/_delta_log/00000000000000000000\.checkpoint\.parquet "
                                           r"row 1 is not a Delta log entry replicator can read: its txn has no "
                                           r"version;"):
        delta_log.load(LocalStorage(tmp_path), "t")


def test_a_refusal_names_the_commit_file_in_the_warehouse(tmp_path):
    uri = tmp_path / "t"
    write_deltalake(str(uri), pa.table({"id": [1]}))
    (uri / "_delta_log" / f"{1:020d}.json").write_bytes(_line({"txn": {"appId": "q/c"}}))
    with pytest.raises(MalformedLog, match=rf"^{re.escape(str(tmp_path))}/t/_delta_log/00000000000000000001\.json line 1 is not a "
                                           r"Delta log entry replicator can read: its txn has no version;"):
        delta_log.load(LocalStorage(tmp_path), "t")


def test_an_unreadable_commit_at_the_version_a_commit_was_for_is_another_writer_s(tmp_path):
    storage = LocalStorage(tmp_path)
    snapshot = delta_log.Snapshot("t")
    Path(tmp_path / "t" / "_delta_log").mkdir(parents=True)
    (tmp_path / "t" / "_delta_log" / f"{0:020d}.json").write_bytes(b"{torn")
    with pytest.raises(delta_log.CommitConflict):
        delta_log.commit(storage, snapshot, [], operation="WRITE")
