"""Deletion vectors: which rows of a Delta data file are deleted, without rewriting it.

A batch that updates or deletes rows of a large file marks their positions in the
file's deletion vector and appends the new rows in a new file (merge-on-read): its
cost is the batch's, not the file's. Format (Delta protocol, "Deletion Vector
Format"): a RoaringBitmapArray in its portable serialization — magic 1681511377
(int32 LE), the number of 32-bit bitmaps (int64 LE), then per bitmap its high 32 bits
(int32 LE) and the bitmap (Roaring's portable format) — stored in a file
``deletion_vector_<uuid>.bin`` that starts with a version byte (1) and holds, per
vector, its size (int32 BE), its data and the data's CRC-32 (int32 BE). A file's
descriptor names the file by its UUID in Z85 (storage type ``u``), the vector's
offset (of its size field) and size, and the count of deleted rows.

Read, as Delta's own reader reads them: vectors inline in the log (``i``, Z85 of the
serialized bitmap), in a file named by absolute path (``p``), and the native
serialization Delta's RoaringBitmapArray also reads — magic 1681511376, the number of
bitmaps (int32 LE), then per bitmap (its high 32 bits: its place) its size (int32 LE) and
the bitmap.
"""

from __future__ import annotations

import struct
import uuid
import zlib
from collections.abc import Iterable
from typing import Any

from pyroaring import BitMap

from replicator.errors import UserError
from replicator.targets.delta.actions import DeletionVector

MAGIC = 1681511377
NATIVE_MAGIC = 1681511376
FORMAT_VERSION = 1
_Z85 = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#"
_Z85_VALUE = {c: i for i, c in enumerate(_Z85)}


def z85_encode(data: bytes) -> str:
    """Z85 (ZeroMQ's base-85) of data whose length is a multiple of 4."""
    out: list[str] = []
    for i in range(0, len(data), 4):
        value = int.from_bytes(data[i:i + 4], "big")
        chunk = []
        for _ in range(5):
            value, digit = divmod(value, 85)
            chunk.append(_Z85[digit])
        out.extend(reversed(chunk))
    return "".join(out)


def z85_decode(text: str) -> bytes:
    out = bytearray()
    for i in range(0, len(text), 5):
        value = 0
        for ch in text[i:i + 5]:
            value = value * 85 + _Z85_VALUE[ch]
        out += value.to_bytes(4, "big")
    return bytes(out)


def file_name(file_id: uuid.UUID) -> str:
    return f"deletion_vector_{file_id}.bin"


def serialize(positions: BitMap) -> bytes:
    """A bitmap of row positions (below 2**32: a data file replicator writes holds fewer rows)
    as a RoaringBitmapArray."""
    return struct.pack("<iqi", MAGIC, 1, 0) + positions.serialize() if positions else struct.pack("<iq", MAGIC, 0)


def deserialize(data: bytes) -> BitMap:
    """The row positions of a serialized RoaringBitmapArray (portable or native); ValueError
    when the data is not one."""
    try:
        return _bitmaps(data)
    except struct.error as exc:
        raise ValueError(f"its data ends early or is malformed ({exc})") from None


def _bitmaps(data: bytes) -> BitMap:
    (magic,) = struct.unpack_from("<i", data)
    if magic == MAGIC:
        (count,) = struct.unpack_from("<q", data, 4)
        offset = 12
    elif magic == NATIVE_MAGIC:
        (count,) = struct.unpack_from("<i", data, 4)
        offset = 8
    else:
        raise ValueError(f"not a deletion vector (magic {magic})")
    if not 0 <= count <= len(data) - offset:   # each bitmap takes bytes
        raise ValueError(f"it counts {count} bitmaps in {len(data)} bytes")
    positions = BitMap()
    for place in range(count):
        if magic == MAGIC:
            (high,) = struct.unpack_from("<i", data, offset)
            start = offset + 4
            bitmap = BitMap.deserialize(data[start:])
            offset = start + len(bitmap.serialize())
        else:
            (size,) = struct.unpack_from("<i", data, offset)
            high, start = place, offset + 4
            if not 0 <= size <= len(data) - start:
                raise ValueError(f"its bitmap {place} is {size} bytes, past its end")
            bitmap = BitMap.deserialize(data[start:start + size])
            offset = start + size
        if high and bitmap:
            raise UserError("a deletion vector marks rows past 2**32 of one file: replicator does not read such files")
        positions |= bitmap
    return positions


