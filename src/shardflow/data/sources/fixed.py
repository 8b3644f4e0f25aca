"""FixedLengthRecordDataset: records of a fixed number of bytes, after a header and before a footer."""

from __future__ import annotations

from typing import Any

from shardflow.data.element_spec import STRING, TensorSpec
from shardflow.data.sources.errors import DataLossError
from shardflow.data.sources.files import DEFAULT_BUFFER_SIZE, ByteStream, compression_type_name
from shardflow.data.sources.reader import FileDataset, RecordReader


class FixedLengthRecordDataset(FileDataset[bytes]):
    """The `record_bytes`-long records of one or more files, as tf.data.FixedLengthRecordDataset: every file
    starts with `header_bytes` and ends with `footer_bytes` that are not records. A body that is not a whole
    number of records raises DataLossError naming the file and the offset of the partial record.

    Iterator state: {"file_index", "offset": byte offset of the next record, "record_index": records read}.
    """

    def __init__(
        self,
        filenames: object,
        record_bytes: int,
        header_bytes: int | None = None,
        footer_bytes: int | None = None,
        buffer_size: int | None = None,
        compression_type: str | None = None,
        num_parallel_reads: int | None = None,
    ) -> None:
        super().__init__(filenames, num_parallel_reads)
        if record_bytes <= 0:
            raise ValueError(f"record_bytes must be positive, got {record_bytes}")
        if (header_bytes or 0) < 0 or (footer_bytes or 0) < 0:
            raise ValueError(f"header_bytes and footer_bytes must be >= 0, got {header_bytes} and {footer_bytes}")
        self.record_bytes = record_bytes
        self.header_bytes = header_bytes or 0
        self.footer_bytes = footer_bytes or 0
        # A chunk holds whole records, so that each batch is cut without copying a remainder around.
        self.buffer_size = max(1, (buffer_size or DEFAULT_BUFFER_SIZE) // record_bytes) * record_bytes
        self.compression_type = compression_type_name(compression_type)

    def open_reader(self, filename: str, position: dict[str, Any] | None) -> FixedLengthReader:
        position = position or {"offset": self.header_bytes, "record_index": 0}
        stream = ByteStream(filename, self.compression_type, self.buffer_size, int(position["offset"]))
        return FixedLengthReader(self, stream, int(position["record_index"]))

    def _element_spec(self) -> TensorSpec:
        return STRING


class FixedLengthReader(RecordReader[bytes]):
    """Cuts a stream into records, holding back the last `footer_bytes` until the stream ends."""

    def __init__(self, dataset: FixedLengthRecordDataset, stream: ByteStream, record_index: int) -> None:
        self._record_bytes = dataset.record_bytes
        self._header_bytes = dataset.header_bytes
        self._footer_bytes = dataset.footer_bytes
        self._stream = stream
        self._pending = b""
        self._batch_offset = stream.offset
        self._first_record = self._next_record = record_index

    def read_batch(self) -> list[bytes]:
        self._batch_offset = self._stream.offset - len(self._pending)
        self._first_record = self._next_record
        size = self._record_bytes
        data = self._pending
        while True:
            chunk = self._stream.read_chunk(size + self._footer_bytes - len(data))
            data = data + chunk if data else chunk
            if not chunk:
                self._pending = b""
                if len(data) != self._footer_bytes:
                    raise self._partial_record(len(data) - self._footer_bytes)
                return []
            num_records = (len(data) - self._footer_bytes) // size
            if num_records > 0:
                break
        end = num_records * size
        self._pending = data[end:]
        self._next_record += num_records
        if num_records == 1:
            return [data[:end]]
        return [data[start : start + size] for start in range(0, end, size)]

    def _partial_record(self, num_left: int) -> DataLossError:
        layout = f"{self._record_bytes}-byte records after a {self._header_bytes}-byte header"
        if num_left < 0:
            problem = f"the file ends {-num_left} bytes short of its {self._footer_bytes}-byte footer ({layout})"
        else:
            problem = f"partial record of {num_left} bytes before the {self._footer_bytes}-byte footer ({layout})"
        return DataLossError(self._stream.filename, self._batch_offset, problem)

    def position(self, count: int) -> dict[str, Any]:
        return {"offset": self._batch_offset + count * self._record_bytes, "record_index": self._first_record + count}

    def close(self) -> None:
        self._stream.close()
