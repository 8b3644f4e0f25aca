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

import numpy as np

from shardflow.data.element_spec import STRING, TensorSpec
from shardflow.data.sources.errors import DataLossError
from shardflow.data.sources.files import ByteStream, compression_type_name
from shardflow.data.sources.reader import FileDataset, RecordReader
from shardflow.data.sources.tfrecord_crc import FOOTER_BYTES, HEADER_BYTES, all_intact, first_corrupt, masked_crc32c

_HEADER = struct.Struct("<QI")  # length, masked CRC of the length
_LENGTH = struct.Struct("<Q")
_CRC = struct.Struct("<I")


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

    def _element_spec(self) -> TensorSpec:
        return STRING


class TFRecordReader(RecordReader[bytes]):
    """Frames the records of a chunk at a time; a record longer than the chunk makes the next read longer.

    Only the walk from one length field to the next is a Python loop; the CRCs of the whole chunk are then checked
    at once (tfrecord_crc.py)."""

    def __init__(self, stream: ByteStream, record_index: int = 0) -> None:
        self.stream = stream
        self._pending = b""  # bytes after the last whole record framed
        self._batch_ends: list[int] = []  # where each record of the last batch ends, from the batch's first byte
        self._batch_offset = stream.offset
        self._first_record = record_index

    def read_batch(self) -> list[bytes]:
        self._batch_offset = self.stream.offset - len(self._pending)
        self._first_record += len(self._batch_ends)
        self._batch_ends = []
        data = self._pending
        needed = HEADER_BYTES
        while True:
            if len(data) >= needed:
                batch, ends, needed, error = self._frame(data)
                if batch:
                    # Records before a corrupt one are returned first; the next call frames it again and raises.
                    self._pending, self._batch_ends = data[ends[-1] :], ends
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

    def _frame(self, data: bytes) -> tuple[list[bytes], list[int], int, DataLossError | None]:
        """The whole, intact records at the start of `data`, where each ends, the bytes the record after them
        needs, and the error that stopped framing, if any."""
        ends = _record_ends(data)
        starts = [0, *ends[:-1]] if ends else []
        records = [data[start + HEADER_BYTES : end - FOOTER_BYTES] for start, end in zip(starts, ends, strict=True)]
        bad, problem = len(ends), None
        if not all_intact(data, np.fromiter(ends, dtype=np.int64, count=len(ends))):
            bad, problem = first_corrupt(data, starts, ends)
        needed = HEADER_BYTES
        position = ends[-1] if ends else 0
        if problem is None and len(data) - position >= HEADER_BYTES:
            # The partial record after the whole ones: a corrupt length is reported now, not after reading as many
            # bytes as it claims.
            length, length_crc = _HEADER.unpack_from(data, position)
            if masked_crc32c(data[position : position + 8]) != length_crc:
                bad, problem = len(ends), "corrupted length (CRC mismatch)"
            else:
                needed = HEADER_BYTES + length + FOOTER_BYTES
        if problem is None:
            return records, ends, needed, None
        offset = self._batch_offset + (ends[bad - 1] if bad else 0)
        error = DataLossError(self.stream.filename, offset, f"record {self._first_record + bad}: {problem}")
        return records[:bad], ends[:bad], HEADER_BYTES, error

    def position(self, count: int) -> dict[str, Any]:
        offset = self._batch_offset + (self._batch_ends[count - 1] if count else 0)
        return {"offset": offset, "record_index": self._first_record + count}

    def close(self) -> None:
        self.stream.close()


def _record_ends(data: bytes) -> list[int]:
    """Where each whole record at the start of `data` ends, trusting the length fields (checked afterwards)."""
    ends: list[int] = []
    append = ends.append
    unpack_length = _LENGTH.unpack_from
    last_header = len(data) - HEADER_BYTES
    size = len(data)
    position = 0
    while position <= last_header:
        end = position + HEADER_BYTES + FOOTER_BYTES + unpack_length(data, position)[0]
        if end > size:
            break
        append(end)
        position = end
    return ends


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
