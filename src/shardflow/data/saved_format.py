"""shardflow's on-disk format for `save`, `load` and `snapshot` (not TensorFlow's), with no pickle anywhere.

A saved dataset is a directory:

- `manifest.json`: {"format": "shardflow-saved-dataset", "version": 1, "compression": null or "GZIP",
  "shards": [{"file": name, "num_elements": n}, ...]}, shards in shard-index order. It is written last, to a
  temporary name renamed over the old one, so it always names a complete set of shard files: replacing a saved
  dataset is atomic, and a directory without a manifest holds no readable dataset.
- one file per shard, named after the run that wrote it (`<run>-shard-<index>.sfdata`), itself written to a temporary
  name and renamed when complete (a run that dies before its commit leaves files no manifest names, never read):
  - the magic `SFSAVED1`;
  - records `[u32 header length][u64 stored length][u32 CRC-32 of header and stored bytes][header][stored bytes]`,
    where the header is msgpack of the element's codec spec (structure, then dtype, shape and size of each leaf,
    see codec.py) and the payload length, and the stored bytes are the leaves' raw buffers, each 64-byte aligned,
    deflated with zlib when the compression is "GZIP";
  - the records' offsets as little-endian int64, then the footer `[u64 count][u64 offsets position][magic]`.

A damaged file raises DataLossError naming the file and the byte offset of the damage.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import secrets
import struct
import zlib
from typing import Any, NoReturn

import msgpack
import numpy as np

from shardflow.data import codec
from shardflow.data.errors import DataLossError

MAGIC = b"SFSAVED1"
MANIFEST = "manifest.json"
FORMAT_NAME = "shardflow-saved-dataset"
_RECORD_HEAD = struct.Struct("<IQI")
_FOOTER = struct.Struct("<QQ8s")

COMPRESSIONS = (None, "GZIP")


def resolve_compression(compression: str | None, operation: str) -> str | None:
    """None or "GZIP"; "" and "NONE" mean None, and for snapshot "AUTO" means None (uncompressed is fastest)."""
    value = compression.upper() if isinstance(compression, str) else compression
    if value in ("", "NONE") or (value == "AUTO" and operation == "snapshot"):
        return None
    if value not in COMPRESSIONS:
        allowed = "None, 'GZIP'" + (" or 'AUTO'" if operation == "snapshot" else "")
        raise ValueError(f"{operation} compression must be {allowed}, got {compression!r}")
    return value


def data_loss(path: str, offset: int, problem: str) -> NoReturn:
    raise DataLossError(path, offset, problem)


class ShardWriter:
    """Appends elements to one shard file under a temporary name; `finish` renames it into place."""

    def __init__(self, path: str, compression: str | None) -> None:
        self.path = path
        self._compression = compression
        self._temporary = f"{path}.tmp-{secrets.token_hex(4)}"
        self._file: io.BufferedWriter = open(self._temporary, "wb")  # noqa: SIM115 - closed in finish() or abandon()
        self._file.write(MAGIC)
        self._offsets: list[int] = []

    def append(self, element: Any) -> None:
        encoded = codec.encode(element)
        payload = bytearray(encoded.nbytes)
        codec.write(encoded, memoryview(payload), 0)
        stored = zlib.compress(payload, 6) if self._compression == "GZIP" else payload
        header = msgpack.packb([encoded.spec, len(payload)])
        checksum = zlib.crc32(stored, zlib.crc32(header))
        self._offsets.append(self._file.tell())
        self._file.write(_RECORD_HEAD.pack(len(header), len(stored), checksum) + header)
        self._file.write(stored)

    @property
    def num_elements(self) -> int:
        return len(self._offsets)

    def finish(self) -> None:
        offsets_position = self._file.tell()
        self._file.write(np.asarray(self._offsets, dtype="<i8").tobytes())
        self._file.write(_FOOTER.pack(len(self._offsets), offsets_position, MAGIC))
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self._temporary, self.path)

    def abandon(self) -> None:
        self._file.close()
        os.unlink(self._temporary)


def write_manifest(directory: str, compression: str | None, shards: list[tuple[str, int]]) -> dict[str, Any]:
    """Commits a saved dataset: the manifest naming `shards` (file name, element count) replaces the old one."""
    manifest = {
        "format": FORMAT_NAME,
        "version": 1,
        "compression": compression,
        "shards": [{"file": name, "num_elements": count} for name, count in shards],
    }
    temporary = os.path.join(directory, f"{MANIFEST}.tmp-{secrets.token_hex(4)}")
    with open(temporary, "w") as file:
        json.dump(manifest, file)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, os.path.join(directory, MANIFEST))
    return manifest


def read_manifest(directory: str) -> dict[str, Any] | None:
    """The manifest of the saved dataset in `directory`, or None if there is none."""
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path, "rb") as file:
            raw = file.read()
    except FileNotFoundError:
        return None
    try:
        manifest = json.loads(raw)
        valid = manifest["format"] == FORMAT_NAME and isinstance(manifest["shards"], list)
    except (ValueError, KeyError, TypeError):
        valid = False
    if not valid:
        data_loss(path, 0, "not a shardflow saved-dataset manifest")
    if manifest["version"] != 1:
        raise ValueError(f"{path}: saved-dataset format version {manifest['version']} is newer than this shardflow")
    return manifest  # type: ignore[no-any-return]


def remove_replaced(directory: str, old: dict[str, Any] | None, new: dict[str, Any]) -> None:
    """Deletes the shard files the `old` manifest named and the `new` one does not. Only those: files of another
    run still writing into the same directory (two workers filling one snapshot) are left alone."""
    kept = {shard["file"] for shard in new["shards"]}
    for shard in old["shards"] if old is not None else ():
        if shard["file"] not in kept:
            # Another run that replaced the same manifest may have removed it first.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(directory, shard["file"]))


class ShardReader:
    """Reads one shard file's records in order, from any index."""

    def __init__(self, path: str, compression: str | None) -> None:
        self.path = path
        self._compression = compression
        self._file: io.BufferedReader = open(path, "rb")  # noqa: SIM115 - closed in close()
        self._size = self._file.seek(0, os.SEEK_END)
        if self._size < len(MAGIC) + _FOOTER.size:
            self._corrupt(self._size, "the file is too short to be a shardflow saved-dataset shard")
        self._file.seek(0)
        if self._file.read(len(MAGIC)) != MAGIC:
            self._corrupt(0, "the file does not start with the shardflow saved-dataset magic")
        self._file.seek(self._size - _FOOTER.size)
        self.count, self._records_end, magic = _FOOTER.unpack(self._file.read(_FOOTER.size))
        if magic != MAGIC or self._records_end + 8 * self.count != self._size - _FOOTER.size:
            self._corrupt(self._size - _FOOTER.size, "the footer is damaged (a truncated or overwritten file)")
        self._index = 0
        self.seek(0)

    def _corrupt(self, offset: int, problem: str) -> NoReturn:
        self._file.close()
        data_loss(self.path, offset, problem)

    def seek(self, index: int) -> None:
        """Positions the reader before record `index` (`count` for the end)."""
        if index >= self.count:
            self._file.seek(self._records_end)
        else:
            self._file.seek(self._size - _FOOTER.size - 8 * self.count + 8 * index)
            (offset,) = struct.unpack("<q", self._file.read(8))
            if not len(MAGIC) <= offset < self._records_end:
                self._corrupt(self._size - _FOOTER.size - 8 * self.count + 8 * index, "a record offset is damaged")
            self._file.seek(offset)
        self._index = min(index, self.count)

    def read(self) -> Any:
        """The next record's element; StopIteration after the last."""
        if self._index >= self.count:
            raise StopIteration
        offset = self._file.tell()
        head = self._file.read(_RECORD_HEAD.size)
        if len(head) < _RECORD_HEAD.size:
            self._corrupt(offset, "a record header is truncated")
        header_length, stored_length, checksum = _RECORD_HEAD.unpack(head)
        if offset + _RECORD_HEAD.size + header_length + stored_length > self._records_end:
            self._corrupt(offset, "a record's lengths run past the end of the records (damaged header)")
        header = self._file.read(header_length)
        stored = self._file.read(stored_length)
        if zlib.crc32(stored, zlib.crc32(header)) != checksum:
            self._corrupt(offset, "a record's checksum does not match its contents")
        try:
            spec, payload_length = msgpack.unpackb(header)
            payload = bytearray(zlib.decompress(stored) if self._compression == "GZIP" else stored)
            if len(payload) != payload_length:
                raise ValueError("payload length mismatch")
            element = codec.decode(spec, memoryview(payload), 0, copy=False)
        except (ValueError, TypeError, IndexError, zlib.error, msgpack.UnpackException) as error:
            self._corrupt(offset, f"a record cannot be decoded ({error})")
        self._index += 1
        return element

    def close(self) -> None:
        self._file.close()
