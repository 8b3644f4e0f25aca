"""TFRecord files: TFRecordDataset reads them and TFRecordWriter writes them, with TensorFlow's framing.

A record is: length (uint64 little-endian), masked CRC-32C of those 8 bytes, the data, masked CRC-32C of the
data. The whole file may be GZIP- or ZLIB-compressed.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import google_crc32c

from shardflow.data.sources.errors import DataLossError
from shardflow.data.sources.files import ByteStream, compression_type_name
from shardflow.data.sources.reader import FileDataset, RecordReader

_HEADER = struct.Struct("<QI")  # length, masked CRC of the length
_LENGTH = struct.Struct("<Q")
_CRC = struct.Struct("<I")
HEADER_BYTES = _HEADER.size
FOOTER_BYTES = _CRC.size
_MASK_DELTA = 0xA282EAD8


def masked_crc32c(data: bytes) -> int:
    """CRC-32C rotated and offset as TFRecord stores it, so that a CRC of data holding CRCs stays strong."""
    crc: int = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


@dataclass(frozen=True, kw_only=True)
class TFRecordOptions:
    """How a TFRecord file is compressed (tf.io.TFRecordOptions, without its buffer tuning)."""

    compression_type: str | None = None
    """None or "" (plain), "GZIP" or "ZLIB"."""
    compression_level: int | None = None
    """zlib level 0-9; None is zlib's default (6)."""

    def __post_init__(self) -> None:
        compression_type_name(self.compression_type)
        if self.compression_level is not None and not 0 <= self.compression_level <= 9:
            raise ValueError(f"compression_level must be in 0..9, got {self.compression_level}")


class TFRecordDataset(FileDataset[bytes]):
    """The records of one or more TFRecord files, in order, as tf.data.TFRecordDataset. Both CRCs of every
    record are checked; a corrupt or truncated file raises DataLossError naming the file and the offset of the
    bad record (in the uncompressed stream), after yielding the records before it.

    Iterator state: {"file_index", "offset": byte offset of the next record, "record_index": records read}.
    """

    def __init__(
        self,
        filenames: object,
        compression_type: str | None = None,
        buffer_size: int | None = None,
        num_parallel_reads: int | None = None,
    ) -> None:
        super().__init__(filenames, num_parallel_reads)
        self.compression_type = compression_type_name(compression_type)
        self.buffer_size = buffer_size

    def open_reader(self, filename: str, position: dict[str, Any] | None) -> TFRecordReader:
        position = position or {}
        stream = ByteStream(filename, self.compression_type, self.buffer_size, int(position.get("offset", 0)))
        return TFRecordReader(stream, int(position.get("record_index", 0)))


class TFRecordReader(RecordReader[bytes]):
    """Frames the records of a chunk in one loop; a record longer than the chunk makes the next read longer."""

    def __init__(self, stream: ByteStream, record_index: int = 0) -> None:
        self.stream = stream
        self._pending = b""  # bytes after the last whole record framed
        self._batch: list[bytes] = []
        self._batch_offset = stream.offset
        self._first_record = record_index

    def read_batch(self) -> list[bytes]:
        self._batch_offset = self.stream.offset - len(self._pending)
        self._first_record += len(self._batch)
        self._batch = []
        data = self._pending
        needed = HEADER_BYTES
        while True:
            if len(data) >= needed:
                batch, consumed, needed, error = self._frame(data)
                if batch:
                    # Records before a corrupt one are returned first; the next call frames it again and raises.
                    self._pending, self._batch = data[consumed:], batch
                    return batch
                if error is not None:
                    raise error
            chunk = self.stream.read_chunk(needed - len(data))
            if not chunk:
                self._pending = b""
                if data:
                    raise DataLossError(
                        self.stream.filename,
                        self._batch_offset,
                        f"truncated record {self._first_record}: the file ends {len(data)} bytes into it",
                    )
                return []
            data = data + chunk if data else chunk

    def _frame(self, data: bytes) -> tuple[list[bytes], int, int, DataLossError | None]:
        """The whole records at the start of `data`, the bytes they take, the bytes the next record needs, and
        the error that stopped framing, if any."""
        records: list[bytes] = []
        append = records.append
        unpack_header = _HEADER.unpack_from
        unpack_crc = _CRC.unpack_from
        size = len(data)
        start = 0
        problem = None
        while size - start >= HEADER_BYTES:
            length, length_crc = unpack_header(data, start)
            if masked_crc32c(data[start : start + 8]) != length_crc:
                problem = "corrupted length (CRC mismatch)"
                break
            end = start + HEADER_BYTES + length
            if end + FOOTER_BYTES > size:
                return records, start, end + FOOTER_BYTES - start, None
            record = data[start + HEADER_BYTES : end]
            if masked_crc32c(record) != unpack_crc(data, end)[0]:
                problem = "corrupted data (CRC mismatch)"
                break
            append(record)
            start = end + FOOTER_BYTES
        if problem is None:
            return records, start, HEADER_BYTES, None
        index = self._first_record + len(records)
        error = DataLossError(self.stream.filename, self._batch_offset + start, f"record {index}: {problem}")
        return records, start, HEADER_BYTES, error

    def position(self, count: int) -> dict[str, Any]:
        offset = self._batch_offset + count * (HEADER_BYTES + FOOTER_BYTES)
        offset += sum(len(record) for record in self._batch[:count])
        return {"offset": offset, "record_index": self._first_record + count}

    def close(self) -> None:
        self.stream.close()


class TFRecordWriter:
    """Writes records to a TFRecord file (tf.io.TFRecordWriter): `options` is a TFRecordOptions or a
    compression type ("GZIP", "ZLIB", "" or None). Use it as a context manager, or call close()."""

    def __init__(self, path: str, options: TFRecordOptions | str | None = None) -> None:
        if not isinstance(options, TFRecordOptions):
            options = TFRecordOptions(compression_type=options)
        self.path = path
        window_bits = {"": 0, "GZIP": 31, "ZLIB": 15}[compression_type_name(options.compression_type)]
        level = -1 if options.compression_level is None else options.compression_level
        self._compressor = zlib.compressobj(level, zlib.DEFLATED, window_bits) if window_bits else None
        self._file = open(path, "wb")  # noqa: SIM115 - closed by close()

    def write(self, record: bytes) -> None:
        length = _LENGTH.pack(len(record))
        framed = b"".join((length, _CRC.pack(masked_crc32c(length)), record, _CRC.pack(masked_crc32c(record))))
        self._file.write(self._compressor.compress(framed) if self._compressor else framed)

    def flush(self) -> None:
        if self._compressor is not None:
            self._file.write(self._compressor.flush(zlib.Z_SYNC_FLUSH))
        self._file.flush()

    def close(self) -> None:
        if self._file.closed:
            return
        if self._compressor is not None:
            self._file.write(self._compressor.flush())
        self._file.close()

    def __enter__(self) -> TFRecordWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()