class VectorFile:
    """The deletion vectors of one commit, gathered into one file."""

    def __init__(self) -> None:
        self.id = uuid.uuid4()
        self.data = bytearray([FORMAT_VERSION])

    @property
    def name(self) -> str:
        return file_name(self.id)

    def add(self, positions: BitMap) -> DeletionVector:
        """Appends a vector; returns its descriptor (the ``deletionVector`` of an add action)."""
        vector = serialize(positions)
        offset = len(self.data)
        self.data += struct.pack(">i", len(vector)) + vector + struct.pack(">I", zlib.crc32(vector))
        return {"storageType": "u", "pathOrInlineDv": z85_encode(self.id.bytes), "offset": offset,
                "sizeInBytes": len(vector), "cardinality": len(positions)}


def descriptor_file(descriptor: DeletionVector) -> str | None:
    """The file a descriptor's vector is stored in, as the log names it (relative to the table;
    absolute for storage type ``p``); None for an inline one."""
    kind, where = descriptor["storageType"], descriptor["pathOrInlineDv"]
    if kind == "i":
        return None
    if kind == "p":
        return str(where)
    if kind != "u":
        raise UserError(f"a deletion vector of storage type {kind!r}, which the Delta protocol does not define: "
                        f"replicator cannot read the table; run OPTIMIZE on the table with its writer to purge it")
    prefix, encoded = where[:-20], where[-20:]
    return (f"{prefix}/" if prefix else "") + file_name(uuid.UUID(bytes=z85_decode(encoded)))


def read(descriptor: DeletionVector, read_file: Any) -> BitMap:
    """The positions a descriptor marks; read_file(path as the log names it) -> bytes reads a
    vector file. A vector that is malformed, fails its checksum or marks another number of rows
    than its descriptor's cardinality is refused in one line (Delta's reader refuses it too)."""
    path = descriptor_file(descriptor)
    where = ("an inline deletion vector" if path is None else
             f"the deletion vector in {path} at offset {descriptor.get('offset') or 1}")
    try:
        if path is None:
            positions = deserialize(z85_decode(descriptor["pathOrInlineDv"]))
        else:
            positions = deserialize(_vector(read_file(path), int(descriptor.get("offset") or 1)))
    except (ValueError, KeyError, struct.error) as exc:
        raise _unreadable(where, str(exc)) from None
    cardinality = descriptor.get("cardinality")
    if cardinality is not None and len(positions) != cardinality:
        raise _unreadable(where, f"it marks {len(positions)} rows, its descriptor {cardinality}")
    return positions


def _vector(data: bytes, offset: int) -> bytes:
    """The vector at offset of a vector file's data, its checksum verified."""
    if offset < 1:   # past the file's version byte
        raise ValueError(f"its offset {offset} is before the file's first vector")
    (size,) = struct.unpack_from(">i", data, offset)
    if size < 0 or offset + 4 + size + 4 > len(data):
        raise ValueError(f"its size {size} is past the file's end ({len(data)} bytes)")
    vector = data[offset + 4:offset + 4 + size]
    (checksum,) = struct.unpack_from(">I", data, offset + 4 + size)
    if zlib.crc32(vector) != checksum:
        raise ValueError("it fails its checksum")
    return vector


def _unreadable(where: str, why: str) -> UserError:
    return UserError(f"{where} cannot be read: {why}: run OPTIMIZE on the table with the writer that made it "
                     f"(or restore the file)")


def union(old: BitMap | None, positions: Iterable[int]) -> BitMap:
    new = BitMap(old) if old is not None else BitMap()
    new.update(positions)
    return new
